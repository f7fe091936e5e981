"""Batch generation with Ray Data: prompt files in, one Parquet row per prompt out.

    python -m jobs.generate --output out/gen                     # SmolLM2, held-out instruction prompts
    python -m jobs.generate --input prompts.jsonl --output out/gen --mode dense --max-new-tokens 32
    ray job submit --working-dir . -- python -m jobs.generate --output /abs/path/out/gen

Rerun with the same --output to finish a job that stopped: rows already written are skipped, rows whose
prompt or own sampling changed are generated again, and --retry-errors generates the error rows again.
The output folder's manifest must match this job's settings (--overwrite-config to write anyway), and one
job at a time holds the folder (its lock file; a lock left by a crashed job on this host is taken over).
Prints progress while it runs and the summary as JSON at the end (also saved as _summary.json).
The rows read back with `pd.read_parquet(OUTPUT)`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from jobs.cli import add_engine_arguments, engine_options

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"  # `make model` imports it
DEFAULT_INPUT = REPO / "prompts" / "instructions_heldout.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=[str(DEFAULT_INPUT)],
                   help="JSONL/CSV/Parquet files or directories with a prompt column (default: held-out "
                        "instruction prompts); a row may set its own sampling with vLLM's names (a sampling_params "
                        "object or columns max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos); the "
                        "flags below are the defaults of rows that do not")
    p.add_argument("--output", required=True, help="output directory (local or mounted; absolute under ray job submit)")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--mode", choices=["auto", "dense", "spec", "specee"], default="auto",
                   help="auto (default, lossless: per step a dense step or speculative decoding, whichever the "
                        "plan measured on this machine expects to be faster) | dense | spec (speculative decoding "
                        "with a fixed shape: lossless; --spec-t3 adds early exit inside verification, lossy) | "
                        "specee (early exit, lossy: changes outputs; schedule re-tuned while the job runs)")
    p.add_argument("--retune-every-tokens", type=int, default=1024,
                   help="specee: re-tune the predictor schedule after this many generated tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-actors", type=int, default=None,
                   help="engine replicas (one GPU each on a GPU cluster); default: on a one-machine CPU cluster the "
                        "measured layout of its cores (actors x threads: pipeline.actor_plan, cached), else 2")
    add_engine_arguments(p)  # --batch-size (rows per actor call and engine batch), --prefill-chunk, --kv-cache-gb ...
    p.add_argument("--max-concurrent-batches", type=int, default=1,
                   help="batches in flight per engine actor (Ray Data LLM's name): the next batch's rows decode beside "
                        "the last rows of the current one, so the engine stays full; 1: one engine call at a time "
                        "(the default: two measured no faster on a 2-core VM, docs/RESULTS.md)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda: one GPU per actor)")
    p.add_argument("--weights", choices=["auto", "fp32", "bf16", "q8", "q4", "q8a8", "q4a8", "gguf"], default="auto",
                   help="auto (default: with --dtype auto, the checkpoint's own low-bit format, e.g. the Q4_1 of a GGUF, where its "
                        "kernel is faster here at the batch size; else the dtype) | fp32 | bf16 | q8 | q4 (quantized at load: "
                        "lossy for a float checkpoint) | q8a8 | q4a8 (int8 activations: lossy) | gguf (a GGUF's matrices in "
                        "its own formats: Q4_K, Q6_K, Q5_0 ... blocks as stored)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto (default: bf16 where the hardware computes it natively, CUDA or CPUs with "
                        "avx512_bf16/AMX, else float32) | float32 (equals transformers token for token) | bfloat16 | "
                        "float16")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="each prompt is a user message, run through the model's chat template "
                        "(default: when the model has one)")
    p.add_argument("--cpus-per-actor", type=float, default=None)
    p.add_argument("--torch-threads", type=int, default=None, help="default: the actor's CPUs, at least 1")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows, in file order")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="a longer prompt is an error row, refused before it is hashed whole or tokenized (default "
                        "1,000,000); a JSONL or CSV line past 12 bytes per allowed character + 1 MiB is not parsed")
    p.add_argument("--input-format", choices=["jsonl", "csv", "parquet"], default=None)
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--id-column", default="id")
    p.add_argument("--schedule", default=None, help="specee: initial schedule JSON (default: the model's)")
    p.add_argument("--explore-every", type=int, default=8,
                   help="specee: every n-th decode step runs every predictor, so that re-tuning sees exits "
                        "the current schedule would miss (0: never; re-tuning then sees a biased histogram)")
    p.add_argument("--threshold", type=float, default=None,
                   help="specee: raw exit probability threshold (uncalibrated; see --max-disagreement)")
    p.add_argument("--max-disagreement", type=float, default=None,
                   help="specee: at most this share of exited tokens may differ from the full model's choice "
                        "(per-layer thresholds calibrated on held-out data, audited live; e.g. 0.02)")
    p.add_argument("--confidence", type=float, default=0.95, help="specee: confidence of --max-disagreement")
    p.add_argument("--audit-fraction", type=float, default=None,
                   help="specee: share of decode steps whose exited rows still run every layer, to check the "
                        "tolerance live (default 0.05 with --max-disagreement, else 0)")
    p.add_argument("--specee-gate", choices=["auto", "measured", "off"], default=None,
                   help="specee: run whole steps dense where SpecEE's steps measure slower than dense ones "
                        "(measured; auto = measured on CPUs, off on CUDA; off: every step SpecEE)")
    p.add_argument("--spec-proposer", choices=["auto", "draft", "lookup"], default=None,
                   help="spec, auto: draft head, prompt lookup, or auto (the draft head when the model has one)")
    p.add_argument("--spec-depth", type=int, default=None,
                   help="spec: tokens drafted per step; auto: the deepest chain the plan may choose (default 4)")
    p.add_argument("--spec-width", type=int, default=None,
                   help="spec with the draft head: nodes expanded per level (1: a chain, >1: a tree)")
    p.add_argument("--spec-t3", action="store_true",
                   help="spec: SpecEE T3, exit predictors may end the verify forward early (lossy; greedy only; "
                        "--threshold applies)")
    p.add_argument("--spec-lookup", choices=["off", "merge", "first"], default=None,
                   help="spec with the draft head: prompt lookup's chain joins its tree (merge) or replaces it "
                        "where lookup finds a continuation (first)")
    p.add_argument("--rows-per-file", type=int, default=1000)
    p.add_argument("--retry-errors", action="store_true",
                   help="generate the error rows already in --output again (error_kind says which are worth it: "
                        "'machine'); their old rows are removed")
    p.add_argument("--overwrite-config", action="store_true",
                   help="write into an --output whose manifest records other settings (model weights, mode, "
                        "sampling, inputs) than this job's")
    p.add_argument("--address", default=None, help="Ray cluster address; 'local' starts a private instance "
                                                   "(default: RAY_ADDRESS, else a cluster started here with "
                                                   "`ray start`, else a new local instance; a local "
                                                   "instance listens on 127.0.0.1 only)")
    p.add_argument("--batch-timeout", type=float, default=900.0, metavar="S",
                   help="an engine call (one batch) running longer is a hang: its process is stopped and the batch "
                        "runs again, in the end row by row in a quarantined process (0: no limit; default 900)")
    p.add_argument("--row-attempts", type=int, default=2,
                   help="a row that kills or hangs a fresh engine process this many times alone becomes an error "
                        "row (default 2)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace):
    from pipeline.batch import BatchConfig
    from pipeline.stage import StageConfig
    from specee_core.options import default

    mode = args.mode
    early_exit = {"explore_every": args.explore_every} if mode == "specee" else {}
    if args.threshold is not None:
        early_exit["threshold"] = args.threshold
    if args.max_disagreement is not None:
        if mode != "specee":
            raise SystemExit("--max-disagreement applies to --mode specee (the other modes are lossless)")
        early_exit.update(max_disagreement=args.max_disagreement, confidence=args.confidence)
    audit = args.audit_fraction if args.audit_fraction is not None else (0.05 if args.max_disagreement else 0.0)
    if audit:
        early_exit["audit_fraction"] = audit
    if args.specee_gate is not None:
        early_exit["gate"] = args.specee_gate
    spec = {k: v for k, v in (("proposer", args.spec_proposer), ("depth", args.spec_depth),
                              ("width", args.spec_width), ("lookup", args.spec_lookup),
                              ("t3", args.spec_t3 or None)) if v is not None}
    engine = engine_options(args)
    stage = StageConfig(model=args.model, mode=mode, device=args.device, dtype=args.dtype, weights=args.weights,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, stop=tuple(args.stop), seed=args.seed, batch_size=engine.pop("max_batch_size"),
                        torch_threads=args.torch_threads, chat=args.chat, engine_options=early_exit, spec=spec,
                        kv_cache_gb=engine.pop("kv_cache_gb"), prefix_cache=engine.pop("prefix_cache"),
                        core_options={k: v for k, v in engine.items() if v != default(k)},
                        batch_timeout_s=args.batch_timeout or None, row_attempts=args.row_attempts,
                        max_concurrent_batches=args.max_concurrent_batches)
    return BatchConfig(input=args.input, output=args.output, stage=stage,
                       retune_every_tokens=args.retune_every_tokens,
                       num_actors=args.num_actors, cpus_per_actor=args.cpus_per_actor,
                       input_format=args.input_format, prompt_column=args.prompt_column, id_column=args.id_column,
                       limit=args.limit, schedule=args.schedule, rows_per_file=args.rows_per_file,
                       show_progress=not args.no_progress, retry_errors=args.retry_errors,
                       overwrite_config=args.overwrite_config,
                       # None: BatchConfig's default, kept in one place (pipeline.prompts.MAX_PROMPT_CHARS)
                       **({} if args.max_prompt_chars is None else {"max_prompt_chars": args.max_prompt_chars}))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from pipeline.batch import run
    from pipeline.local_ray import init_ray

    cfg = build_config(args)
    if not ray.is_initialized():
        init_ray(args.address)
    summary = run(cfg)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
