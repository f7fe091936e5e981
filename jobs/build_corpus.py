"""Build the training corpus from the running Python's standard library sources.

Split is by module (top-level package or module, plus the tests of held-out modules), so
held-out text is code the model never saw, not random windows of files it did see.

    python -m jobs.build_corpus --out data/corpus
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Held-out modules: whole packages/modules and their test suites. About 8% of the bytes.
HELD_OUT = (
    "asyncio", "email", "json", "xml", "http", "logging", "urllib", "concurrent", "tkinter",
    "test/test_asyncio", "test/test_email", "test/test_json", "test/test_xml_etree.py",
    "test/test_httplib.py", "test/test_logging.py", "test/test_urllib.py", "test/test_tkinter",
)


@dataclass
class CorpusConfig:
    out: Path
    stdlib: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["stdlib"]))
    held_out: tuple[str, ...] = HELD_OUT

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.stdlib = Path(self.stdlib)
        if not self.stdlib.is_dir():
            raise FileNotFoundError(f"standard library directory not found: {self.stdlib}")


def is_held_out(rel: str, held_out: tuple[str, ...]) -> bool:
    """rel is a '/'-separated path relative to the stdlib root."""
    for name in held_out:
        if rel == name or rel.startswith(name + "/") or rel == name + ".py":
            return True
    return False


def list_sources(stdlib: Path) -> list[str]:
    """Sorted relative paths of every .py file under stdlib, site-packages excluded."""
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                files.append(Path(dirpath, name).relative_to(stdlib).as_posix())
    return sorted(files)


def build(cfg: CorpusConfig) -> dict:
    cfg.out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    for rel in list_sources(cfg.stdlib):
        splits["heldout" if is_held_out(rel, cfg.held_out) else "train"].append(rel)
    manifest = {
        "python_version": platform.python_version(),
        "stdlib": str(cfg.stdlib),
        "held_out_modules": list(cfg.held_out),
    }
    for split, rels in splits.items():
        n_bytes = 0
        with open(cfg.out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for rel in rels:
                text = (cfg.stdlib / rel).read_text(encoding="utf-8", errors="replace")
                n_bytes += len(text.encode("utf-8"))
                f.write(json.dumps({"path": rel, "text": text}) + "\n")
        manifest[split] = {
            "files": len(rels),
            "bytes": n_bytes,
            "file_list_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest(),
        }
    total = manifest["train"]["bytes"] + manifest["heldout"]["bytes"]
    manifest["heldout_byte_share"] = manifest["heldout"]["bytes"] / total
    (cfg.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def iter_texts(path: Path):
    """Yield the text of each document of a corpus JSONL file."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def tokenize_split(corpus: Path, split: str, tokenizer, cache: Path) -> np.ndarray:
    """All documents of a split as one uint16 stream: <s> doc </s> <s> doc </s> ..."""
    path = cache / f"{split}.npy"
    if path.is_file():
        return np.load(path)
    eos = tokenizer.eos_token_id
    texts = list(iter_texts(corpus / f"{split}.jsonl"))
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    stream = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.uint16)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, stream)
    return stream


def fixed_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """n evenly spaced windows: a deterministic evaluation set."""
    import torch

    starts = np.linspace(0, len(stream) - seq_len - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/corpus")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    manifest = build(CorpusConfig(out=args.out, stdlib=args.stdlib))
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()


def sample_snippets(path: Path, n: int, seed: int = 0, min_lines: int = 3, max_lines: int = 8) -> list[str]:
    """n deterministic prompts: the first few lines of randomly chosen top-level defs/classes."""
    import random

    rng = random.Random(seed)
    starts = []
    for doc_no, text in enumerate(iter_texts(Path(path))):
        lines = text.splitlines(keepends=True)
        starts += [(doc_no, i) for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
    picks = sorted(rng.sample(starts, min(n, len(starts))))
    by_doc: dict[int, list[int]] = {}
    for d, i in picks:
        by_doc.setdefault(d, []).append(i)
    out = []
    for doc_no, text in enumerate(iter_texts(Path(path))):
        lines = text.splitlines(keepends=True)
        for i in by_doc.get(doc_no, []):
            out.append("".join(lines[i : i + rng.randint(min_lines, max_lines)]))
    rng.shuffle(out)
    return out
