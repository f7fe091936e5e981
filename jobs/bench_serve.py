"""Load benchmark of the Serve endpoint: continuous batching against request batching (the earlier
shape), for dense and speculative decoding, at several concurrencies, in one run on loopback.

    python -m jobs.bench_serve --out docs/bench_serve.json
    python -m jobs.bench_serve --model models/specee-tiny --concurrency 1,8 --requests-per-client 2   # quick

Two applications of the same model run side by side (`batching=continuous` at /cb, `batching=request`
at /rb); each measured point sends `concurrency x requests-per-client` chat requests (held-out
instructions, greedy, max_tokens fixed) with at most `concurrency` in flight, the decode mode set per
request. Points run in an interleaved order (concurrency outer, then mode, the two batchings in
alternating order). Reported per point: request latency p50 / p99, time to first token p50 (streamed
requests), generated tokens per second over the point's wall time, and requests per second.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jobs.generate import DEFAULT_INPUT, DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompts", default=str(DEFAULT_INPUT))
    p.add_argument("--modes", default="dense,auto,spec")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def point(base: str, prefix: str, mode: str, prompts: list[str], concurrency: int, n: int,
                max_tokens: int, chat: bool = True) -> dict:
    """n requests (chat, or plain completions for a model without a chat template), at most `concurrency`
    at once; every other one streamed (for time to first token)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    lat, ttft, tokens, errors = [], [], [], []

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        async def one(i: int) -> None:
            text = prompts[i % len(prompts)]
            body = {"max_tokens": max_tokens, "temperature": 0, "mode": mode}
            body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
            path = f"{prefix}/v1/chat/completions" if chat else f"{prefix}/v1/completions"
            async with sem:
                t0 = time.perf_counter()
                if i % 2:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    first = None
                    async with http.stream("POST", path, json=body) as r:
                        if r.status_code != 200:
                            errors.append(r.status_code)
                            return
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            choice = (event.get("choices") or [{}])[0]
                            if first is None and (choice.get("delta", {}).get("content") or choice.get("text")):
                                first = time.perf_counter() - t0
                            if event.get("usage") and not event.get("choices"):
                                tokens.append(event["usage"]["completion_tokens"])
                    if first is not None:
                        ttft.append(first)
                else:
                    r = await http.post(path, json=body)
                    if r.status_code != 200:
                        errors.append(r.status_code)
                        return
                    tokens.append(r.json()["usage"]["completion_tokens"])
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"requests": n, "errors": len(errors), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(tokens) / wall, 2), "requests_per_s": round(len(lat) / wall, 3),
            "latency_p50_s": rounded(percentile(lat, 0.5)), "latency_p99_s": rounded(percentile(lat, 0.99)),
            "ttft_p50_s": rounded(percentile(ttft, 0.5)),
            "mean_tokens": round(statistics.mean(tokens), 1) if tokens else None}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    import torch
    from ray import serve

    from jobs.bench import git_commit
    from jobs.cli import emit_json
    from pipeline.local_ray import init_ray
    from pipeline.serve import app

    commit = git_commit()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    modes = args.modes.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    init_ray("local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"model": args.model, "dtype": args.dtype, "num_cpus": 0.5, "max_batch_size": args.max_batch_size,
              "max_queued_requests": 1024}
    serve.run_many([serve.RunTarget(app({**common, "batching": "continuous"}), name="cb", route_prefix="/cb"),
                    serve.RunTarget(app({**common, "batching": "request"}), name="rb", route_prefix="/rb")])
    base = f"http://127.0.0.1:{port}"
    import httpx

    chat = httpx.get(f"{base}/cb/v1/models", timeout=30).json()["data"][0]["chat"]
    results: list[dict] = []
    try:
        for prefix in ("/cb", "/rb"):  # warm-up: first calls pay lazy set-up
            asyncio.run(point(base, prefix, modes[0], prompts, 2, 2, 8, chat))
        flip = False
        for c in levels:
            for mode in modes:
                order = ("/cb", "/rb") if not flip else ("/rb", "/cb")
                flip = not flip
                for prefix in order:
                    r = asyncio.run(point(base, prefix, mode, prompts, c, c * args.requests_per_client,
                                          args.max_tokens, chat))
                    r |= {"batching": "continuous" if prefix == "/cb" else "request", "mode": mode, "concurrency": c}
                    results.append(r)
                    print(f"[bench_serve] {r['batching']:10s} {mode:5s} c={c:3d}: {r['tokens_per_s']:7.1f} tok/s, "
                          f"p50 {r['latency_p50_s']} s, p99 {r['latency_p99_s']} s, "
                          f"ttft p50 {r['ttft_p50_s']}, errors {r['errors']}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    speedups = {}
    for c in levels:
        for mode in modes:
            cb = next(r for r in results if (r["batching"], r["mode"], r["concurrency"]) == ("continuous", mode, c))
            rb = next(r for r in results if (r["batching"], r["mode"], r["concurrency"]) == ("request", mode, c))
            speedups[f"{mode}@{c}"] = {"tokens_per_s": round(cb["tokens_per_s"] / rb["tokens_per_s"], 3),
                                       "latency_p99": round(cb["latency_p99_s"] / rb["latency_p99_s"], 3)}
    out = {"benchmark": "jobs.bench_serve", "git_commit": commit, "config": vars(args),
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "ray": ray.__version__},
           "results": results, "continuous_over_request": speedups}
    return emit_json(out, args.out)


if __name__ == "__main__":
    main()
