"""What a JSON schema costs: decode tokens/s of the same held-out prompts with and without a schema, mode auto
(or --modes), batch 1 and 8, the variants interleaved round by round; prints (and with --out writes) JSON with
the commit and the machine. Two shapes of run per batch size b: b prompts at once (the batch empties as rows
finish: the schema's shorter, ragged replies empty it sooner than free text does), and a stream of b x --waves
prompts through an engine of b rows (finished rows are replaced, as in a batch job: tokens/s over the call).

    python -m tools.bench_structured --out docs/bench_structured.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from jobs.cli import emit_json, git_commit
from specee_core import SamplingParams, SpecEEEngine
from specee_core.machine import machine_facts

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "summary": {"type": "string", "maxLength": 160},
    "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    "returns_value": {"type": "boolean"}}, "required": ["name", "summary", "arguments", "returns_value"],
    "additionalProperties": False}


def prompts(engine: SpecEEEngine, path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [engine.chat_prompt([{"role": "user", "content": r["prompt"] + "\nAnswer in JSON with the keys name, "
                                 "summary, arguments and returns_value."}]) for r in rows]


def run(engine: SpecEEEngine, batch: list[str], mode: str, params) -> tuple[float, list[int]]:
    """(decode tokens/s of the call: tokens after each row's first over the call's decode seconds, each row's
    token count)."""
    t0 = time.perf_counter()
    res = engine.generate(batch, mode=mode, sampling_params=params)
    wall = time.perf_counter() - t0
    first = max(r.metrics["ttft_s"] for r in res)  # every row's prefill is done by then
    tokens = sum(len(r.token_ids) - 1 for r in res)
    return tokens / max(wall - first, 1e-9), [len(r.token_ids) for r in res]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("prompts/instructions_heldout.jsonl"))
    ap.add_argument("--modes", default="auto")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--waves", type=int, default=4, help="the stream: this many prompts per row of the engine")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = SpecEEEngine.from_pretrained(args.model, max_batch_size=max(batches), weights=args.weights)
    ps = prompts(engine, args.prompts, max(batches))
    variants = {"plain": SamplingParams(max_new_tokens=args.max_new_tokens),
                "json_schema": SamplingParams(max_new_tokens=args.max_new_tokens,
                                              structured={"type": "json_schema", "schema": SCHEMA})}
    speeds: dict[str, list[float]] = {}
    valid = {}
    for mode in args.modes.split(","):
        for b in batches:
            for name, p in variants.items():  # warm-up: the plan's costs, the grammar tokenizer
                engine.generate(ps[:b], mode=mode, sampling_params=SamplingParams(
                    max_new_tokens=8, structured=p.structured))
            # the schema's replies are shorter than free text: "plain_same_lengths" cuts each row's free text to
            # the length of its schema reply (ignore_eos), so the batch empties alike and only the constraint differs
            lengths = run(engine, ps[:b], mode, variants["json_schema"])[1]
            same = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
            for rnd in range(args.rounds):
                order = [*variants.items(), ("plain_same_lengths", same)]
                for name, p in (order if rnd % 2 == 0 else reversed(order)):
                    tps, _ = run(engine, ps[:b], mode, p)
                    speeds.setdefault(f"{mode}_b{b}_{name}", []).append(tps)
                    print(f"{mode} b{b} {name} round {rnd}: {tps:.1f} tok/s", flush=True)
            res = engine.generate(ps[:b], mode=mode, sampling_params=variants["json_schema"])
            valid[f"{mode}_b{b}"] = sum(_parses(r.text) for r in res) / b
            stream(args, b, mode, variants, speeds, valid)
    out = {"git_commit": git_commit(), "machine": machine_facts(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "weights": engine.model.weight_format, "dtype": str(engine.model.dtype).removeprefix("torch."),
           "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "schema": SCHEMA,
           "decode_tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in speeds.items()},
           "decode_tokens_per_s_runs": {k: [round(x, 1) for x in v] for k, v in speeds.items()},
           "ratio_json_schema_to_plain": {
               k.removesuffix("_plain"): round(statistics.median(speeds[k.replace("_plain", "_json_schema")])
                                              / statistics.median(v), 3)
               for k, v in speeds.items() if k.endswith("_plain")},
           "ratio_json_schema_to_plain_same_lengths": {
               k.removesuffix("_plain_same_lengths"): round(
                   statistics.median(speeds[k.replace("_plain_same_lengths", "_json_schema")]) / statistics.median(v), 3)
               for k, v in speeds.items() if k.endswith("_plain_same_lengths")},
           "waves": args.waves,
           "schema_replies_parsing": valid,
           "note": "decode tokens/s: tokens after each row's first over the call's seconds after its last first "
                   "token; the same prompts with and without the schema, interleaved; plain_same_lengths: free text "
                   "cut per row to its schema reply's length, so only the constraint differs"}
    emit_json(out, args.out)


def stream(args, b: int, mode: str, variants: dict, speeds: dict, valid: dict) -> None:
    """b x args.waves prompts through an engine of b rows, with and without the schema (and free text of the
    schema replies' lengths), interleaved: tokens/s over the whole call (prefill included, the same prompts)."""
    engine = SpecEEEngine.from_pretrained(args.model, max_batch_size=b, weights=args.weights)
    ps = prompts(engine, args.prompts, b * args.waves)
    for p in variants.values():  # warm-up: the plan's costs at this batch size, the prefix cache
        engine.generate(ps, mode=mode, sampling_params=SamplingParams(max_new_tokens=2, structured=p.structured))
    # the schema's replies are shorter, so each prompt's prefill and admission weigh more per token: free text
    # cut per row to its schema reply's length (ignore_eos) runs the same tokens, so only the constraint differs
    lengths = [len(r.token_ids) for r in engine.generate(ps, mode=mode, sampling_params=variants["json_schema"])]
    order = [*variants.items(), ("plain_same_lengths", [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                        for n in lengths])]
    for rnd in range(args.rounds):
        for name, p in (order if rnd % 2 == 0 else reversed(order)):
            t0 = time.perf_counter()
            res = engine.generate(ps, mode=mode, sampling_params=p)
            tps = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
            speeds.setdefault(f"{mode}_b{b}_stream_{name}", []).append(tps)
            print(f"{mode} b{b} stream of {len(ps)} {name} round {rnd}: {tps:.1f} tok/s", flush=True)
            if name == "json_schema":
                valid[f"{mode}_b{b}_stream"] = sum(_parses(r.text) for r in res) / len(res)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
