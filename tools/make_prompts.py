"""Build the bundled sample prompts: the opening lines of functions and classes of the held-out
standard-library modules (code the bundled model never saw in training).

    python -m tools.make_prompts --out prompts/sample_prompts.jsonl --count 300

Deterministic for a given Python version: candidates are every def/class of the held-out
modules of the running Python's stdlib (jobs.build_corpus.HELD_OUT), cut to their first 3-8
lines (the count picked by a hash of the location), and the sample is the `count` candidates
with the smallest hash. Rows are {"id": "<path>:<line>", "prompt": "<snippet>\\n"}.
"""
from __future__ import annotations

import argparse
import ast
import json
import logging
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from jobs.build_corpus import HELD_OUT, is_held_out, list_sources

log = logging.getLogger(__name__)


@dataclass
class PromptsConfig:
    out: Path = Path("prompts/sample_prompts.jsonl")
    count: int = 300
    min_lines: int = 3
    max_lines: int = 8
    max_chars: int = 600  # keeps every prompt well inside the bundled model's context
    stdlib: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["stdlib"]))
    held_out: tuple[str, ...] = HELD_OUT

    def __post_init__(self) -> None:
        self.out, self.stdlib = Path(self.out), Path(self.stdlib)
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if not 1 <= self.min_lines <= self.max_lines:
            raise ValueError(f"need 1 <= min_lines <= max_lines, got {self.min_lines}, {self.max_lines}")
        if not self.stdlib.is_dir():
            raise FileNotFoundError(f"standard library directory not found: {self.stdlib}")


def stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def snippets(rel: str, source: str, cfg: PromptsConfig) -> list[dict]:
    """The opening lines of each def/class of one module: [{"id", "prompt"}]."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a few test fixtures are deliberately invalid Python
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        row_id = f"{rel}:{node.lineno}"
        n = cfg.min_lines + stable_hash(row_id) % (cfg.max_lines - cfg.min_lines + 1)
        end = min(node.lineno - 1 + n, node.end_lineno or node.lineno)
        text = "\n".join(lines[node.lineno - 1 : end]) + "\n"
        if end - node.lineno + 1 >= cfg.min_lines and len(text) <= cfg.max_chars and text.isascii():
            out.append({"id": row_id, "prompt": text})
    return out


def location(row: dict) -> tuple[str, int]:
    path, line = row["id"].rsplit(":", 1)
    return path, int(line)


def build(cfg: PromptsConfig) -> list[dict]:
    candidates = []
    for rel in list_sources(cfg.stdlib):
        if is_held_out(rel, cfg.held_out):
            candidates += snippets(rel, (cfg.stdlib / rel).read_text(encoding="utf-8", errors="replace"), cfg)
    if len(candidates) < cfg.count:
        raise ValueError(f"only {len(candidates)} snippets in the held-out modules, asked for {cfg.count}")
    picked = sorted(candidates, key=lambda r: (stable_hash(r["id"] + "|pick"), r["id"]))[: cfg.count]
    picked.sort(key=location)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    with open(cfg.out, "w", encoding="utf-8") as f:
        for row in picked:
            f.write(json.dumps(row) + "\n")
    log.info("%d of %d candidate snippets -> %s", len(picked), len(candidates), cfg.out)
    return picked


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="prompts/sample_prompts.jsonl")
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    rows = build(PromptsConfig(out=args.out, count=args.count, stdlib=args.stdlib))
    print(json.dumps({"out": args.out, "rows": len(rows), "modules": len({r["id"].rsplit(":", 1)[0] for r in rows})}))


if __name__ == "__main__":
    main()
