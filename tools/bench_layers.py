"""A model's decoder layers on CPU, each decode layer as one C++ call (the fused layer and layer stack,
kernels/layer_cpu.cpp) against the same layers op by op through torch, interleaved in one run.

    python -m tools.bench_layers                                   # SmolLM2-135M's shapes, bf16 and fp32, batch 8
    python -m tools.bench_layers --formats bf16,fp32,q4 --batches 1,8,16 --out docs/bench_layers.json
    python -m tools.bench_layers --model models/gemma3-270m --formats fp32,gguf --batches 1,16

One call is every decoder layer, the final norm and the LM head over `batch` rows after --context cached
tokens each (rows at lengths context .. context + batch - 1, as different prompts are): a decode step (one
token per row) or a drafted chain of --verify tokens verified (each token sees the ones before it), on random
weights of the model's shapes (specee_core.model.weight_plan.random_model: the layout the engine runs). Variants
per format: "fused" (the engine's path), "fused_loop" (the same with attention's grouped AVX-512 path off: one
query at a time, the same bits) and "op_by_op" (the same weights, every layer's norms, RoPE, attention, activation
and adds as torch ops); also "gemms": the four linears of each layer and the head alone, what the fused layer cannot
make cheaper. Median milliseconds of --rounds interleaved rounds; JSON with the commit
and the CPU's capability.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from jobs.cli import emit_json, git_commit
from specee_core.machine import machine_facts
from specee_core.model.config import ModelConfig
from specee_core.model.model import LayerLinears
from specee_core.model.quant import cpu_kernel
from specee_core.model.weight_plan import random_model

# gguf: a Q4_K_M file's mix (weight_plan.random_model), fp32 activations
FORMATS = {"bf16": (None, torch.bfloat16), "fp32": (None, torch.float32), "q4": ("q4", torch.float32),
           "gguf": ("gguf", torch.float32)}


def op_by_op(model):
    """The model with the same weights whose layers run as torch ops (no fused layer, no stack)."""
    plain = copy.copy(model)
    plain.linears = [LayerLinears(lin.qkv, lin.o, lin.gate_up, lin.down, lin.kv, act=lin.act) for lin in model.linears]
    plain._stackable = False
    return plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="its config.json gives the shapes")
    ap.add_argument("--formats", default="bf16,fp32", help=f"comma-separated, of {','.join(FORMATS)}")
    ap.add_argument("--batches", default="8")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--verify", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    config = ModelConfig.from_file(Path(args.model) / "config.json")
    gen = torch.Generator().manual_seed(0)
    results: dict[str, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        rows = torch.arange(batch)
        lengths = args.context + rows
        setups = {}
        for fmt in args.formats.split(","):
            quant, dtype = FORMATS[fmt]
            fused = random_model(config, quant, dtype, gen)
            for name, model in (("fused", fused), ("fused_loop", fused), ("op_by_op", op_by_op(fused))):
                cache = model.new_cache(batch, args.context + batch + args.verify)
                cache.randomize(gen)
                setups[f"{fmt}_{name}"] = (model, cache, dtype)
            setups[f"{fmt}_gemms"] = (fused, None, dtype)

        def run(model, cache, dtype, t: int) -> None:
            if cache is None:  # the linears alone
                x = torch.randn(batch * t, config.hidden_size).to(dtype)
                att = torch.randn(batch * t, model.q_size).to(dtype)
                act = torch.randn(batch * t, config.intermediate_size).to(dtype)
                for lin in model.linears:
                    lin.qkv(x), lin.o(att), lin.gate_up(x), lin.down(act)
                model.lm_head(x)
                return
            cache.truncate(rows, lengths)
            x = torch.randn(batch, t, config.hidden_size).to(dtype)
            chain = None if t == 1 else torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(batch, t, t)
            model.logits(model.layers(x, model.rope_for(lengths[:, None] + torch.arange(t)), cache, tree=chain))

        samples: dict[str, list[float]] = {}
        with torch.inference_mode():
            for rnd in range(args.rounds + 1):
                for name, (model, cache, dtype) in (setups.items() if rnd % 2 else reversed(setups.items())):
                    cpu_kernel().grouped_attention(not name.endswith("_fused_loop"))
                    for t in (1, args.verify):
                        t0 = time.perf_counter()
                        run(model, cache, dtype, t)
                        if rnd:  # round 0 warms up (packs oneDNN weights, builds the stack)
                            samples.setdefault(f"{name}@{batch}x{t}", []).append((time.perf_counter() - t0) * 1e3)
            cpu_kernel().grouped_attention(True)
            print({k: round(statistics.median(v), 1) for k, v in samples.items()}, flush=True)
        results.update({k: round(statistics.median(v), 2) for k, v in samples.items()})
    ratios = {k.replace(f"_{other}", f"_{other}/fused"): round(v / results[k.replace(f"_{other}", "_fused")], 3)
              for other in ("op_by_op", "fused_loop") for k, v in results.items() if f"_{other}@" in k}
    emit_json({"git_commit": git_commit(), "machine": machine_facts(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
          "threads": torch.get_num_threads(), "config": {k: str(v) for k, v in vars(args).items()},
          "ms_median": results, "ratios": ratios,
          "note": "ms per call: every layer + final norm + LM head over batch rows, a step (x1) or a chain verified "
                  "(x verify); fused = the engine's path (one C++ call per layer), fused_loop = the same with attention's "
                  "grouped path off, op_by_op = the same weights "
                  "through torch ops, gemms = the linears alone"}, args.out)


if __name__ == "__main__":
    main()
