"""Microbenchmark of the fused SpecEE predictor: Triton kernel vs torch reference vs unfused ops.

    python -m tools.bench_kernels                                  # Llama2-7B shapes, batch 1 and 32
    python -m tools.bench_kernels --cuda-graph                     # GPU time without launch overhead
    python -m tools.bench_kernels --dim 512 --vocab 4000 --iters 20 --threads 1   # CPU smoke test

Variants, all computing (p_exit, cand_prob, local_argmax) from the same inputs:
  triton           kernels.fused_predictor (one launch). On CPU only under TRITON_INTERPRET=1
                   (the interpreter: a correctness check, its time means nothing).
  torch_reference  kernels.fused_predictor_reference (fp32 math, what the engine runs on CPU).
  torch_ops        the same math as an nn.Module would write it: gather, einsum, softmax, cat,
                   two linears in the input dtype; about a dozen launches.
Each variant is warmed up, then timed over --iters calls in one run (CUDA events on GPU,
perf_counter on CPU). Prints one JSON object: config, git commit, device, microseconds per
call, ratios against the kernel, and each variant's largest deviation from the reference.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from jobs.cli import git_commit
from kernels import fused_predictor, fused_predictor_reference, triton_mode

VARIANTS = ("triton", "torch_reference", "torch_ops")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class BenchConfig:
    batches: list[int] = field(default_factory=lambda: [1, 32])
    dim: int = 4096  # D, Llama2-7B
    vocab: int = 32000  # V
    k: int = 4  # K candidates
    hidden: int = 512  # predictor MLP width
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # cuda when available
    iters: int = 0  # 0: 2000 on CUDA, 20 on CPU
    warmup: int = 0  # 0: 200 on CUDA, 3 on CPU
    cuda_graph: bool = False  # replay each variant from a CUDA graph: GPU time, no launch cost
    seed: int = 0
    threads: int = 0  # CPU: torch intra-op threads, 0 = torch default

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device is {self.device!r}; expected 'auto', 'cuda' or 'cpu'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but torch.cuda.is_available() is False")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype is {self.dtype!r}; expected 'auto' or one of {list(_DTYPES)}")
        on_gpu = self.device == "cuda"
        self.iters = self.iters or (2000 if on_gpu else 20)
        self.warmup = self.warmup or (200 if on_gpu else 3)
        if self.threads < 0:
            raise ValueError(f"threads is {self.threads}; expected 0 (torch default) or more")
        for name in ("dim", "vocab", "k", "hidden", "iters", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}; expected a positive integer")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches is {self.batches}; expected positive integers")
        if self.k > self.vocab:
            raise ValueError(f"k is {self.k}; expected at most vocab={self.vocab}")
        if self.cuda_graph and not on_gpu:
            raise ValueError("cuda_graph needs device 'cuda'")


def torch_ops(h_normed, cand_ids, lm_head_weight, prev_prob, w1, b1, w2, b2):
    """The predictor as unfused torch ops in the input dtype, the way a module would run it."""
    rows = F.embedding(cand_ids, lm_head_weight)  # [B, K, D]
    z = torch.einsum("bd,bkd->bk", h_normed, rows).float()  # [B, K]
    p = torch.softmax(z, dim=-1)
    features = torch.cat([z, p, p - prev_prob.float()], dim=-1).to(w1.dtype)  # [B, 3K]
    hidden = F.relu(F.linear(features, w1, b1))  # [B, H]
    p_exit = torch.sigmoid(F.linear(hidden, w2, b2)).squeeze(-1).float()  # [B]
    return p_exit, p, cand_ids.gather(1, z.argmax(dim=-1, keepdim=True)).squeeze(1)


def make_inputs(cfg: BenchConfig, batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    D, V, K, H = cfg.dim, cfg.vocab, cfg.k, cfg.hidden
    dtype = _DTYPES[cfg.dtype]
    h = torch.randn(batch, D, generator=g)
    lm = torch.randn(V, D, generator=g) * (2 / D**0.5)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(batch)])  # [B, K]
    prev = torch.softmax(torch.randn(batch, K, generator=g), dim=-1)
    w1 = torch.randn(H, 3 * K, generator=g) / (3 * K) ** 0.5
    b1 = torch.randn(H, generator=g) * 0.1
    w2 = torch.randn(1, H, generator=g) / H**0.5
    b2 = torch.randn(1, generator=g) * 0.1
    args = [h.to(dtype), cand, lm.to(dtype), prev, *(t.to(dtype) for t in (w1, b1, w2, b2))]
    return [t.to(cfg.device) for t in args]


def time_us(fn: Callable[[], object], cfg: BenchConfig) -> float:
    """Microseconds per call, averaged over cfg.iters calls after cfg.warmup."""
    side = torch.cuda.Stream() if cfg.cuda_graph else None  # graph capture wants a side-stream warmup
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for _ in range(cfg.warmup):
            fn()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    if cfg.device == "cpu":
        start = time.perf_counter()
        for _ in range(cfg.iters):
            fn()
        return (time.perf_counter() - start) / cfg.iters * 1e6
    if cfg.cuda_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(cfg.iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / cfg.iters * 1e3


def bench(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    mode = triton_mode()
    kernel_ok = (cfg.device == "cuda" and mode is not None) or mode == "interpreter"
    fns = {"triton": fused_predictor, "torch_reference": fused_predictor_reference, "torch_ops": torch_ops}
    skipped = {} if kernel_ok else {"triton": f"triton mode {mode!r} on {cfg.device}: no kernel to run"}
    results = []
    for batch in cfg.batches:
        args = make_inputs(cfg, batch)
        ref = fused_predictor_reference(*args)
        us, diff = {}, {}
        for name in VARIANTS:
            if name in skipped:
                continue
            out = fns[name](*args)
            diff[name] = {
                "p_exit": (out[0] - ref[0]).abs().max().item(),
                "cand_prob": (out[1] - ref[1]).abs().max().item(),
                "argmax_equal": bool(torch.equal(out[2], ref[2])),
            }
            us[name] = round(time_us(lambda fn=fns[name]: fn(*args), cfg), 2)
        base = us.get("triton")
        ratios = {f"{name}/triton": round(t / base, 3) for name, t in us.items() if base and name != "triton"}
        results.append({"batch": batch, "us_per_call": us, "ratios": ratios, "max_abs_diff_vs_reference": diff})
    device = torch.cuda.get_device_name() if cfg.device == "cuda" else (
        f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads")
    return {
        "bench": "fused_predictor",
        "config": asdict(cfg),
        "git_commit": git_commit(),
        "device": device,
        "torch": torch.__version__,
        "triton_mode": mode,
        "skipped": skipped,
        "note": "triton ran in the interpreter: its time is meaningless" if mode == "interpreter" else "",
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--iters", type=int, default=0, help="0: 2000 on CUDA, 20 on CPU")
    p.add_argument("--warmup", type=int, default=0, help="0: 200 on CUDA, 3 on CPU")
    p.add_argument("--cuda-graph", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads; 0: torch default")
    print(json.dumps(bench(BenchConfig(**vars(p.parse_args(argv)))), indent=2))


if __name__ == "__main__":
    main()
