"""Self-distillation data: the model's own greedy answers to instruction prompts.

    python -m jobs.make_distill_data --model models/smollm2-135m-instruct \\
        --prompts prompts/instructions_train.jsonl --out data/distill/smollm2.jsonl \\
        --limit 800 --max-new-tokens 160 --batch-size 16 --dtype bfloat16

Each prompt is rendered with the tokenizer's chat template (plain text without one), decoded
greedily by the engine in batches, and appended as one JSON line {"id", "prompt_ids",
"answer_ids"} (answer_ids end with EOS when the model stopped). Resumable: ids already in
--out are skipped, and every finished batch is flushed to disk. Draft heads learn on these
sequences (prompt_ids + answer_ids), as EAGLE trains on the target model's own outputs.
"""
from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from jobs.cli import parse_config

log = logging.getLogger(__name__)


@dataclass
class DistillConfig:
    model: Path = Path("models/smollm2-135m-instruct")
    prompts: Path = Path("prompts/instructions_train.jsonl")
    out: Path = Path("data/distill/smollm2.jsonl")
    limit: int = 0  # the first N prompts of the file (0 = all)
    max_new_tokens: int = 160
    batch_size: int = 16
    dtype: str = "bfloat16"
    threads: int = 0  # 0: torch default

    def __post_init__(self) -> None:
        self.model, self.prompts, self.out = Path(self.model), Path(self.prompts), Path(self.out)
        if self.limit < 0 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(f"limit must be >= 0, batch_size and max_new_tokens >= 1; got {self.limit}, "
                             f"{self.batch_size}, {self.max_new_tokens}")
        if not self.prompts.is_file():
            raise FileNotFoundError(f"prompts file not found: {self.prompts}")


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file; a truncated last line (a killed writer) is skipped."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable line skipped (truncated write?)", path, n)
    return rows


def read_prompts(path: Path, limit: int = 0) -> list[dict]:
    """Instruction rows {"id", "prompt"}; ValueError naming the line of a malformed one."""
    rows = read_jsonl(path)
    for n, r in enumerate(rows, 1):
        if not isinstance(r.get("id"), str) or not isinstance(r.get("prompt"), str):
            raise ValueError(f"{path}: row {n} needs string fields 'id' and 'prompt', got keys {sorted(r)}")
    return rows[:limit] if limit else rows


def is_heldout_id(row_id: str, fraction: float = 0.05) -> bool:
    """A fixed ~fraction of ids, by a hash of the id: the evaluation slice of a distill file."""
    return zlib.crc32(row_id.encode()) % 10_000 < fraction * 10_000


def drop_partial_line(path: Path) -> None:
    """Cut a line a killed writer left unfinished, so that appending starts on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        log.warning("%s: unfinished last line removed", path)


def sample_prompts(path: Path, n: int, seed: int = 0, exclude: Path | None = None,
                   exclude_first: int = 0) -> list[dict]:
    """n instruction rows drawn at random (by seed) from path, skipping its first exclude_first rows
    and the ids found in the JSON lines of `exclude` (e.g. a distill file, or the --limit of one:
    measurements use prompts a draft never saw)."""
    rows = read_prompts(path)[exclude_first:]
    if exclude is not None:
        skip = {r["id"] for r in read_jsonl(exclude)}
        rows = [r for r in rows if r["id"] not in skip]
    if len(rows) < n:
        raise ValueError(f"{path}: {n} prompts requested, {len(rows)} available"
                         f"{'' if exclude is None else f' outside {exclude}'}")
    g = torch.Generator().manual_seed(seed)
    return [rows[i] for i in torch.randperm(len(rows), generator=g)[:n].tolist()]


def render_prompt(engine, prompt: str) -> str:
    """The user message through the chat template when the tokenizer has one, else as is."""
    return engine.chat_prompt([{"role": "user", "content": prompt}]) if engine.has_chat_template else prompt


def distill(cfg: DistillConfig) -> dict:
    from specee_core import SpecEEEngine
    from specee_core.step.sampling import SamplingParams

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows = read_prompts(cfg.prompts, cfg.limit)
    drop_partial_line(cfg.out)
    done = {r["id"] for r in read_jsonl(cfg.out)} if cfg.out.is_file() else set()
    todo = [r for r in rows if r["id"] not in done]
    log.info("%d prompts, %d already in %s, %d to go", len(rows), len(rows) - len(todo), cfg.out, len(todo))
    if not todo:
        write_manifest(cfg, 0.0)
        return {"written": 0, "skipped": len(rows)}
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, max_batch_size=cfg.batch_size)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    t0, tokens, written, manifest = time.perf_counter(), 0, 0, None
    with open(cfg.out, "a") as f, tqdm(total=len(todo), unit="prompt", desc="distill") as bar:
        for s in range(0, len(todo), cfg.batch_size):
            chunk = todo[s : s + cfg.batch_size]
            ids = [engine.encode_prompt(render_prompt(engine, r["prompt"])) for r in chunk]
            for r, p, res in zip(chunk, ids, engine.run(ids, params)):
                f.write(json.dumps({"id": r["id"], "prompt_ids": p, "answer_ids": res.token_ids}) + "\n")
                tokens += len(res.token_ids)
            f.flush()
            manifest = write_manifest(cfg, time.perf_counter() - t0, manifest)
            written += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", tokens=tokens)
    report = {"written": written, "skipped": len(rows) - len(todo), "answer_tokens": tokens,
              "seconds": round(time.perf_counter() - t0, 1), "out": str(cfg.out)}
    print(json.dumps(report), flush=True)
    return report


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".manifest.json")


def write_manifest(cfg: DistillConfig, seconds: float, started: dict | None = None) -> dict:
    """Rewrite <out>.manifest.json: what the file holds and how it was made. `seconds` of this run
    add to those of the runs before it, read from the manifest as this run found it (`started`;
    None: read it now). Returns the manifest this run started from, for the next call."""
    from jobs.build_corpus import HELD_OUT

    path = manifest_path(cfg.out)
    if started is None:
        started = json.loads(path.read_text()) if path.is_file() else {}
    rows = read_jsonl(cfg.out) if cfg.out.is_file() else []
    manifest = {"model": str(cfg.model), "prompts": str(cfg.prompts), "max_new_tokens": cfg.max_new_tokens,
                "dtype": cfg.dtype, "decoding": "greedy", "rows": len(rows),
                "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
                "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
                "seconds": round(started.get("seconds", 0.0) + seconds, 1),
                "held_out_modules_excluded": list(HELD_OUT)}
    path.write_text(json.dumps(manifest, indent=2))
    return started


def main(argv: list[str] | None = None) -> None:
    distill(parse_config(DistillConfig, __doc__, argv))


if __name__ == "__main__":
    main()
