"""The engine on a CUDA GPU: exactness against transformers and between modes, then timings.

    python -m jobs.gpu_check --model models/specee-tiny --out gpu_check.json

Greedy, fp32 (no TF32): dense against transformers' generate token for token; every lossless mode
(spec: draft chain, draft tree, prompt lookup, T3 with exits off; auto) against dense; SpecEE with exits
switched off against dense, and SpecEE's fused Triton predictor (the CUDA default) against the torch
scorer on the same steps; the low-bit formats (q8, q4: Triton GEMV on CUDA) against fp32. Then tokens/s
of each mode at batch 1 and 8, the modes interleaved over rounds (the order rotating), after a warm-up.
Every check is recorded, a failing one with its error, so one run shows everything; JSON with the commit
and the GPU. The CPU suite (`make test`) is the project's test command; this runs where a GPU is lent.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

PROMPTS = ["def add(a, b):\n", "import os\n\ndef main():\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n", "The quick brown fox", "Once upon a time", "x = [1, 2, 3]\ny =",
           "# sort a list\ndef sort("]
SPEC = {"spec_chain": {"proposer": "draft", "depth": 4, "width": 1, "lookup": "off"},
        "spec_tree": {"proposer": "draft", "depth": 5, "width": 4, "nodes": 12, "lookup": "merge"},
        "spec_lookup": {"proposer": "lookup", "depth": 4},
        "spec_t3": {"proposer": "draft", "depth": 5, "width": 4, "nodes": 12, "t3": True}}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run_mode(engine, mode: str, prompts: list[str], n: int):
    if mode in SPEC:
        return engine.generate(prompts, max_new_tokens=n, mode="spec", spec=SPEC[mode], ignore_eos=True)
    return engine.generate(prompts, max_new_tokens=n, mode=mode, ignore_eos=True)


def hit_bank(k: int, layers: list[int]):
    """Exit predictors of feature set "zpdqh" (both of the fused kernel's given feature blocks: the draft's
    probabilities and its record) that fire exactly when the row's last proposal was a hit: one hidden unit
    on the record's first entry. Decisions that are never near the threshold, so two scorers must agree."""
    from specee_core.early_exit.predictors import HIDDEN, LayerPredictor, PredictorBank

    w1 = torch.zeros(HIDDEN, 5 * k)
    w1[0, 4 * k] = 1.0
    w2 = torch.zeros(1, HIDDEN)
    w2[0, 0] = 100.0
    return PredictorBank(k, {l: LayerPredictor(w1.clone(), torch.zeros(HIDDEN), w2.clone(), torch.tensor([-50.0]))
                             for l in layers}, features="zpdqh", exit_token="draft")


def outcome(engine, mode: str, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """The tokens and exit layers of every prompt."""
    res = run_mode(engine, mode, PROMPTS, n)
    return [r.token_ids for r in res], [r.exit_layers for r in res]


def check(results: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        out = fn()
        results[name] = {"ok": bool(out.pop("ok")), **out}
    except Exception as e:  # recorded, and the next check runs
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"})[:600], flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/specee-tiny")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    from jobs.bench import git_commit
    from specee_core import SpecEEEngine

    n, model = args.tokens, Path(args.model)
    report: dict = {"git_commit": git_commit(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None,
                    "model": str(model), "tokens": n, "checks": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    checks = report["checks"]
    engine = SpecEEEngine.from_pretrained(model, device=dev, dtype="float32", weights="fp32")
    dense = [r.token_ids for r in run_mode(engine, "dense", PROMPTS, n)]

    def vs_transformers():
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(dev).eval()
        firsts = []
        for prompt, ours in zip(PROMPTS, dense):
            ids = torch.tensor([engine.encode_prompt(prompt)], device=dev)
            with torch.inference_mode():
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  min_new_tokens=n, top_p=None, top_k=None, temperature=None)[0, ids.shape[1]:].tolist()
            firsts.append(first_divergence(ours, ref))
        return {"ok": all(f is None for f in firsts), "first_divergence": firsts}

    check(checks, "dense_equals_transformers_fp32", vs_transformers)

    def equals_dense(mode: str, **exit_options):
        def fn():
            got = outcome(engine.with_options(**exit_options) if exit_options else engine, mode, n)[0]
            firsts = [first_divergence(a, b) for a, b in zip(got, dense)]
            return {"ok": all(f is None for f in firsts), "first_divergence": firsts}
        return fn

    def same_exits(engines_by_backend: dict) -> dict:
        """SpecEE through the fused Triton predictor and through the torch scorer: the same tokens and exits."""
        outs = {backend: outcome(e, "specee", n) for backend, e in engines_by_backend.items()}
        exits = sum(l < engine.config.num_hidden_layers for ls in outs["torch"][1] for l in ls)
        same_tokens, same_layers = (outs["triton"][i] == outs["torch"][i] for i in (0, 1))
        return {"ok": same_tokens and same_layers and exits > 0, "exits": exits, "same_tokens": same_tokens,
                "same_exit_layers": same_layers}

    for mode in ("spec_chain", "spec_tree", "spec_lookup", "auto"):
        check(checks, f"{mode}_equals_dense", equals_dense(mode))
    if engine.early_exit is not None:
        check(checks, "specee_exits_off_equals_dense", equals_dense("specee", threshold=2.0))
        check(checks, "spec_t3_exits_off_equals_dense", equals_dense("spec_t3", threshold=2.0))
        ee = engine.early_exit  # the bundled bank: its k and layers
        check(checks, "specee_triton_predictor_decides_like_torch", lambda: same_exits(
            {b: engine.with_options(predictor_backend=b, threshold=0.5, gate="off") for b in ("triton", "torch")}))

        def zpdqh_bank():
            """The kernel's two given feature blocks (draft probabilities, record) in the engine."""
            import shutil
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                shutil.copytree(model, tmp, dirs_exist_ok=True)
                hit_bank(ee.predictors.k, sorted(ee.predictors.layers)).save(Path(tmp) / "predictors.safetensors")
                return same_exits({b: SpecEEEngine.from_pretrained(tmp, device=dev, dtype="float32", weights="fp32",
                                                                  speculator="draft", threshold=0.5, gate="off",
                                                                  predictor_backend=b) for b in ("triton", "torch")})

        check(checks, "specee_zpdqh_triton_predictor_decides_like_torch", zpdqh_bank)
    engines = {"fp32": engine}
    for fmt in ("q8", "q4"):
        def lowbit(fmt=fmt):
            e = SpecEEEngine.from_pretrained(model, device=dev, dtype="float32", weights=fmt)
            engines[fmt] = e
            got = [r.token_ids for r in run_mode(e, "dense", PROMPTS, n)]
            firsts = [first_divergence(a, b) for a, b in zip(got, dense)]
            # a different rounding of the same model: greedy paths may part after a near tie, not at once
            return {"ok": e.model.weight_format == fmt and all(f is None or f >= 4 for f in firsts),
                    "weight_format": e.model.weight_format, "first_divergence": firsts}

        check(checks, f"{fmt}_greedy_against_fp32", lowbit)
    # timings: every mode and weight format, batch 1 and 8, interleaved rounds after a warm-up
    variants = [("fp32", m) for m in ("dense", "auto", "spec_chain", "spec_tree", "spec_lookup", "specee")] + \
               [(f, "dense") for f in ("q8", "q4") if f in engines]
    if engine.early_exit is None:
        variants = [v for v in variants if v[1] != "specee"]
    speed: dict = {}
    for batch in (1, 8):
        prompts = (PROMPTS * 2)[:batch]
        times: dict = {f"{w}/{m}": [] for w, m in variants}
        for w, m in variants:  # warm-up (kernel compiles, plans)
            run_mode(engines[w], m, prompts, 8)
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for w, m in order:
                sync()
                t0 = time.perf_counter()
                res = run_mode(engines[w], m, prompts, n)
                sync()
                times[f"{w}/{m}"].append(sum(len(x.token_ids) for x in res) / (time.perf_counter() - t0))
        base = statistics.median(times["fp32/dense"])
        speed[f"batch_{batch}"] = {k: {"tokens_per_s": round(statistics.median(v), 1),
                                       "vs_dense": round(statistics.median(v) / base, 3)} for k, v in times.items()}
        print("speed", batch, json.dumps(speed[f"batch_{batch}"]), flush=True)
    report["speed"] = speed
    # what mode="auto" planned here: its steps and tokens per step at batch 8, and the cost table it used
    res = run_mode(engine, "auto", (PROMPTS * 2)[:8], n)
    report["auto_plan"] = {"stats": {k: v for k, v in res[0].stats.items() if k in ("plan_steps", "mean_tokens_per_step")},
                           "costs": [p.costs.to_json() for p in engine._plans.values()]}
    print("auto plan", json.dumps(report["auto_plan"])[:1500], flush=True)
    report["all_ok"] = all(c["ok"] for c in checks.values())
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1))
    return report


if __name__ == "__main__":
    main()
