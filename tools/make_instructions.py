"""Build instruction prompts offline from the running Python's standard library: a user message per
documented function ("Write a Python function `name(args)` that ...", "Explain ...", ...).

    python -m tools.make_instructions --split train --count 2000 --out prompts/instructions_train.jsonl
    python -m tools.make_instructions --split heldout --count 300 --out prompts/instructions_heldout.jsonl

The train split comes from modules outside jobs.build_corpus.HELD_OUT, the heldout split from those
modules only, so prompts used for benchmarks and evaluation never trained a draft head or predictor.
HumanEval prompts are never used. Deterministic for a given Python version: the template and the
sample are picked by a hash of the function's location. Rows: {"id": "<path>:<line>", "prompt": ...}.
"""
from __future__ import annotations

import ast
import json
import logging
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from jobs.build_corpus import HELD_OUT, is_held_out, list_sources
from jobs.cli import parse_config

log = logging.getLogger(__name__)

TEMPLATES = (
    "Write a Python function `{sig}` that {summary} Include a docstring.",
    "Implement `{sig}` in Python. It should {summary}",
    "In Python's standard library, what does `{module}.{qualname}` do? Explain briefly and show a short usage example.",
    "Explain what this Python code does, step by step:\n\n```python\n{code}\n```",
    "Write a Python function `{sig}` that {summary} Then write two assert statements that test it.",
)


@dataclass
class InstructionsConfig:
    out: Path = Path("prompts/instructions_train.jsonl")
    split: str = "train"  # "train": modules outside HELD_OUT | "heldout": the HELD_OUT modules
    count: int = 2000
    max_code_lines: int = 12
    stdlib: Path = Path(sysconfig.get_paths()["stdlib"])

    def __post_init__(self) -> None:
        self.out, self.stdlib = Path(self.out), Path(self.stdlib)
        if self.split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {self.split!r}")
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if not self.stdlib.is_dir():
            raise FileNotFoundError(f"standard library directory not found: {self.stdlib}")


def stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def summary_of(doc: str) -> str | None:
    """The docstring's first sentence as a clause ("Return the x." -> "returns the x."); None when
    it is too short or not prose."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", first)
    sentence = m.group(1) if m else first
    if not 20 <= len(sentence) <= 200 or not sentence[0].isalpha() or not sentence.isascii():
        return None
    words = sentence.split(" ", 1)
    verb = words[0]
    if verb.lower() in ("return", "get", "create", "convert", "check", "compute", "find", "make", "build",
                        "parse", "read", "write", "remove", "add", "set", "test", "split", "format", "encode",
                        "decode", "open", "close", "copy", "search", "match", "update", "load", "save"):
        verb = verb.lower() + ("es" if verb.lower().endswith(("s", "sh", "ch", "x")) else "s")
    else:
        verb = verb[0].lower() + verb[1:]
    clause = " ".join([verb] + words[1:])
    return clause if clause[-1] in ".!?" else clause + "."


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if node.args.vararg:
        args.append("*" + node.args.vararg.arg)
    args += [a.arg for a in node.args.kwonlyargs]
    if node.args.kwarg:
        args.append("**" + node.args.kwarg.arg)
    return f"{node.name}({', '.join(args)})"


def instructions(rel: str, source: str, cfg: InstructionsConfig) -> list[dict]:
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a few test fixtures are deliberately invalid Python
        return []
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    lines = source.splitlines()
    out = []
    for parent in ast.walk(tree):
        for node in ast.iter_child_nodes(parent):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = summary_of(doc) if doc else None
            if summary is None:
                continue
            qualname = f"{parent.name}.{node.name}" if isinstance(parent, ast.ClassDef) else node.name
            row_id = f"{rel}:{node.lineno}"
            template = TEMPLATES[stable_hash(row_id) % len(TEMPLATES)]
            code = "\n".join(lines[node.lineno - 1 : min(node.end_lineno or node.lineno, node.lineno - 1 + cfg.max_code_lines)])
            if "{code}" in template and not code.isascii():
                continue
            prompt = template.format(sig=signature(node), summary=summary, module=module, qualname=qualname,
                                     code=code)
            out.append({"id": row_id, "prompt": prompt})
    return out


def build(cfg: InstructionsConfig) -> list[dict]:
    want_held = cfg.split == "heldout"
    candidates = []
    for rel in list_sources(cfg.stdlib):
        if rel.startswith("test/") or is_held_out(rel, HELD_OUT) != want_held:
            continue
        candidates += instructions(rel, (cfg.stdlib / rel).read_text(encoding="utf-8", errors="replace"), cfg)
    if len(candidates) < cfg.count:
        raise ValueError(f"only {len(candidates)} documented functions in the {cfg.split} modules, asked for {cfg.count}")
    picked = sorted(candidates, key=lambda r: (stable_hash(r["id"] + "|pick"), r["id"]))[: cfg.count]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    with open(cfg.out, "w", encoding="utf-8") as f:
        for row in picked:
            f.write(json.dumps(row) + "\n")
    log.info("%d of %d candidate instructions (%s split) -> %s", len(picked), len(candidates), cfg.split, cfg.out)
    return picked


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(InstructionsConfig, __doc__, argv)
    rows = build(cfg)
    print(json.dumps({"out": str(cfg.out), "split": cfg.split, "rows": len(rows)}))


if __name__ == "__main__":
    main()
