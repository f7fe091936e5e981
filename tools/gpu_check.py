"""The engine on a CUDA GPU with SmolLM2: exactness against transformers and between modes, then every mode
and weight format beside transformers' `generate`, batch 1 to 64.

    python -m tools.gpu_check --model models/smollm2-135m-instruct --out gpu_check.json

Greedy, fp32 (no TF32), on held-out chat prompts: dense against transformers' generate token for token, and
dense batched against each prompt alone; every lossless mode (spec: draft chain, draft tree, prompt lookup,
T3 and SpecEE with exits off; auto) against dense; SpecEE's fused Triton predictor (the CUDA default)
against the torch scorer on the same steps; the low-bit formats (q8, q4: Triton GEMV on CUDA) against fp32;
bf16 against transformers in bf16 (agreement, measured, not required). Then tokens/s of every mode and
weight format and of transformers (fp32 and bf16) at each batch size, the variants interleaved over rounds
(the order rotating) after a warm-up; batch 1 decodes two prompts one after another. Every check is
recorded, a failing one with its error, so one run shows everything; the JSON (with the commit and the
GPU) is rewritten after every section, so a run cut short keeps what it measured. The CPU suite (`make
test`) is the project's test command; this runs where a GPU is lent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

SPEC = {"spec_chain": {"proposer": "draft", "depth": 4, "width": 1, "lookup": "off"},
        "spec_tree": {"proposer": "draft", "depth": 5, "width": 4, "nodes": 12, "lookup": "merge"},
        "spec_lookup": {"proposer": "lookup", "depth": 4},
        "spec_t3": {"proposer": "draft", "depth": 5, "width": 4, "nodes": 12, "t3": True}}
LOSSY = ("specee", "spec_t3")  # early exit: may change tokens (stated, off by default)


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


def check(results: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        out = fn()
        results[name] = {"ok": bool(out.pop("ok")), **out}
    except Exception as e:  # recorded, and the next check runs
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"})[:600], flush=True)


class HF:
    """transformers' generate, greedy, every row exactly n new tokens (left padding for batches)."""

    def __init__(self, model: Path, dtype: torch.dtype, device: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        self.tok = AutoTokenizer.from_pretrained(model, padding_side="left")
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.device = device

    def generate_ids(self, ids: list[list[int]], n: int) -> list[list[int]]:
        width = max(map(len, ids))
        pad = self.tok.pad_token_id
        x = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      top_p=None, top_k=None, temperature=None, pad_token_id=pad)
        return out[:, width:].tolist()

    def top2_margin(self, ids: list[int]) -> float:
        """The gap between the two highest next-token logits after ids (a near tie flips on rounding)."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids], device=self.device)).logits[0, -1].float()
        top = logits.topk(2).values
        return round(float(top[0] - top[1]), 5)


def plot_speed(reports: list[Path], out: Path) -> None:
    """Tokens/s of every variant at each batch size (bars, log scale), from one or more reports of one GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed: dict = {}
    gpu = None
    for path in reports:
        report = json.loads(path.read_text())
        gpu = gpu or report.get("gpu")
        for batch, table in report.get("speed", {}).items():
            if "skipped" not in table:
                speed[int(batch.removeprefix("batch_"))] = {k: v["tokens_per_s"] for k, v in table.items()
                                                            if isinstance(v, dict) and "tokens_per_s" in v}
    names = list(dict.fromkeys(k for table in speed.values() for k in table))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(len(speed), 1)
    for i, batch in enumerate(sorted(speed)):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [speed[batch].get(k, 0) for k in names], width, label=f"batch {batch}")
    ax.set_xticks([j + width * (len(speed) - 1) / 2 for j in range(len(names))], names, rotation=40, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"SmolLM2-135M-Instruct on {gpu}: every mode and weight format beside transformers (hf/...)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--prompts", default="prompts/instructions_heldout.jsonl", help="held-out chat prompts")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per prompt in the exactness checks")
    p.add_argument("--speed-tokens", type=int, default=64, help="new tokens per row in the timings")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--deadline", type=float, default=0, help="seconds: batch sizes not started by then are skipped")
    p.add_argument("--timings-only", action="store_true", help="skip the checks (a rerun of the timings)")
    p.add_argument("--out", default="")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    p.add_argument("--plot", nargs="+", type=Path, default=None, help="reports to plot into --out (a PNG); no run")
    args = p.parse_args(argv)
    if args.plot:
        plot_speed(args.plot, Path(args.out))
        return {}
    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    import transformers

    from jobs.cli import git_commit
    from specee_core import SpecEEEngine

    n, model = args.tokens, Path(args.model)
    report: dict = {"git_commit": os.environ.get("SPECEE_COMMIT") or git_commit(), "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None, "model": str(model),
                    "tokens": n, "speed_tokens": args.speed_tokens, "checks": {}, "agreement": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None

    def save() -> None:
        report["all_ok"] = all(c["ok"] for c in report["checks"].values())
        report["seconds"] = round(time.perf_counter() - start, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))

    checks = report["checks"]
    # a rerun of the timings alone skips the checks
    verify = (lambda results, name, fn: None) if args.timings_only else check  # noqa: E731
    engine = SpecEEEngine.from_pretrained(model, device=dev, dtype="float32", weights="fp32")
    rows = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()]
    batches = [int(b) for b in args.batches.split(",")]
    rows = rows[: max(batches + [8])]
    prompts = [engine.chat_prompt([{"role": "user", "content": r}]) for r in rows] if engine.has_chat_template else rows
    few = prompts[:8]
    dense = [r.token_ids for r in run_mode(engine, "dense", few, n)]
    hf32 = HF(model, torch.float32, dev)

    def vs_transformers():
        ids = [engine.encode_prompt(q) for q in few]
        firsts, margins = [], []
        for x, ours in zip(ids, dense):
            ref = hf32.generate_ids([x], n)[0]
            f = first_divergence(ours, ref)
            firsts.append(f)
            margins.append(None if f is None else hf32.top2_margin(x + ref[:f]))
        return {"ok": all(f is None for f in firsts), "first_divergence": firsts, "top2_margin_there": margins}

    verify(checks, "dense_equals_transformers_fp32", vs_transformers)

    def batched_equals_alone():
        alone = [run_mode(engine, "dense", [q], n)[0].token_ids for q in few]
        firsts = [first_divergence(a, b) for a, b in zip(dense, alone)]
        return {"ok": all(f is None for f in firsts), "first_divergence": firsts}

    verify(checks, "dense_batch_of_8_equals_each_alone", batched_equals_alone)

    def equals_dense(mode: str, **exit_options):
        def fn():
            e = engine.with_options(**exit_options) if exit_options else engine
            got = [r.token_ids for r in run_mode(e, mode, few, n)]
            firsts = [first_divergence(a, b) for a, b in zip(got, dense)]
            return {"ok": all(f is None for f in firsts), "first_divergence": firsts}
        return fn

    def same_exits(engines_by_backend: dict) -> dict:
        """SpecEE through the fused Triton predictor and through the torch scorer: the same tokens and exits."""
        outs = {}
        for backend, e in engines_by_backend.items():
            res = run_mode(e, "specee", few, n)
            outs[backend] = ([r.token_ids for r in res], [r.exit_layers for r in res])
        exits = sum(l < engine.config.num_hidden_layers for ls in outs["torch"][1] for l in ls)
        same_tokens, same_layers = (outs["triton"][i] == outs["torch"][i] for i in (0, 1))
        return {"ok": same_tokens and same_layers and exits > 0, "exits": exits, "same_tokens": same_tokens,
                "same_exit_layers": same_layers}

    for mode in ("spec_chain", "spec_tree", "spec_lookup", "auto"):
        verify(checks, f"{mode}_equals_dense", equals_dense(mode))
    if engine.early_exit is not None:
        verify(checks, "specee_exits_off_equals_dense", equals_dense("specee", threshold=2.0))
        verify(checks, "spec_t3_exits_off_equals_dense", equals_dense("spec_t3", threshold=2.0))
        ee = engine.early_exit  # the bundled bank: its k and layers
        verify(checks, "specee_triton_predictor_decides_like_torch", lambda: same_exits(
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

        verify(checks, "specee_zpdqh_triton_predictor_decides_like_torch", zpdqh_bank)
    save()
    engines = {"fp32": engine}
    for fmt in ("q8", "q4"):
        engines[fmt] = SpecEEEngine.from_pretrained(model, device=dev, dtype="float32", weights=fmt)

        def lowbit(e=engines[fmt], fmt=fmt):
            got = [r.token_ids for r in run_mode(e, "dense", few, n)]
            firsts = [first_divergence(a, b) for a, b in zip(got, dense)]
            # a different rounding of the same model: greedy paths may part after a near tie, not at once
            return {"ok": e.model.weight_format == fmt and all(f is None or f >= 4 for f in firsts),
                    "weight_format": e.model.weight_format, "first_divergence": firsts}

        verify(checks, f"{fmt}_greedy_against_fp32", lowbit)
    hf16 = HF(model, torch.bfloat16, dev)
    engines["bf16"] = SpecEEEngine.from_pretrained(model, device=dev, weights="bf16")
    engines["default"] = SpecEEEngine.from_pretrained(model, device=dev)  # every option left alone
    d = engines["default"]
    report["default_engine"] = {"dtype": str(d.model.dtype).removeprefix("torch."),
                                "weights": d.model.weight_format, "dtype_reason": d.dtype_reason,
                                "weights_reason": d.weights_reason}
    ids = [engine.encode_prompt(q) for q in few]
    for name, e, ref_model in (("bf16", engines["bf16"], hf16), ("q8", engines.get("q8"), hf32),
                               ("q4", engines.get("q4"), hf32)):
        try:  # measured, not required: how far each format's greedy text follows transformers'
            ours = [r.token_ids for r in run_mode(e, "dense", few, n)]
            ref = [ref_model.generate_ids([x], n)[0] for x in ids]
            firsts = [first_divergence(a, b) for a, b in zip(ours, ref)]
            report["agreement"][f"{name}_vs_transformers_{'bf16' if name == 'bf16' else 'fp32'}"] = {
                "identical": sum(f is None for f in firsts), "of": len(firsts), "first_divergence": firsts}
        except Exception as e:  # noqa: BLE001 - recorded
            report["agreement"][name] = {"error": f"{type(e).__name__}: {e}"}
    print("agreement", json.dumps(report["agreement"]), flush=True)
    save()

    # timings: every mode and weight format, and transformers, at each batch size
    variants = [("hf", "fp32"), ("hf", "bf16")] + \
               [("fp32", m) for m in ("dense", "auto", "spec_chain", "spec_tree", "spec_lookup", "specee",
                                      "spec_t3")] + \
               [(w, m) for w in ("bf16", "default") for m in ("dense", "auto")] + \
               [(f, m) for f in ("q8", "q4") if f in engines for m in ("dense", "auto")]
    if engine.early_exit is None:
        variants = [v for v in variants if v[1] not in LOSSY]
    hf = {"fp32": hf32, "bf16": hf16}

    def run(variant, group: list[str], tokens: int) -> int:
        w, m = variant
        if w == "hf":
            return sum(map(len, hf[m].generate_ids([engines["fp32"].encode_prompt(q) for q in group], tokens)))
        return sum(len(r.token_ids) for r in run_mode(engines[w], m, group, tokens))

    speed: dict = {}
    report["speed"] = speed
    report["lossy_modes"] = list(LOSSY)
    for batch in batches:
        if args.deadline and time.perf_counter() - start > args.deadline:
            speed[f"batch_{batch}"] = {"skipped": "past --deadline"}
            continue
        groups = [[q] for q in prompts[:2]] if batch == 1 else [prompts[:batch]]
        times: dict = {f"{w}/{m}": [] for w, m in variants}
        errors: dict = {}
        for v in variants:  # warm-up (kernel compiles, plans)
            try:
                run(v, groups[0], 8)
            except Exception as e:  # noqa: BLE001 - a variant that fails is dropped from this batch
                errors[f"{v[0]}/{v[1]}"] = f"{type(e).__name__}: {e}"[:300]
        live = [v for v in variants if f"{v[0]}/{v[1]}" not in errors]
        for r in range(args.rounds):
            order = live[r % len(live):] + live[: r % len(live)]
            for v in order:
                if f"{v[0]}/{v[1]}" in errors:
                    continue
                sync()
                t0 = time.perf_counter()
                try:
                    made = sum(run(v, g, args.speed_tokens) for g in groups)
                except Exception as e:  # noqa: BLE001 - recorded; the variant is dropped from this batch
                    errors[f"{v[0]}/{v[1]}"] = f"{type(e).__name__}: {e}"[:300]
                    continue
                sync()
                times[f"{v[0]}/{v[1]}"].append(made / (time.perf_counter() - t0))
        base, ref = (statistics.median(times[k]) for k in ("fp32/dense", "hf/fp32"))
        speed[f"batch_{batch}"] = {k: {"tokens_per_s": round(statistics.median(v), 1),
                                       "vs_dense_fp32": round(statistics.median(v) / base, 3),
                                       "vs_transformers_fp32": round(statistics.median(v) / ref, 3),
                                       "rounds": [round(x, 1) for x in v]}
                                   for k, v in times.items() if v}
        if errors:
            speed[f"batch_{batch}"]["errors"] = errors
        print("speed", batch, json.dumps({k: v.get("tokens_per_s") if isinstance(v, dict) else v
                                          for k, v in speed[f"batch_{batch}"].items()}), flush=True)
        save()
    # what mode="auto" planned here, per engine: its steps and tokens per step at batch 8, the cost table it
    # used, and the dense and auto wall times beside it (why an engine's auto runs behind its dense)
    report["auto_plan"] = {}
    for name in ("fp32", "bf16", "default"):
        try:
            e = engines[name]
            walls = {}
            for m in ("dense", "auto", "dense", "auto"):
                sync()
                t0 = time.perf_counter()
                res = run_mode(e, m, prompts[:8], args.speed_tokens)
                sync()
                walls.setdefault(m, []).append(round(time.perf_counter() - t0, 3))
            report["auto_plan"][name] = {
                "stats": {k: v for k, v in res[0].stats.items() if k in ("plan_steps", "mean_tokens_per_step")},
                "wall_s": walls, "costs": [p.costs.to_json() for p in e._plans.values()]}
        except Exception as err:  # noqa: BLE001 - recorded
            report["auto_plan"][name] = {"error": f"{type(err).__name__}: {err}"}
    save()
    print(json.dumps({k: v for k, v in report.items() if k not in ("checks", "speed")}, indent=1)[:3000])
    return report


if __name__ == "__main__":
    main()
