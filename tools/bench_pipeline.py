"""Benchmark of the batch job's shape: rows/s and tokens/s of jobs.generate's pipeline on the
300 sample prompts with the default model, side by side in one run:

- stream: the job as it is: one streaming pass through pipeline.processor (Ray Data's streaming
          executor and actor pool), engine actors that load the model once, --max-concurrent-batches
          batches in flight in each (several values: a variant each, stream/b1, stream/b2, ...);
- waves:  the same job in the shape it had before, rows split into --waves groups by a hash of
          their id, each group its own run with new actors (one model load per actor per wave);
- bare:   the engine alone in this process (all CPUs), the same prompts in batches of the same size;
- engine: one engine.generate call over every prompt in this process, with the threads of one of the
          job's actors (the layout jobs.generate uses here: --num-actors or the measured one) and its
          batch size: what the job's engine could do with no batch boundaries at all;
- engine_all: the same call with every thread of the layout (actors x threads): what one engine could do with
          the job's cores and no batch boundaries (the reference where the layout has several actors).

    python -m tools.bench_pipeline --out docs/bench_pipeline.json
    python -m tools.bench_pipeline --limit 48 --max-new-tokens 16 --variants stream,bare   # quick
    python -m tools.bench_pipeline --variants stream --modes auto,dense   # the default job against dense
    python -m tools.bench_pipeline --variants stream --weights fp32,bf16,q4   # weight formats, dense
    # batches in flight: the job against one engine call over the same 96 held-out prompts x 128 tokens
    python -m tools.bench_pipeline --input prompts/instructions_heldout.jsonl --limit 96 --max-new-tokens 128 \
        --modes auto --variants stream,engine,engine_all --max-concurrent-batches 1,2 --repeats 3

tokens_per_s is generated tokens over wall seconds from the variant's start to its end, start-up
(actors, model loads) included: what a user waits for. generate_tokens_per_s leaves start-up out
(the summary's clock: first engine batch start to last batch end; for bare and engine, the generate
calls). Rows and tokens must match across variants in dense greedy mode, and the JSON says whether they do.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("stream", "waves", "bare", "engine", "engine_all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jobs.generate import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--input", default=str(REPO / "prompts" / "sample_prompts.jsonl"))
    p.add_argument("--modes", default="dense",
                   help="comma-separated decode modes (auto, dense, spec, specee), each run as every variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-concurrent-batches", default="2",
                   help="comma-separated batches in flight per actor (jobs.generate's flag), each a stream variant")
    p.add_argument("--num-actors", type=int, default=None,
                   help="default: the layout the job measures on this machine (jobs.generate's default)")
    p.add_argument("--waves", type=int, default=4, help="the waves variant: groups, each with new actors")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--weights", default="auto",
                   help="comma-separated weight formats (auto, fp32, bf16, q8, q4), each run as every variant")
    p.add_argument("--repeats", type=int, default=2, help="rounds, the variant order reversed every other round")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: choose from {VARIANTS}")
    bad_w = set(args.weights.split(",")) - {"auto", "fp32", "bf16", "q8", "q4"}
    if bad_w:
        p.error(f"unknown weights {sorted(bad_w)}: choose from auto, fp32, bf16, q8, q4")
    bad = set(args.modes.split(",")) - {"auto", "dense", "spec", "specee"}
    if bad:
        p.error(f"unknown modes {sorted(bad)}: choose from auto, dense, spec, specee")
    try:
        args.in_flight = [int(n) for n in args.max_concurrent_batches.split(",")]
    except ValueError:
        args.in_flight = []
    if not args.in_flight or min(args.in_flight) < 1:
        p.error(f"--max-concurrent-batches takes integers >= 1, comma-separated; got {args.max_concurrent_batches!r}")
    return args


def read_rows(path: str, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def stage_config(args, mode: str, weights: str, in_flight: int | None = None):
    from pipeline.stage import StageConfig

    return StageConfig(model=args.model, mode=mode, dtype=args.dtype, weights=weights,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       max_concurrent_batches=in_flight or args.in_flight[0])


def job_layout(args, mode: str, weights: str) -> dict:
    """The engine actors the job starts here and the torch threads of each (pipeline.batch: --num-actors, else the
    layout measured once per machine and workload)."""
    from pipeline.batch import BatchConfig, actor_resources, with_measured_layout

    cfg = with_measured_layout(BatchConfig(input=[args.input], output=tempfile.gettempdir(),
                                           stage=stage_config(args, mode, weights), num_actors=args.num_actors))
    # what GenerateRows sets: the stage's threads, else the CPUs Ray gives the actor
    threads = cfg.stage.torch_threads or max(1, int(actor_resources(cfg)["num_cpus"]))
    return {"actors": cfg.num_actors, "threads": threads}


def pipeline_run(args, mode: str, weights: str, inputs: list[Path], out: Path, in_flight: int | None = None) -> dict:
    """One run() per input file into one output: a single file is the stream shape, several the waves."""
    import pandas as pd

    from pipeline.batch import BatchConfig, run

    t0 = time.perf_counter()
    # each wave reads another input file into the same output: its input files differ from the manifest's
    summaries = [run(BatchConfig(input=[str(f)], output=str(out), stage=stage_config(args, mode, weights, in_flight),
                                 num_actors=args.num_actors, show_progress=False, overwrite_config=k > 0))
                 for k, f in enumerate(inputs)]
    wall = time.perf_counter() - t0
    df = pd.read_parquet(out)
    ok = df[df["error"].isna()]
    engines = [e for s in summaries for e in s["engines"] or []]
    return {"wall_s": wall, "rows": len(df), "errors": int(df["error"].notna().sum()),
            "tokens": int(ok["completion_tokens"].sum()),
            "generate_s": sum(s["generate_s"] or 0 for s in summaries),
            "model_loads": int(df["worker"].nunique()), "runs": len(summaries), "dtype": summaries[0]["dtype"],
            "weights": summaries[0].get("weights"),
            "peak_batches_in_flight": max((e.get("peak_batches_in_flight", 0) for e in engines), default=None),
            "completions": dict(zip(df["id"], df["completion"]))}


def bare_run(args, mode: str, weights: str, rows: list[dict]) -> dict:
    import torch

    from specee_core import SpecEEEngine

    t0 = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)
    engine = SpecEEEngine.from_pretrained(args.model, dtype=args.dtype, weights=weights, max_batch_size=args.batch_size)
    texts = [engine.chat_prompt([{"role": "user", "content": r["prompt"]}]) if engine.has_chat_template
             else r["prompt"] for r in rows]
    t_gen = time.perf_counter()
    results = []
    for s in range(0, len(texts), args.batch_size):
        results += engine.generate(texts[s : s + args.batch_size], max_new_tokens=args.max_new_tokens, mode=mode)
    end = time.perf_counter()
    return {"wall_s": end - t0, "rows": len(results), "errors": 0, "tokens": sum(len(r.token_ids) for r in results),
            "generate_s": end - t_gen, "model_loads": 1, "runs": 1,
            "dtype": str(engine.model.dtype).removeprefix("torch."), "weights": engine.model.weight_format,
            "completions": {r_in["id"]: r.text for r_in, r in zip(rows, results)}}


def engine_run(args, mode: str, weights: str, rows: list[dict], threads: int) -> dict:
    """One engine.generate call over every prompt, in this process with `threads` torch threads and the job's batch
    size; in mode auto the plan measured (or read) before the clock starts, as the job's actors do at start."""
    import torch

    from specee_core import SpecEEEngine

    t0 = time.perf_counter()
    torch.set_num_threads(threads)
    engine = SpecEEEngine.from_pretrained(args.model, dtype=args.dtype, weights=weights, max_batch_size=args.batch_size)
    if mode == "auto":
        engine.prepare_plan([args.batch_size])
    texts = [engine.chat_prompt([{"role": "user", "content": r["prompt"]}]) if engine.has_chat_template
             else r["prompt"] for r in rows]
    t_gen = time.perf_counter()
    results = engine.generate(texts, max_new_tokens=args.max_new_tokens, mode=mode)
    end = time.perf_counter()
    return {"wall_s": end - t0, "rows": len(results), "errors": 0, "tokens": sum(len(r.token_ids) for r in results),
            "generate_s": end - t_gen, "model_loads": 1, "runs": 1, "threads": threads,
            "dtype": str(engine.model.dtype).removeprefix("torch."), "weights": engine.model.weight_format,
            "completions": {r_in["id"]: r.text for r_in, r in zip(rows, results)}}


def summarize_runs(runs: list[dict], reference: dict) -> dict:
    """Means over rounds of the rates, the counts of the first round, every round's rates."""
    keys = ("wall_s", "generate_s", "rows_per_s", "tokens_per_s", "generate_tokens_per_s")
    first = runs[0]
    return {
        **{k: first[k] for k in ("rows", "errors", "tokens", "model_loads", "runs", "dtype", "weights")},
        **{k: first[k] for k in ("threads", "peak_batches_in_flight") if k in first},
        **{k: round(sum(r[k] for r in runs) / len(runs), 3) for k in keys},
        "same_completions_as_first_variant": all(r["completions"] == reference for r in runs),
        "rounds": [{k: round(r[k], 3) for k in keys} for r in runs],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    import torch

    from jobs.cli import git_commit
    from jobs.cli import emit_json
    from pipeline.local_ray import init_ray
    from specee_core.machine import machine_facts

    commit = git_commit()
    rows = read_rows(args.input, args.limit)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    whole = work / "all.jsonl"
    whole.write_text("".join(json.dumps(r) + "\n" for r in rows))
    waves = [work / f"wave{w}.jsonl" for w in range(args.waves)]
    for w, path in enumerate(waves):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows
                                if zlib.crc32(str(r["id"]).encode()) % args.waves == w))
    init_ray("local", include_dashboard=False, log_to_driver=False)
    modes, formats = args.modes.split(","), args.weights.split(",")
    # one name per (variant, batches in flight, mode, weights): shape[/bN][:mode][@weights], the parts there is one
    # of left out (bN: stream only)
    shapes = [f"{v}/b{n}" if v == "stream" and len(args.in_flight) > 1 else v for v in args.variants.split(",")
              for n in (args.in_flight if v == "stream" else [None])]
    variants = [(v if len(modes) == 1 else f"{v}:{m}") + ("" if len(formats) == 1 else f"@{w}")
                for v in shapes for m in modes for w in formats]
    layouts = {(m, w): job_layout(args, m, w) for m in modes for w in formats}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for rnd in range(args.repeats):  # A B C, C B A, ...: drift hits every variant alike
            for variant in (variants if rnd % 2 == 0 else variants[::-1]):
                print(f"[bench_pipeline] round {rnd}: {variant} ...", flush=True)
                name, _, weights = variant.partition("@")
                shape, _, mode = name.partition(":")
                shape, _, in_flight = shape.partition("/b")
                mode, weights = mode or modes[0], weights or formats[0]
                if shape == "bare":
                    r = bare_run(args, mode, weights, rows)
                elif shape in ("engine", "engine_all"):
                    layout = layouts[mode, weights]
                    threads = layout["threads"] * (layout["actors"] if shape == "engine_all" else 1)
                    r = engine_run(args, mode, weights, rows, threads)
                else:
                    out_dir = work / f"out-{shape}{in_flight}-{mode}-{weights}-{rnd}"
                    r = pipeline_run(args, mode, weights, waves if shape == "waves" else [whole], out_dir,
                                     int(in_flight) if in_flight else None)
                r["rows_per_s"] = r["rows"] / r["wall_s"]
                r["tokens_per_s"] = r["tokens"] / r["wall_s"]
                r["generate_tokens_per_s"] = r["tokens"] / r["generate_s"] if r["generate_s"] else None
                runs[variant].append(r)
                print(f"[bench_pipeline] {variant}: {r['rows']} rows, {r['tokens']} tokens in {r['wall_s']:.1f} s: "
                      f"{r['tokens_per_s']:.1f} tokens/s ({r['model_loads']} model loads)", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    reference = runs[variants[0]][0]["completions"]
    summary = {v: summarize_runs(rs, reference) for v, rs in runs.items()}
    out = {
        "benchmark": "tools.bench_pipeline", "git_commit": commit, "config": vars(args),
        # per (mode, weights): the job's engine actors here and the threads of each (the engine variant's threads)
        "layout": {f"{m}@{w}": layout for (m, w), layout in layouts.items()},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    **machine_facts("cpu"), "torch": torch.__version__, "ray": ray.__version__},
        "note": "tokens_per_s: generated tokens / wall seconds of the whole variant, start-up included; "
                "generate_tokens_per_s leaves start-up out. Means over rounds; per-round values in rounds. Batches "
                "are not made of the same rows across variants (Ray Data's block order, the waves' split), and in "
                "bf16 a row's completion can depend on its batch mates (rounding): equal completions are checked "
                "in fp32 by the tests, not here. engine is one engine with the threads of one of the job's actors "
                "(layout): where the layout has more than one actor, the job runs that many engines against it; engine_all is "
                "one engine with all the layout's threads.",
        "variants": summary,
    }
    pairs = []
    for v in variants:  # each job variant against the references, and against the first number in flight
        cut = min([i for i in (v.find(":"), v.find("@")) if i >= 0], default=len(v))
        shape, rest = v[:cut], v[cut:]
        if shape.startswith("stream"):
            pairs += [(v, ref + rest) for ref in ("engine", "engine_all", "bare", "waves")]
            if shape != "stream" and shape != f"stream/b{args.in_flight[0]}":
                pairs.append((v, f"stream/b{args.in_flight[0]}{rest}"))
    pairs += [(f"{v}:{m}", f"{v}:dense") for v in shapes for m in modes if m != "dense"]
    pairs += [(v, v.rsplit("@", 1)[0] + f"@{formats[0]}") for v in variants if "@" in v and not v.endswith(f"@{formats[0]}")]
    for a, b in pairs:
        if a in summary and b in summary:
            out[f"{a}_vs_{b}"] = {k: round(summary[a][k] / summary[b][k], 3)
                                  for k in ("tokens_per_s", "generate_tokens_per_s") if summary[b][k]}
    return emit_json(out, args.out)


if __name__ == "__main__":
    main()
