"""HumanEval through every decoding mode: pass@1 (greedy) with each completion run in the sandbox,
agreement with dense, layers run, tokens per verify step, tokens/s and speed-up over dense measured
in the same run, perplexity of the reference solutions, a Pareto plot and a JSON with the commit.

    python -m jobs.evaluate --limit 40 --out docs/eval_smollm2.json --plot docs/eval_smollm2.png
    python -m jobs.evaluate --modes dense,spec --limit 164                  # the whole set
    python -m jobs.evaluate --model models/specee-tiny --modes dense,spec,specee --limit 16

Modes: hf (transformers generate, same dtype: a reference point), dense, spec (speculative decoding,
the engine's default options: prompt lookup first, else the draft head's chain), spec_tree (an
EAGLE-2 tree of --tree-depth/-width/-nodes plus the lookup chain), specee (early exit, T1+T2, the
project's exit rule: the argmax among the k candidates) and specee_full (the paper artifact's rule:
the predictor fires, then the full LM head's argmax must be one of the k candidates and is
emitted), spec_t3 (spec_tree with T3 exits inside verification). specee, specee_full and spec_t3
run once per --thresholds value (raw, uncalibrated), and specee once more per --max-disagreement
value (thresholds calibrated per layer to that tolerance: specee_core.early_exit.calibration). dense_q8 / dense_q4: dense decoding on the weights quantized at load
(specee_core.model.quant; activations in fp32), agreement measured against dense in --dtype: with
--dtype float32 that is the quantization's own cost.

Generation is interleaved: for each batch of problems every mode runs in turn (the order rotating
per batch), so a slow spell of the machine hits every mode alike. tokens/s = generated tokens /
wall seconds of the generate calls (prefill included). Sandboxed execution runs after all
generation, identical programs once. Perplexity: the reference solutions teacher-forced after
their prompts (plain text), through dense and each early-exit mode's own decode path; speculative
decoding's distribution is dense's by construction.

The sandbox fails closed: without one of its layers (an unprivileged uid, user namespaces, a process
limit of its own, Landlock, seccomp) the job stops at its start, naming the missing layer;
--allow-weak-sandbox runs without it (a warning names it, and the JSON's sandbox.missing_layers records it).
"""
from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jobs.cli import git_commit
from jobs.cli import parse_config
from specee_core import SpecEEEngine
from specee_core.decode.dense import DenseStepper
from specee_core.step.sampling import SamplingParams
from specee_eval import humaneval, metrics
from specee_eval.forced import Forcing
from specee_eval.sandbox import Limits, check_layers, run_many

log = logging.getLogger(__name__)

KINDS = ("hf", "dense", "dense_q8", "dense_q4", "spec", "spec_tree", "specee", "specee_full", "spec_t3")
LOW_BIT_KINDS = {"dense_q8": "q8", "dense_q4": "q4"}  # dense on weights quantized at load, fp32 activations
PER_THRESHOLD = ("specee", "specee_full", "spec_t3")


@dataclass
class EvalConfig:
    model: Path = Path("models/smollm2-135m-instruct")
    modes: str = "hf,dense,spec,specee,specee_full"
    thresholds: str = "0.5,0.7,0.9"  # of specee, specee_full and spec_t3 (0.5: the paper's)
    max_disagreement: str = ""  # specee with thresholds calibrated to each tolerance, e.g. "0.01,0.02,0.05"
    confidence: float = 0.95
    # specee's pay-off gate (EarlyExitOptions.gate): "off" by default here, so that every step is a
    # SpecEE step and the table shows what the exits cost; "auto" is what an engine runs by default
    gate: str = "off"
    limit: int = 0  # the first N problems; 0: all 164
    tasks: str = ""  # only these task ids, e.g. "HumanEval/22,HumanEval/23" (after --limit); "": every problem
    batch_size: int = 1  # problems per generate call
    max_new_tokens: int = 256  # a row that never closes its code block stops here
    dtype: str = "bfloat16"
    weights: str = "auto"  # specee_core.model.quant.WEIGHT_FORMATS; q4 with --dtype float32: SmolLM2's own fp32 model
    chat: str = "auto"  # "auto" (the chat template when the model has one) | "true" | "false"
    tree_depth: int = 5  # spec_tree and spec_t3's draft tree
    tree_width: int = 4
    tree_nodes: int = 12
    timeout_s: float = 10.0  # per program, in the sandbox
    memory_mb: int = 1024
    workers: int = 2  # programs at once
    allow_weak_sandbox: bool = False  # run programs even when a sandbox layer is missing (sandbox.LAYERS)
    perplexity: bool = True
    threads: int = 0
    out: Path | None = None  # the JSON (also printed)
    plot: Path | None = None  # the Pareto plot (PNG)
    replot: Path | None = None  # only draw --plot (and print the table) from this earlier --out JSON

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        bad = [m for m in self.kinds if m not in KINDS]
        if bad:
            raise ValueError(f"unknown modes {bad}: choose from {KINDS}")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.limit < 0:
            raise ValueError("batch_size and max_new_tokens must be >= 1, limit >= 0")
        if self.chat not in ("auto", "true", "false"):
            raise ValueError(f"chat must be auto, true or false, got {self.chat!r}")

    @property
    def kinds(self) -> list[str]:
        return [m for m in self.modes.split(",") if m]

    @property
    def threshold_list(self) -> list[float]:
        return [float(t) for t in self.thresholds.split(",") if t]

    @property
    def tolerance_list(self) -> list[float]:
        return [float(t) for t in self.max_disagreement.split(",") if t]


@dataclass
class Mode:
    """One point of the evaluation: a kind of decoding, with its threshold where it has one."""
    kind: str
    threshold: float | None = None
    engine: SpecEEEngine | None = None
    spec: dict | None = None
    seconds: float = 0.0
    results: list = field(default_factory=list)  # per problem: token ids, text, exit layers, spec steps
    max_disagreement: float | None = None  # specee: calibrated thresholds for this tolerance

    @property
    def name(self) -> str:
        if self.max_disagreement is not None:
            return f"{self.kind}@eps{self.max_disagreement:g}"
        return self.kind if self.threshold is None else f"{self.kind}@{self.threshold:g}"


def build_modes(cfg: EvalConfig, engine: SpecEEEngine) -> list[Mode]:
    tree = {"proposer": "draft", "depth": cfg.tree_depth, "width": cfg.tree_width, "nodes": cfg.tree_nodes,
            "lookup": "merge"}
    modes = []
    for kind in cfg.kinds:
        if kind in PER_THRESHOLD and engine.early_exit is None:
            raise ValueError(f"{cfg.model} has no predictors: drop {kind} from --modes")
        if kind in ("spec_tree", "spec_t3") and engine.draft is None:
            raise ValueError(f"{cfg.model} has no draft head: drop {kind} from --modes")
        if kind in PER_THRESHOLD:
            verify = "full" if kind == "specee_full" else "local"
            for th in cfg.threshold_list:
                spec = {**tree, "t3": True} if kind == "spec_t3" else None
                modes.append(Mode(kind, th, engine.with_options(threshold=th, verify=verify, gate=cfg.gate), spec))
            if kind == "specee":
                for eps in cfg.tolerance_list:
                    modes.append(Mode(kind, None, engine.with_options(max_disagreement=eps, confidence=cfg.confidence,
                                                                      gate=cfg.gate),
                                      max_disagreement=eps))
        elif kind in LOW_BIT_KINDS:
            modes.append(Mode(kind, None, SpecEEEngine.from_pretrained(cfg.model, weights=LOW_BIT_KINDS[kind])))
        else:
            modes.append(Mode(kind, None, engine, tree if kind == "spec_tree" else {} if kind == "spec" else None))
    return modes


class HFRunner:
    """transformers' generate in the engine's dtype, greedy, stopped by the same stop strings."""

    def __init__(self, cfg: EvalConfig, engine: SpecEEEngine):
        from transformers import AutoModelForCausalLM

        self.tok = engine.tokenizer
        self.model = AutoModelForCausalLM.from_pretrained(str(cfg.model), dtype=engine.model.dtype,
                                                          local_files_only=True).eval()

    @torch.inference_mode()
    def __call__(self, prompts: list[str], max_new: int, stop: list[str]) -> list[dict]:
        tok = self.tok
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = self.model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=pad, top_p=None,
                                  top_k=None, temperature=None, stop_strings=stop, tokenizer=tok)
        rows = []
        for seq in out[:, enc["input_ids"].shape[1]:].tolist():
            if tok.eos_token_id in seq:
                seq = seq[: seq.index(tok.eos_token_id) + 1]
            text = tok.decode(seq, skip_special_tokens=True)
            for s in stop:
                if s in text:
                    text = text[: text.index(s)]
            rows.append({"token_ids": seq, "text": text, "exit_layers": None, "spec_steps": None})
        return rows


def run_mode(mode: Mode, hf: HFRunner | None, prompts: list[str], cfg: EvalConfig, stop: list[str]) -> list[dict]:
    if mode.kind == "hf":
        return hf(prompts, cfg.max_new_tokens, stop)
    kind = "spec" if mode.spec is not None else "specee" if mode.kind in PER_THRESHOLD else "dense"
    res = mode.engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, stop=stop, mode=kind,
                               **({"spec": mode.spec} if mode.spec is not None else {}))
    return [{"token_ids": r.token_ids, "text": r.text, "exit_layers": r.exit_layers,
             "spec_steps": r.stats.get("spec_steps")} for r in res]


def generate_all(cfg: EvalConfig, modes: list[Mode], hf, prompts: list[str], stop: list[str]) -> None:
    """Every mode over every prompt, batch by batch with the modes interleaved (rotating order)."""
    from tqdm import tqdm

    chunks = [prompts[i : i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    for m in modes:  # warm-up, untimed
        run_mode(m, hf, chunks[0][:1], EvalConfig(**{**vars(cfg), "max_new_tokens": 4}), stop)
    bar = tqdm(total=len(chunks) * len(modes), desc="generate", unit="batch")
    for c, chunk in enumerate(chunks):
        order = modes[c % len(modes):] + modes[: c % len(modes)]
        for m in order:
            t = time.perf_counter()
            m.results += run_mode(m, hf, chunk, cfg, stop)
            m.seconds += time.perf_counter() - t
            bar.set_postfix_str(m.name)
            bar.update(1)
    bar.close()


def reference_nll(cfg: EvalConfig, engine: SpecEEEngine, modes: list[Mode], problems) -> dict:
    """Perplexity of each problem's canonical solution after its prompt (plain text), through dense
    and each early-exit mode's decode path."""
    tok = engine.tokenizer
    contexts, targets = [], []
    for p in problems:
        ctx = tok(p.prompt)["input_ids"]
        full = tok(p.prompt + p.canonical_solution)["input_ids"]
        tgt = full[len(ctx):] if full[: len(ctx)] == ctx else tok(p.canonical_solution, add_special_tokens=False)["input_ids"]
        if len(tgt) >= 2:
            contexts.append(ctx)
            targets.append(tgt)
    params = SamplingParams(max_new_tokens=max(len(t) for t in targets), ignore_eos=True)
    out = {}
    runs = [("dense", engine, DenseStepper)]
    runs += [(m.name, m.engine, m.engine.early_exit.new_stepper) for m in modes if m.kind in ("specee", "specee_full")]
    for name, eng, inner in runs:
        probe = Forcing(targets, engine.model)
        probe.register(contexts)
        t = time.perf_counter()
        batch = max(cfg.batch_size, 8)
        for i in range(0, len(contexts), batch):
            eng.run(contexts[i : i + batch], params, probe.factory(inner))
        out[name] = {"perplexity": probe.perplexity, "next_token_accuracy": probe.accuracy, "tokens": probe.tokens,
                     "layer_fraction": probe.layers / max(probe.tokens, 1) / engine.config.num_hidden_layers,
                     "seconds": time.perf_counter() - t}
        log.info("perplexity %s: %.3f", name, probe.perplexity)
    return {"text": "HumanEval canonical solutions after their prompts", "problems": len(contexts), "modes": out}


def summarize(mode: Mode, dense: Mode | None, passed: dict[str, list[bool]], num_layers: int) -> dict:
    res = mode.results
    tokens = sum(len(r["token_ids"]) for r in res)
    row = {"mode": mode.kind, "threshold": mode.threshold, "max_disagreement": mode.max_disagreement,
           "pass_at_1": metrics.pass_at_1(passed[mode.name]),
           "passed": sum(passed[mode.name]), "tokens": tokens, "seconds": mode.seconds,
           "tokens_per_s": metrics.speed(tokens, mode.seconds)}
    layers = [l for r in res if r["exit_layers"] for l in r["exit_layers"][1:]]
    if layers:
        row["layer_fraction"] = sum(layers) / len(layers) / num_layers
    steps = [r["spec_steps"] for r in res if r["spec_steps"] is not None]
    if steps:
        row["tokens_per_step"] = sum(len(r["token_ids"]) - 1 for r in res) / max(sum(steps), 1)
    if dense is not None:
        row["speedup_vs_dense"] = row["tokens_per_s"] / max(metrics.speed(
            sum(len(r["token_ids"]) for r in dense.results), dense.seconds), 1e-9)
        row["agreement"] = metrics.agreement([r["token_ids"] for r in dense.results], [r["token_ids"] for r in res])
        row["agreement"]["same_outcome"] = metrics.outcome_agreement(passed[dense.name], passed[mode.name])
    return row


def plot_pareto(result: dict, path: Path) -> None:
    """Speed-up over dense against pass@1 and against agreement with dense, a point per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    style = {"hf": ("k", "s"), "dense": ("tab:blue", "D"), "spec": ("tab:green", "o"), "spec_tree": ("tab:olive", "o"),
             "specee": ("tab:orange", "^"), "specee_full": ("tab:red", "v"), "spec_t3": ("tab:purple", "P")}
    for ax, key, label in ((axes[0], "pass_at_1", "HumanEval pass@1 (greedy)"),
                           (axes[1], "prefix_agreement", "share of dense's tokens before the first divergence")):
        for kind in style:
            pts = [r for r in rows if r["mode"] == kind and "speedup_vs_dense" in r]
            if not pts:
                continue
            y = [r[key] if key in r else r["agreement"][key] for r in pts]
            color, marker = style[kind]
            ax.plot([r["speedup_vs_dense"] for r in pts], y, marker=marker, color=color, label=kind,
                    linestyle="-" if len(pts) > 1 else "none")
            for r, yy in zip(pts, y):
                label = point_label(r)
                if label:
                    ax.annotate(label, (r["speedup_vs_dense"], yy), fontsize=7, textcoords="offset points",
                                xytext=(3, 3))
        ax.axvline(1.0, color="tab:blue", lw=0.6, ls=":")
        ax.set_ylim(0, 1.02 if key == "prefix_agreement" else max(r["pass_at_1"] for r in rows) * 1.3 + 0.01)
        ax.set_xlabel("speed-up over dense (tokens/s, same run)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"{Path(c['model']).name}, {c['dtype']}, batch {c['batch_size']}, {result['problems']} problems "
                 f"(commit {result['git_commit']}); labels: raw exit threshold, or eps = calibrated tolerance",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def point_label(r: dict) -> str:
    """A point's label: its calibrated tolerance (eps), else its raw threshold, else nothing."""
    if r.get("max_disagreement") is not None:
        return f"eps {r['max_disagreement']:g}"
    return "" if r["threshold"] is None else f"{r['threshold']:g}"


def markdown(result: dict) -> str:
    """The results as a Markdown table (the README's)."""
    lines = ["| mode | pass@1 | tokens/s | vs dense | identical to dense | first divergence (median) "
             "| same pass/fail | layers run | tokens/step | perplexity |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ppl = result.get("perplexity", {}).get("modes", {})
    for r in result["modes"]:
        label = point_label(r)
        name = f"{r['mode']} @ {label}" if label else r["mode"]
        a = r.get("agreement", {})
        key = "dense" if r["mode"] in ("dense", "spec", "spec_tree") else name.replace(" @ ", "@").replace("eps ", "eps")
        p = ppl.get(key, {}).get("perplexity")
        lines.append("| " + " | ".join([
            name, f"{r['pass_at_1']:.3f} ({r['passed']})", f"{r['tokens_per_s']:.1f}",
            f"{r['speedup_vs_dense']:.2f}x" if "speedup_vs_dense" in r else "",
            f"{a['identical']:.2f}" if a else "", f"{a['first_divergence_median']:g}" if a else "",
            f"{a['same_outcome']:.2f}" if a else "",
            f"{r['layer_fraction']:.2f}" if "layer_fraction" in r else "",
            f"{r['tokens_per_step']:.2f}" if "tokens_per_step" in r else "",
            f"{p:.3f}" if p is not None and r["mode"] != "hf" else ""]) + " |")
    return "\n".join(lines)


def run(cfg: EvalConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    layers = check_layers(allow_weak=cfg.allow_weak_sandbox)  # at the start, not after hours of generation
    commit = git_commit()  # of the code that runs (taken before a long run, not after)
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, weights=cfg.weights)
    chat = engine.has_chat_template if cfg.chat == "auto" else cfg.chat == "true"
    problems = humaneval.load_problems(cfg.limit or None)
    if cfg.tasks:
        wanted = [t for t in cfg.tasks.split(",") if t]
        unknown = sorted(set(wanted) - {p.task_id for p in problems})
        if unknown:
            raise ValueError(f"--tasks: no such problems {unknown} (HumanEval/0 .. HumanEval/163, within --limit)")
        problems = [p for p in problems if p.task_id in set(wanted)]
    prompts = [humaneval.engine_prompt(p, engine.chat_prompt if chat else None) for p in problems]
    stop = humaneval.stop_strings(chat)
    modes = build_modes(cfg, engine)
    hf = HFRunner(cfg, engine) if "hf" in cfg.kinds else None
    t0 = time.perf_counter()
    generate_all(cfg, modes, hf, prompts, stop)
    gen_s = time.perf_counter() - t0

    programs = {m.name: [humaneval.program(p, humaneval.extract_code(r["text"], chat)) for p, r in zip(problems, m.results)]
                for m in modes}
    flat = [code for m in modes for code in programs[m.name]]
    limits = Limits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)
    t0 = time.perf_counter()
    outcomes = run_many(flat, limits, workers=cfg.workers, progress=True, allow_weak=cfg.allow_weak_sandbox)
    exec_s = time.perf_counter() - t0
    by_mode, i = {}, 0
    for m in modes:
        by_mode[m.name] = outcomes[i : i + len(problems)]
        i += len(problems)
    passed = {name: [o.passed for o in outs] for name, outs in by_mode.items()}

    dense = next((m for m in modes if m.kind == "dense"), None)
    result: dict = {
        "config": {k: str(v) for k, v in vars(cfg).items()}, "git_commit": commit, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": str(engine.device),
        "dtype": str(engine.model.dtype), **engine.weights_info(), "num_layers": engine.config.num_hidden_layers, "chat": chat,
        "problems": len(problems), "sandbox": {"limits": vars(limits), "guards": outcomes[0].guards if outcomes else {},
                                               "missing_layers": layers.missing,
                                               "programs_run": len(set(flat)), "seconds": exec_s},
        "generation_seconds": gen_s,
        "modes": [summarize(m, dense, passed, engine.config.num_hidden_layers) for m in modes],
    }
    if cfg.perplexity and (dense is not None or any(m.kind in ("specee", "specee_full") for m in modes)):
        result["perplexity"] = reference_nll(cfg, engine, modes, problems)
    result["per_problem"] = {m.name: [{"task_id": p.task_id, "status": o.status, "detail": o.detail[:120],
                                       "tokens": len(r["token_ids"]), "code": humaneval.extract_code(r["text"], chat)}
                                      for p, o, r in zip(problems, by_mode[m.name], m.results)] for m in modes}
    text = json.dumps(result, indent=1)
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(text)
    if cfg.plot:
        Path(cfg.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_pareto(result, Path(cfg.plot))
    print(markdown(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(EvalConfig, __doc__, argv)
    if cfg.replot:
        result = json.loads(Path(cfg.replot).read_text())
        if cfg.plot:
            plot_pareto(result, Path(cfg.plot))
        print(markdown(result))
        return
    run(cfg)


if __name__ == "__main__":
    main()
