"""The OpenAI endpoint under concurrent requests of distinct sampling: `pipeline.serve:app` with its defaults on
the default model, on loopback, driven by httpx as clients send requests. Two measurements, the variants taking
turns round by round in one run:

- throughput: --concurrent chat requests at once, --tokens each (ignore_eos), either all sharing temperature 0.7
  without a seed ("shared") or each with its own temperature and seed ("own"); completion tokens over the wall time
  from the first request sent to the last answer;
- latency: a short greedy request (--short-tokens) alone, then sent while --long long requests of distinct sampling
  run; its time from when it was sent, and the ratio.

Prints (and with --out writes) JSON with the commit and the machine.

    python -m tools.bench_serve --out docs/bench_serve.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path

import httpx
import torch

from jobs.cli import emit_json, git_commit
from specee_core.machine import machine_facts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def instructions(path: Path, n: int) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()][:n]


async def chat(client: httpx.AsyncClient, prompt: str, **sampling) -> int:
    """One chat completion; its completion tokens."""
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                        **sampling})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def throughput(client: httpx.AsyncClient, prompts: list[str], tokens: int, own: bool) -> float:
    t0 = time.perf_counter()
    got = await asyncio.gather(*(chat(client, p, max_tokens=tokens, ignore_eos=True,
                                      **({"temperature": 0.5 + 0.05 * i, "seed": i} if own else {"temperature": 0.7}))
                                 for i, p in enumerate(prompts)))
    return sum(got) / (time.perf_counter() - t0)


async def short_latency(client: httpx.AsyncClient, prompts: list[str], short_tokens: int, long_tokens: int,
                        beside: int) -> tuple[float, float]:
    """(seconds of a short greedy request alone, seconds of the same request sent while `beside` long ones run)."""
    t0 = time.perf_counter()
    await chat(client, prompts[0], max_tokens=short_tokens, temperature=0.0)
    alone = time.perf_counter() - t0
    longs = [asyncio.create_task(chat(client, p, max_tokens=long_tokens, ignore_eos=True, temperature=0.6 + 0.1 * i,
                                      seed=100 + i)) for i, p in enumerate(prompts[1 : 1 + beside])]
    await asyncio.sleep(1.0)  # the long requests are decoding
    t1 = time.perf_counter()
    await chat(client, prompts[0], max_tokens=short_tokens, temperature=0.0)
    shared = time.perf_counter() - t1
    await asyncio.gather(*longs)
    return alone, shared


async def measure(base: str, args) -> dict:
    prompts = instructions(args.prompts, max(args.concurrent, args.long + 1))
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await throughput(client, prompts[: args.concurrent], 8, own=True)  # warm-up
        rounds = {"shared": [], "own": []}
        latency = []
        for r in range(args.rounds):
            for name in rounds:
                rounds[name].append(await throughput(client, prompts[: args.concurrent], args.tokens, name == "own"))
                print(f"round {r + 1} {name}: {rounds[name][-1]:.1f} tokens/s", flush=True)
            latency.append(await short_latency(client, prompts, args.short_tokens, args.long_tokens, args.long))
            print(f"round {r + 1} short request: alone {latency[-1][0]:.2f} s, beside {args.long} long ones "
                  f"{latency[-1][1]:.2f} s", flush=True)
    return {"tokens_per_s": {k: statistics.median(v) for k, v in rounds.items()}, "rounds": rounds,
            "own_vs_shared": statistics.median(o / s for o, s in zip(rounds["own"], rounds["shared"])),
            "short_alone_s": [a for a, _ in latency], "short_beside_long_s": [b for _, b in latency],
            "short_ratio": statistics.median(b / a for a, b in latency)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("prompts/instructions_heldout.jsonl"))
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from ray import serve

    from pipeline.local_ray import init_ray
    from pipeline.serve import app

    init_ray("local")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app({"model": args.model}), name="bench", route_prefix="/")
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", args))
    finally:
        serve.shutdown()
    emit_json({"git_commit": git_commit(), "machine": machine_facts(),
          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "model": args.model,
          "serve_args": "defaults", **{k: getattr(args, k) for k in ("concurrent", "tokens", "long", "long_tokens",
                                                                     "short_tokens", "rounds")}, **result}, args.out)


if __name__ == "__main__":
    main()
