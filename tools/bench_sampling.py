"""Per-row sampling against one shared setting: the engine over 16 held-out chat prompts x --tokens new tokens,
built as a job builds it (`from_pretrained(model, max_batch_size=N)`, every other option its default) at each
batch size N, the variants taking turns round by round in one process:

- shared: one SamplingParams for every prompt (temperature 0.7, no seed), the case rows always shared a step in;
- seeds: temperature 0.7, each prompt its own seed;
- temperatures: each prompt its own temperature (0.5 .. 1.25), no seed;
- mixed: each prompt its own temperature, seed, top_p / top_k / min_p, some with penalties or greedy.

Tokens/s is generated tokens over the whole generate call (prefill included); each variant's ratio to shared is
the median over rounds of the round's ratio. Prints (and with --out writes) JSON with the commit and the machine.

    python -m tools.bench_sampling --out docs/bench_sampling.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from jobs.cli import emit_json, git_commit
from tools.bench_batched import chat_prompts
from specee_core import SamplingParams, SpecEEEngine
from specee_core.machine import machine_facts


def variants(n: int, tokens: int) -> dict[str, list[SamplingParams]]:
    """Each variant's per-prompt sampling for n prompts."""
    base = dict(max_new_tokens=tokens, ignore_eos=True)
    mixed = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40), dict(temperature=0.6, min_p=0.05),
             dict(), dict(temperature=0.9, frequency_penalty=0.5), dict(temperature=0.7, repetition_penalty=1.1)]
    return {
        "shared": [SamplingParams(temperature=0.7, **base)] * n,
        "seeds": [SamplingParams(temperature=0.7, seed=i, **base) for i in range(n)],
        "temperatures": [SamplingParams(temperature=0.5 + 0.05 * i, **base) for i in range(n)],
        "mixed": [SamplingParams(seed=100 + i, **mixed[i % len(mixed)], **base) for i in range(n)],
    }


def rate(engine: SpecEEEngine, prompts: list[str], params: list[SamplingParams]) -> float:
    t0 = time.perf_counter()
    got = engine.generate(prompts, sampling_params=params)
    return sum(len(r.token_ids) for r in got) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("prompts/instructions_heldout.jsonl"))
    ap.add_argument("--n", type=int, default=16, help="prompts per call")
    ap.add_argument("--sizes", default="1,8,16", help="max_batch_size of each engine")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"git_commit": git_commit(), "machine": machine_facts(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
              "model": args.model, "prompts": args.n, "tokens": args.tokens, "rounds": args.rounds, "sizes": {}}
    for size in sizes:
        engine = SpecEEEngine.from_pretrained(args.model, max_batch_size=size)
        prompts = chat_prompts(engine, args.prompts, args.n)
        runs = variants(args.n, args.tokens)
        engine.prepare_plan([size])
        rate(engine, prompts[:size], runs["mixed"][:size])  # warm-up: the first call at a size pays more
        rounds = {name: [] for name in runs}
        for r in range(args.rounds):
            for name, params in runs.items():
                rounds[name].append(rate(engine, prompts, params))
                print(f"N={size} round {r + 1} {name}: {rounds[name][-1]:.1f} tokens/s", flush=True)
        shared = rounds["shared"]
        result["sizes"][str(size)] = {
            "dtype": str(engine.model.dtype).removeprefix("torch."), "weights": engine.model.weight_format,
            "tokens_per_s": {k: statistics.median(v) for k, v in rounds.items()},
            "rounds": rounds,
            "vs_shared": {k: statistics.median(a / b for a, b in zip(v, shared)) for k, v in rounds.items()},
        }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
