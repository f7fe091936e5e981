"""Microbenchmark of the GGUF block-format linears (kernels/kquant_cpu.cpp's blocks_linear) against dense fp32
F.linear and the Q4_1 kernel, at Gemma 3 270M's and SmolLM2-135M's layer shapes.

    python -m tools.bench_kquant                          # rows 1 and 8, torch's default threads
    python -m tools.bench_kquant --threads 1 --batches 1 --out docs/bench_kquant.json

A call is one model's set of linears (out, in), each in the format a Q4_K_M file gives it (Q4_K where the
input dim holds super-blocks of 256, else Q5_0; Q6_K for the down projection as llama.cpp's Q4_K_M does on
some layers is timed as its own variant), random blocks; --layers distinct sets per call so the weights stream
from memory as in a decode step. Variants are timed in interleaved rounds; the median is reported in ms per
layer set with the ratio to dense fp32. Prints one JSON object with the config, git commit and CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from jobs.cli import git_commit
from kernels.cpu_ext import lowbit_cpu
from kernels.ggml_blocks import dequantize_blocks_reference, random_blocks
from specee_core.machine import cpu_model
from specee_core.model.quant import quantize

# (out, in) of q, k, v, o, gate+up (fused), down
SHAPES = {"gemma3-270m": ((1024, 640), (256, 640), (256, 640), (640, 1024), (4096, 640), (640, 2048)),
          "smollm2-135m": ((576, 576), (192, 576), (192, 576), (576, 576), (3072, 576), (576, 1536)),
          # the matrices of the two whose input dim holds super-blocks of 256, so all Q4_K (Q6_K in q6_k_mix):
          # Gemma's o and down, SmolLM2's down
          "q4_k-only": ((640, 1024), (640, 2048), (576, 1536))}


@dataclass
class BenchConfig:
    batches: list[int] = field(default_factory=lambda: [1, 8])
    models: list[str] = field(default_factory=lambda: list(SHAPES))
    threads: int = 0  # 0: torch's default
    layers: int = 8  # distinct layer sets per call
    rounds: int = 9
    iters: int = 3
    out: str | None = None


def native_format(fmt_k: str, i: int) -> str:
    return fmt_k if i % 256 == 0 else "q5_0"


def layer_sets(model: str, layers: int, gen: torch.Generator) -> dict[str, list]:
    """Per variant, the layer sets' weights: dense fp32, q4 (Q4_1 planes), gguf (Q4_K / Q5_0 blocks), gguf6
    (Q6_K / Q5_0 blocks)."""
    sets: dict[str, list] = {"dense_fp32": [], "q4_1": [], "q4_k_m": [], "q6_k_mix": []}
    for _ in range(layers):
        for o, i in SHAPES[model]:
            raw = random_blocks(o, i, native_format("q4_k", i), gen)
            w = dequantize_blocks_reference(raw, native_format("q4_k", i))
            sets["dense_fp32"].append(w)
            sets["q4_1"].append(quantize(w, "q4"))
            sets["q4_k_m"].append((raw, native_format("q4_k", i)))
            sets["q6_k_mix"].append((random_blocks(o, i, native_format("q6_k", i), gen), native_format("q6_k", i)))
    return sets


def bench(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ext = lowbit_cpu()
    gen = torch.Generator().manual_seed(0)
    results = {}
    for model in cfg.models:
        sets = layer_sets(model, cfg.layers, gen)
        for b in cfg.batches:
            xs = [torch.randn(b, w.shape[1], generator=gen) for w in sets["dense_fp32"]]
            fns = {"dense_fp32": lambda: [F.linear(x, w) for x, w in zip(xs, sets["dense_fp32"])],
                   "q4_1": lambda: [ext.q4_linear(x, q.qs, q.d, q.m) for x, q in zip(xs, sets["q4_1"])],
                   "q4_k_m": lambda: [ext.blocks_linear(x, r, f) for x, (r, f) in zip(xs, sets["q4_k_m"])],
                   "q6_k_mix": lambda: [ext.blocks_linear(x, r, f) for x, (r, f) in zip(xs, sets["q6_k_mix"])]}
            for fn in fns.values():
                fn()
            samples: dict[str, list[float]] = {k: [] for k in fns}
            for rnd in range(cfg.rounds):
                for k in (list(fns) if rnd % 2 else list(fns)[::-1]):
                    t = time.perf_counter()
                    for _ in range(cfg.iters):
                        fns[k]()
                    samples[k].append((time.perf_counter() - t) * 1e3 / cfg.iters / cfg.layers)
            ms = {k: statistics.median(v) for k, v in samples.items()}
            results[f"{model} B={b}"] = {"ms_per_layer": {k: round(v, 4) for k, v in ms.items()},
                                         "vs_dense_fp32": {k: round(v / ms["dense_fp32"], 3) for k, v in ms.items()}}
    return {"config": asdict(cfg), "git_commit": git_commit(), "torch": torch.__version__, "cpu": cpu_model(),
            "simd": ext.simd(), "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "results": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    cfg = BenchConfig(**vars(ap.parse_args(argv)))
    out = json.dumps(bench(cfg), indent=2)
    print(out)
    if cfg.out:
        Path(cfg.out).write_text(out + "\n")


if __name__ == "__main__":
    main()
