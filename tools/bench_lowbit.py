"""Microbenchmark of the CPU low-bit linears (kernels/lowbit_cpu.cpp) against dense F.linear.

    python -m tools.bench_lowbit                        # SmolLM2-135M's layer, rows 1..64, all cores
    python -m tools.bench_lowbit --threads 1 --batches 8 32
    python -m tools.bench_lowbit --batches 1 2 5 8 --layers 30 --against OLD.so   # a kernel change, A/B

One "call" is a decoder layer's set of linears at SmolLM2-135M's shapes (hidden 576, intermediate 1536):
q [576 -> 576], k and v [576 -> 192], o [576 -> 576], gate+up fused [576 -> 3072], down [1536 -> 576],
with the same random weights (q4 = Q4_1, q8 = Q8_0, quantized from them) and activations [B, in] for each.
Variants:
  q4_fp32    q4_linear: fp32 activations, weights dequantized in registers
  q4_bf16    linear_bf16 on Q4_1: bf16 activations (vdpbf16ps where the CPU has avx512_bf16)
  q4_i8      q4_linear_i8: activations quantized per block to int8 (Q8_1), integer dot products
  q8_i8      q8_linear_i8: the same on Q8_0 weights
  dense_fp32 F.linear, fp32 weights and activations
  dense_bf16 F.linear, bf16 weights and activations (oneDNN; AMX where the CPU has it)
--layers N: each call runs N distinct layer sets (30: all of SmolLM2's, so the weights stream from memory as in a
decode step rather than sit in cache). --against: another build of the kernel (its .so, e.g. from before a change,
under ~/.cache/specee/torch_extensions/): its q4_fp32 and q4_bf16 join the variants as "<variant>@against", after a
check that they give the same numbers as this build's (up to the order of the sums: 1e-5 relative).
Each variant is warmed up, then timed in interleaved rounds (every variant once per round, --iters calls
each); the median round is reported, in milliseconds per layer set, with ratios to dense_bf16 (below 1:
faster than dense bf16). Prints one JSON object with the config, git commit and the CPU's capability.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from jobs.cli import git_commit
from kernels.cpu_ext import lowbit_cpu
from specee_core.model.quant import linear_reference, quantize

# SmolLM2-135M: (out, in) of q, k, v, o, gate+up (fused), down
SMOLLM2_LINEARS = ((576, 576), (192, 576), (192, 576), (576, 576), (3072, 576), (576, 1536))
VARIANTS = ("q4_fp32", "q4_bf16", "q4_i8", "q8_i8", "dense_fp32", "dense_bf16")


@dataclass
class BenchConfig:
    batches: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 32, 64])
    threads: int = 0  # torch intra-op threads; 0 = all cores
    rounds: int = 15  # interleaved timing rounds; the median is reported
    iters: int = 5  # calls per variant per round
    warmup: int = 3  # calls per variant before timing
    seed: int = 0
    layers: int = 1  # distinct layer sets per call (30: SmolLM2's whole stack, streaming)
    against: str | None = None  # another build of the kernel (.so) to time beside this one

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches {self.batches} must be positive row counts")
        if self.threads < 0 or self.rounds < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError(f"bad counts: threads={self.threads} rounds={self.rounds} iters={self.iters} "
                             f"warmup={self.warmup}")


def load_build(path: str) -> ModuleType:
    """A built kernel module (.so) by its path, beside this process's own build (each has its own name)."""
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--against {path}: not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layer_set(b: int, seed: int, layers: int = 1, against: ModuleType | None = None
              ) -> tuple[dict[str, Callable[[], object]], tuple[list, list, list]]:
    """The variants, each a closure running the whole set of linears (`layers` distinct sets) for b activation
    rows, and the first set's inputs (activations, q4 and q8 weights)."""
    ext = lowbit_cpu()
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(o, i, generator=g) * 0.05 for _ in range(layers) for o, i in SMOLLM2_LINEARS]
    xs = [torch.randn(b, i, generator=g) for _ in range(layers) for _, i in SMOLLM2_LINEARS]
    q4 = [quantize(w, "q4") for w in ws]
    q8 = [quantize(w, "q8") for w in ws]
    wb = [w.bfloat16() for w in ws]
    xb = [x.bfloat16() for x in xs]
    fns = {
        "q4_fp32": lambda: [ext.q4_linear(x, q.qs, q.d, q.m) for x, q in zip(xs, q4)],
        "q4_bf16": lambda: [ext.linear_bf16(x, q.qs, q.d, q.m) for x, q in zip(xb, q4)],
        "q4_i8": lambda: [ext.q4_linear_i8(x, q.qs, q.d, q.m) for x, q in zip(xs, q4)],
        "q8_i8": lambda: [ext.q8_linear_i8(x, q.qs, q.d) for x, q in zip(xs, q8)],
        "dense_fp32": lambda: [F.linear(x, w) for x, w in zip(xs, ws)],
        "dense_bf16": lambda: [F.linear(x, w) for x, w in zip(xb, wb)],
    }
    if against is not None:
        fns["q4_fp32@against"] = lambda: [against.q4_linear(x, q.qs, q.d, q.m) for x, q in zip(xs, q4)]
        fns["q4_bf16@against"] = lambda: [against.linear_bf16(x, q.qs, q.d, q.m) for x, q in zip(xb, q4)]
        for v in ("q4_fp32", "q4_bf16"):  # the same sums, at most in another order
            pairs = zip(fns[v](), fns[f"{v}@against"]())
            diff = max(float((a - c).norm() / c.norm().clamp_min(1e-30)) for a, c in pairs)
            if diff > 1e-5:
                raise ValueError(f"--against differs from this build for {v} by {diff:.2e} (relative): "
                                 "other arithmetic")
    n = len(SMOLLM2_LINEARS)
    return fns, (xs[:n], q4[:n], q8[:n])


def i8_error(xs: list[torch.Tensor], q4: list, q8: list) -> dict[str, float]:
    """The int8-activation result's relative error against fp32 activations on the same weights
    (||y_i8 - y_fp32|| / ||y_fp32|| over the layer set): what quantizing the activations costs."""
    ext = lowbit_cpu()
    out = {}
    for fmt, qws in (("q4", q4), ("q8", q8)):
        num = den = 0.0
        for x, q in zip(xs, qws):
            ref = linear_reference(x, q)
            got = ext.q4_linear_i8(x, q.qs, q.d, q.m) if fmt == "q4" else ext.q8_linear_i8(x, q.qs, q.d)
            num += (got - ref).square().sum().item()
            den += ref.square().sum().item()
        out[fmt] = (num / den) ** 0.5
    return out


def time_batch(fns: dict[str, Callable[[], object]], cfg: BenchConfig) -> dict[str, float]:
    """Median over interleaved rounds of the milliseconds per call, per variant."""
    for fn in fns.values():
        for _ in range(cfg.warmup):
            fn()
    rounds: dict[str, list[float]] = {v: [] for v in fns}
    for _ in range(cfg.rounds):
        for v, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(cfg.iters):
                fn()
            rounds[v].append((time.perf_counter() - t0) / cfg.iters * 1e3)
    return {v: statistics.median(ts) for v, ts in rounds.items()}


def bench(cfg: BenchConfig) -> dict:
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    ext = lowbit_cpu()
    against = load_build(cfg.against) if cfg.against else None
    rows = []
    for b in cfg.batches:
        fns, (xs, q4, q8) = layer_set(b, cfg.seed, cfg.layers, against)
        ms = time_batch(fns, cfg)
        extra = {f"{v}@against_over_this": round(ms[f"{v}@against"] / ms[v], 3)
                 for v in ("q4_fp32", "q4_bf16")} if against is not None else {}
        rows.append({"batch": b, "ms": {v: round(t, 4) for v, t in ms.items()}, **extra,
                     "vs_dense_bf16": {v: round(t / ms["dense_bf16"], 3) for v, t in ms.items()},
                     "q4_i8_vs_q4_bf16": round(ms["q4_i8"] / ms["q4_bf16"], 3),
                     "i8_rel_error_vs_fp32_activations": {k: round(e, 5) for k, e in i8_error(xs, q4, q8).items()}})
    return {"config": asdict(cfg), "git_commit": git_commit(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "simd": ext.simd(), "simd_i8": ext.simd_i8(),
            "has_bf16": ext.has_bf16(), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": platform.processor() or None, "linears": [list(s) for s in SMOLLM2_LINEARS],
            "kernel": ext.__name__, "against": against.__name__ if against is not None else None,
            "unit": f"ms per {cfg.layers} layer set(s) (q, k, v, o, gate+up, down)", "results": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: all cores)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=1, help="distinct layer sets per call (30: streaming, as in a step)")
    p.add_argument("--against", default=None, help="another build of the kernel (.so) to time beside this one")
    args = p.parse_args(argv)
    print(json.dumps(bench(BenchConfig(**vars(args))), indent=1))


if __name__ == "__main__":
    main()
