"""Host memory of an engine: the resident set while it loads and while it decodes many prompts with the prefix
cache on (the heap trimmed as the core does, and not), and off. Each variant runs in a process of its own (a fresh
heap); this process samples its resident set every second from /proc and reports the peak and the end beside the
KV budget and what the prefix cache holds.

    python -m tools.bench_memory --model models/gemma3-270m --weights gguf --out docs/bench_memory_gemma3.json
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

from jobs.cli import emit_json, parse_config

VARIANTS = ("load", "prefix_cache", "prefix_cache_untrimmed", "no_prefix_cache")


@dataclass
class Config:
    model: str = "models/gemma3-270m"
    weights: str = "gguf"
    prompts: str = "prompts/instructions_train.jsonl"
    num_prompts: int = 400
    max_new_tokens: int = 32
    batch_size: int = 16
    workload: str = "collect"  # collect: predictor data collection (train_predictors'); generate: engine.generate
    variants: str = ",".join(VARIANTS)
    variant: str = ""  # (internal) run this one variant in this process and print its JSON
    out: str | None = None


def _resident_gb(pid: int | str = "self") -> tuple[float, float]:
    """(resident now, peak) of pid in GB."""
    from specee_core.machine import resident_memory

    now, peak = resident_memory(pid)
    return now / 2**30, peak / 2**30


def run_variant(cfg: Config) -> dict:
    from pathlib import Path

    from jobs.train_predictors import training_prompts
    from specee_core import SpecEEEngine
    from specee_core.early_exit.collect import collect_exit_data

    t0 = time.perf_counter()
    engine = SpecEEEngine.from_pretrained(cfg.model, weights=cfg.weights, max_batch_size=cfg.batch_size,
                                          prefix_cache=cfg.variant != "no_prefix_cache")
    out = {"variant": cfg.variant, "load_s": round(time.perf_counter() - t0, 1),
           "peak_after_load_gb": round(_resident_gb()[1], 2)}
    if cfg.variant == "load":
        return out
    if cfg.variant == "prefix_cache_untrimmed":
        engine.core.heap.every_s = float("inf")
    prompts = training_prompts(engine, Path("corpus"), Path(cfg.prompts), cfg.num_prompts, 0)
    t0 = time.perf_counter()
    if cfg.workload == "collect":
        collect_exit_data(engine, prompts, "lookup", 4, cfg.max_new_tokens)
    else:
        engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, ignore_eos=True, mode="dense")
    out["decode_s"] = round(time.perf_counter() - t0, 1)
    out.update({k: v for k, v in engine.core.memory().items() if k in ("kv_budget_mb", "prefix_cache_blocks")})
    out["prefix_cache_mb"] = round(out["prefix_cache_blocks"] * engine.core.budget.block_bytes / 2**20, 1)
    return out


def run(cfg: Config) -> dict:
    import torch

    from jobs.cli import git_commit
    from specee_core.machine import machine_facts

    results = []
    for variant in cfg.variants.split(","):
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}")
        args = [sys.executable, "-m", "tools.bench_memory", "--variant", variant] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(cfg).items() if k not in ("variant", "variants", "out")]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        t0, trace, peak = time.monotonic(), [], 0.0
        while proc.poll() is None:
            rss, now_peak = _resident_gb(proc.pid)
            if not now_peak:  # gone
                break
            peak = now_peak
            trace.append([round(time.monotonic() - t0), round(rss, 2)])
            time.sleep(1.0)
        stdout, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"variant {variant} failed (exit {proc.returncode})")
        res = json.loads(stdout.strip().splitlines()[-1])
        res["peak_rss_gb"] = round(peak, 2)
        res["end_rss_gb"] = trace[-1][1] if trace else None
        res["rss_gb_every_10s"] = [r for t, r in trace[::10]]
        print(f"[bench_memory] {variant}: peak {peak:.2f} GB, end {res['end_rss_gb']} GB", flush=True)
        results.append(res)
    return {"benchmark": "tools.bench_memory", "git_commit": git_commit(), "config": vars(cfg),
            "machine": machine_facts("cpu"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "results": results}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(Config, __doc__, argv)
    if cfg.variant:
        print(json.dumps(run_variant(cfg)), flush=True)
        return
    emit_json(run(cfg), cfg.out)


if __name__ == "__main__":
    main()
