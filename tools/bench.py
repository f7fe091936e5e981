"""Benchmark: decode tokens/s of transformers' generate, the dense engine and SpecEE, side by
side in one run (interleaved A-B-C-C-B-A so drift hits every variant alike), plus SpecEE's
quality against dense greedy decoding. Prints one JSON document.

    python -m tools.bench                                             # SmolLM2, dtype auto: every variant
    python -m tools.bench --modes hf,dense,auto,spec_lookup_first --batch-sizes 1,8,16 --thresholds "" \
        --dtypes float32,bfloat16                                    # the defaults against fixed settings
    python -m tools.bench --modes hf,dense --batch-sizes 1,8          # the engine-core comparison
    python -m tools.bench --weights q4 --modes llamacpp,hf,dense,auto --dtypes bfloat16,float32,q4,q4/bfloat16 --thresholds ""
                                                                     # low-bit weights against llama.cpp
    python -m tools.bench --dtype float32 --modes hf,dense            # fp32, where dense equals transformers
    python -m tools.bench --model models/specee-tiny --prompts-file "" --chat false

Variants: hf (transformers generate in the same dtype), hf_lookup (transformers prompt lookup
decoding, prompt_lookup_num_tokens=10), and this engine's dense, auto (the default: lossless, each step
dense or drafted as the plan measured on this machine expects to pay), specee (early exit, T1+T2) and
speculative decoding: spec_chain (draft head, a chain), spec_chain_lookup (the chain plus the
prompt-lookup chain), spec_lookup_first (the lookup chain where lookup finds one, else the draft
head's chain), spec_tree (draft head, EAGLE-2 tree),
spec_tree_lookup (the tree plus the prompt-lookup chain), spec_t3 (that, with T3 exits inside
verification), spec_lookup (prompt lookup alone); the spec variants also report tokens per verify
step, layers run and agreement with dense. The JSON also holds the
memory-bandwidth limit (weight bytes per token in the format in use / measured read rate) and each
variant's share. llamacpp: llama.cpp itself on the GGUF file (optional: llama-cpp-python, see the README),
batch 1, the same prompt tokens.

Decode tokens/s = B x (N - 1) / (time(generate N tokens) - time(generate 1 token)), the same
for every variant, greedy, EOS ignored so every row makes N tokens.
"""
from __future__ import annotations

import json
import logging
import platform
import statistics
from collections import Counter
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from jobs.cli import git_commit, parse_config
from jobs.build_corpus import sample_snippets
from specee_core import SpecEEEngine
from specee_core.machine import machine_facts
from specee_core.step.sampling import SamplingParams
from specee_eval import metrics
from specee_eval.forced import Forcing

log = logging.getLogger(__name__)


VARIANTS = ("hf", "hf_lookup", "llamacpp", "dense", "auto", "specee", "spec_chain", "spec_chain_lookup", "spec_lookup_first", "spec_tree",
            "spec_tree_lookup", "spec_t3", "spec_lookup")
SPEC_VARIANTS = tuple(v for v in VARIANTS if v.startswith("spec_"))


@dataclass
class BenchConfig:
    model: Path = Path("models/smollm2-135m-instruct")
    corpus: Path = Path("data/corpus")  # held-out snippets when there is no prompts file; teacher-forced accuracy
    prompts_file: str = "prompts/instructions_heldout.jsonl"  # JSONL with a "prompt" field; "": corpus snippets
    chat: str = "auto"  # prompts through the chat template: "auto" (when the model has one) | "true" | "false"
    dtype: str = "auto"  # of the engine and of transformers; auto: bf16 where the hardware computes it natively
    weights: str = "auto"  # the engine's weight format: auto | fp32 | bf16 | q8 | q4 (specee_core.model.quant)
    gguf: str = ""  # the llamacpp variant's file; "": the GGUF the model was converted from (the shipped one)
    modes: str = "hf,hf_lookup,dense,auto,specee,spec_chain,spec_lookup_first,spec_tree,spec_tree_lookup,spec_t3,spec_lookup"
    dtypes: str = ""  # e.g. float32,bfloat16,q8,q4,q4/bfloat16 (q4 weights, bf16 activations): also time dense in
    #                   each (interleaved) at batch_sizes, against the main engine's
    spec_depth: int = 4  # chain length of spec_chain and spec_lookup
    tree_depth: int = 5  # the draft tree of spec_tree, spec_tree_lookup and spec_t3: levels,
    tree_width: int = 4  # nodes expanded per level (children per node)
    tree_nodes: int = 12  # and drafted nodes kept
    batch_sizes: str = "1,8"
    num_prompts: int = 16
    max_new_tokens: int = 128
    repeats: int = 2
    thresholds: str = "0.3,0.5,0.7,0.9"
    quality_prompts: int = 32
    heldout_windows: int = 16
    window_len: int = 128
    threads: int = 0
    speculator: str = "auto"  # early-exit options of the SpecEE variant
    verify: str = "local"
    threshold: float = 0.9  # raw, uncalibrated
    max_disagreement: float | None = None  # the SpecEE variant with thresholds calibrated to this tolerance
    out: Path | None = None  # also write the JSON here
    plot: Path | None = None  # PNG of the speed / agreement curve over thresholds
    speed_plot: Path | None = None  # PNG of decode tokens/s per variant and batch size

    def __post_init__(self) -> None:
        self.model, self.corpus = Path(self.model), Path(self.corpus)
        bad = set(self.mode_list) - set(VARIANTS)
        if bad:
            raise ValueError(f"unknown modes {sorted(bad)}: expected some of {', '.join(VARIANTS)}")
        if self.chat not in ("auto", "true", "false"):
            raise ValueError(f"chat must be auto, true or false, got {self.chat!r}")

    @property
    def mode_list(self) -> list[str]:
        return [m for m in self.modes.split(",") if m]


def load_llamacpp(cfg: BenchConfig):
    """llama_cpp.Llama on cfg.gguf (or the shipped GGUF) with this process's thread count. llama-cpp-python
    is optional and never part of the set-up (README: how to build it, about 10 minutes)."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ValueError("the llamacpp variant needs llama-cpp-python (see the README's 'llama.cpp as a peer')") from e
    from specee_core.model.gguf import default_gguf_path

    path = Path(cfg.gguf) if cfg.gguf else default_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF for the llamacpp variant not found: {path}")
    return Llama(model_path=str(path), n_ctx=2048, n_threads=torch.get_num_threads(), n_batch=512, verbose=False)


def load_prompts(cfg: BenchConfig, n: int, engine: SpecEEEngine, offset: int = 0) -> list[str]:
    """n prompts from the prompts file (from row `offset` on; through the chat template when asked),
    else held-out corpus snippets."""
    if cfg.prompts_file:
        with open(cfg.prompts_file) as f:
            rows = [json.loads(line)["prompt"] for line in f][offset : offset + n]
        chat = engine.has_chat_template if cfg.chat == "auto" else cfg.chat == "true"
        return [engine.chat_prompt([{"role": "user", "content": r}]) for r in rows] if chat else rows
    return sample_snippets(cfg.corpus / "heldout.jsonl", n, seed=offset)


class Runner:
    """One callable per variant: run(prompts, max_new_tokens) -> token lists."""

    def __init__(self, engine: SpecEEEngine, hf_model=None, cfg: BenchConfig | None = None):
        self.engine, self.hf = engine, hf_model
        c = self.cfg = cfg or BenchConfig()
        self._llama = None
        tree = {"proposer": "draft", "depth": c.tree_depth, "width": c.tree_width, "nodes": c.tree_nodes, "lookup": "off"}
        chain = {"proposer": "draft", "depth": c.spec_depth, "width": 1, "lookup": "off"}
        self.spec = {"spec_chain": chain, "spec_chain_lookup": {**chain, "lookup": "merge"},
                     "spec_lookup_first": {**chain, "lookup": "first"},
                     "spec_tree": tree, "spec_tree_lookup": {**tree, "lookup": "merge"},
                     "spec_t3": {**tree, "lookup": "merge", "t3": True},
                     "spec_lookup": {"proposer": "lookup", "depth": c.spec_depth}}

    def ours(self, variant: str, prompts: list[str], n: int, **kw):
        if variant in self.spec:
            kw["spec"] = self.spec[variant]
            variant = "spec"
        return self.engine.generate(prompts, max_new_tokens=n, mode=variant, ignore_eos=True, **kw)

    @torch.inference_mode()
    def transformers(self, prompts: list[str], n: int, lookup: bool = False):
        tok = self.engine.tokenizer
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
        out = self.hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad,
                               top_p=None, top_k=None, temperature=None, **extra)
        return out[:, enc["input_ids"].shape[1]:].tolist()

    def llamacpp(self, prompts: list[str], n: int):
        """llama.cpp (llama-cpp-python) on the GGUF file itself, greedy, batch 1, the engine's prompt tokens."""
        if len(prompts) > 1:
            return None  # llama-cpp-python's generate runs one sequence
        if self._llama is None:
            self._llama = load_llamacpp(self.cfg)
        llm = self._llama
        llm.reset()  # no prefix reuse between calls: every call prefills, as ours do
        out = []
        for tok in llm.generate(self.engine.encode_prompt(prompts[0]), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(tok)
            if len(out) >= n:
                break
        return [out]

    def call(self, variant: str, prompts: list[str], n: int):
        if variant == "llamacpp":
            return self.llamacpp(prompts, n)
        if variant.startswith("hf"):
            if variant == "hf_lookup" and len(prompts) > 1:
                return None  # transformers' prompt lookup runs batch 1 only
            return self.transformers(prompts, n, lookup=variant == "hf_lookup")
        return self.ours(variant, prompts, n)


def time_decode(runner: Runner, variants: list[str], prompts: list[str], batch: int, n: int, repeats: int) -> dict:
    """Decode tokens/s per variant over len(prompts) prompts in batches of `batch`."""
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    variants = [v for v in variants if runner.call(v, chunks[0], 2) is not None]  # warm-up; drops what cannot run
    samples: dict[str, list[float]] = {v: [] for v in variants}
    order = []
    for r in range(repeats):
        order += variants if r % 2 == 0 else variants[::-1]
    for v in order:
        full = first = 0.0  # (tokens/s of a variant: decode tokens over the time past the first token)
        for c in chunks:
            t = time.perf_counter()
            runner.call(v, c, 1)
            first += time.perf_counter() - t
            t = time.perf_counter()
            runner.call(v, c, n)
            full += time.perf_counter() - t
        samples[v].append(len(prompts) * (n - 1) / max(full - first, 1e-9))
    return {v: {"decode_tokens_per_s": statistics.mean(s), "median_tokens_per_s": statistics.median(s),
                "runs": [round(x, 1) for x in s]} for v, s in samples.items()}


def time_dtypes(cfg: BenchConfig, prompts: list[str], auto_engine: SpecEEEngine) -> dict:
    """Dense decode tokens/s in each of cfg.dtypes at each batch size, the engines interleaved round by
    round, and how the dtype auto picked compares with the fastest."""
    names = [d for d in cfg.dtypes.split(",") if d]
    fmt, act = auto_engine.model.weight_format, str(auto_engine.model.dtype).removeprefix("torch.")
    picked = (fmt if act == "float32" else f"{fmt}/{act}") if fmt in ("q4", "q8") else act

    def load(name: str) -> SpecEEEngine:  # a dtype, a low-bit format (fp32 activations), or format/dtype
        fmt, _, act = name.partition("/")
        kw = {"weights": fmt, **({"dtype": act} if act else {})} if fmt in ("q4", "q8") else {"dtype": name}
        return SpecEEEngine.from_pretrained(cfg.model, **kw)

    runners = {d: Runner(auto_engine if d == picked else load(d), None, cfg) for d in names}
    out = {"auto_picked": picked, "weight_mb": {d: r.engine.weights_info()["weight_mb"] for d, r in runners.items()}}
    for bs in [int(b) for b in cfg.batch_sizes.split(",")]:
        chunks = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
        samples: dict[str, list[float]] = {d: [] for d in names}
        for r in runners.values():
            r.call("dense", chunks[0], 2)  # warm-up
        for rnd in range(cfg.repeats):
            for d in (names if rnd % 2 == 0 else names[::-1]):
                full = first = 0.0
                for c in chunks:
                    t = time.perf_counter()
                    runners[d].call("dense", c, 1)
                    first += time.perf_counter() - t
                    t = time.perf_counter()
                    runners[d].call("dense", c, cfg.max_new_tokens)
                    full += time.perf_counter() - t
                samples[d].append(len(prompts) * (cfg.max_new_tokens - 1) / max(full - first, 1e-9))
        speed = {d: statistics.mean(s) for d, s in samples.items()}
        best = max(speed, key=speed.get)
        out[f"batch_{bs}"] = {"dense_tokens_per_s": {d: round(v, 1) for d, v in speed.items()},
                              "runs": {d: [round(x, 1) for x in s] for d, s in samples.items()}, "fastest": best,
                              "auto_vs_fastest": round(speed[picked] / speed[best], 3) if picked in speed else None}
    return out


def spec_quality(runner: Runner, variant: str, prompts: list[str], batch: int, n: int) -> dict:
    """Tokens per verify step, draft / verify time shares and agreement with dense, one pass."""
    res, dense = [], []
    for i in range(0, len(prompts), batch):
        res += runner.ours(variant, prompts[i : i + batch], n)
        dense += runner.ours("dense", prompts[i : i + batch], n)
    steps = sum(r.stats.get("spec_steps", len(r.token_ids) - 1) for r in res)  # auto may run a dense stepper
    layers = [l for r in res for l in r.exit_layers[1:]]
    plan = {}
    if variant == "auto":  # one planner per engine batch: its counts are on every row, take the first's
        plan["plan_steps"] = dict(sum((Counter(res[i].stats.get("plan_steps", {})) for i in range(0, len(res), batch)),
                                      Counter()))
    return {"tokens_per_step": sum(len(r.token_ids) - 1 for r in res) / max(steps, 1), **plan,
            "draft_time_share": statistics.mean(r.stats.get("draft_time_share", 0.0) for r in res),
            "layer_fraction": sum(layers) / max(len(layers), 1) / runner.engine.config.num_hidden_layers,
            **agreement([r.token_ids for r in dense], [r.token_ids for r in res])}


def copy_bandwidth_gb_s(mb: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth as a large tensor copy sees it: bytes read and written / time, best of repeats.
    A decode step only reads weights; the batch-1 limit below takes the copy's read rate (half of this)."""
    src = torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e9


def read_bandwidth_gb_s(mb: int = 512, repeats: int = 5) -> float:
    """Memory read rate: bytes of a large fp32 tensor / time of its sum (all threads), best of repeats."""
    src = torch.empty((mb << 20) // 4, dtype=torch.float32).fill_(1)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9


def weight_bytes_per_token(engine: SpecEEEngine) -> int:
    """Bytes a batch-1 decode step must read: every decoder layer's weights and the LM head, in their format."""
    from specee_core.model.model import ModelWeights
    from specee_core.model.quant import weight_bytes

    w = engine.model.w
    return weight_bytes(ModelWeights(embed=w.lm_head, layers=w.layers, norm=w.norm, lm_head=w.lm_head))


def speedup(speed: dict, variant: str, base: str) -> dict:
    """variant over base: ratio of the means, and the median of the per-round ratios (round r of
    every variant ran back to back, so a slow spell of this shared machine hits both alike)."""
    a, b = speed[variant]["runs"], speed[base]["runs"]
    return {f"vs_{base}": speed[variant]["decode_tokens_per_s"] / speed[base]["decode_tokens_per_s"],
            f"vs_{base}_median_of_rounds": statistics.median(x / y for x, y in zip(a, b))}


def agreement(dense: list[list[int]], other: list[list[int]]) -> dict:
    a = metrics.agreement(dense, other)
    return {"token_agreement": a["token_agreement"], "sequence_agreement": a["identical"]}


def heldout_accuracy(engine: SpecEEEngine, cfg: BenchConfig, threshold: float) -> dict:
    """Teacher-forced greedy next-token accuracy over held-out windows through the SpecEE step
    (threshold > 1: exits off, i.e. dense)."""
    from jobs.build_corpus import fixed_windows, tokenize_split

    # the token cache is per model: another tokenizer's ids would index past this vocabulary
    stream = tokenize_split(cfg.corpus, "heldout", engine.tokenizer, Path("runs/bench_tokens") / cfg.model.name)
    windows = fixed_windows(stream, cfg.heldout_windows, cfg.window_len * 2).tolist()
    half = cfg.window_len
    prompts = [w[:half] for w in windows]
    targets = [w[half : half + cfg.window_len] for w in windows]
    ee = engine.early_exit.with_options(threshold=threshold)
    probe = Forcing(targets)
    probe.register(prompts)
    engine.run(prompts, SamplingParams(max_new_tokens=cfg.window_len, ignore_eos=True), probe.factory(ee.new_stepper))
    return {"next_token_accuracy": probe.accuracy, "tokens": probe.tokens,
            "layer_fraction": probe.layers / max(probe.tokens, 1) / engine.config.num_hidden_layers}


def quality(engine: SpecEEEngine, cfg: BenchConfig, thresholds: list[float]) -> dict:
    prompts = load_prompts(cfg, cfg.quality_prompts, engine, offset=cfg.num_prompts)
    dense = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, ignore_eos=True, mode="dense")
    d_ids = [r.token_ids for r in dense]
    out = {}
    for th in thresholds:
        t = time.perf_counter()
        res = engine.with_options(threshold=th).generate(prompts, max_new_tokens=cfg.max_new_tokens, mode="specee", ignore_eos=True)
        dt = time.perf_counter() - t
        layers = [l for r in res for l in r.exit_layers[1:]]
        calls = sum(r.stats["predictor_calls"] for r in res)
        out[str(th)] = {"layer_fraction": sum(layers) / len(layers) / engine.config.num_hidden_layers,
                        "predictor_calls_per_token": calls / len(layers), **agreement(d_ids, [r.token_ids for r in res]),
                        "draft_time_share": statistics.mean(r.stats["draft_time_share"] for r in res),
                        "predictor_time_share": statistics.mean(r.stats["predictor_time_share"] for r in res),
                        "batch_tokens_per_s": len(layers) / dt}
    return out


def plot_curve(quality: dict, num_layers: int, path: Path) -> None:
    """Layers run, token agreement and batch tokens/s against the exit threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ths = sorted(quality, key=float)
    x = [float(t) for t in ths]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(x, [quality[t]["layer_fraction"] for t in ths], "o-", label="layers run (share of all)")
    ax.plot(x, [quality[t]["token_agreement"] for t in ths], "s-", label="token agreement with dense")
    ax.plot(x, [quality[t]["sequence_agreement"] for t in ths], "^-", label="whole sequences identical")
    ax.set_xlabel("exit threshold")
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    ax2.plot(x, [quality[t]["batch_tokens_per_s"] for t in ths], "k--", label="tokens/s (batch)")
    ax2.set_ylabel("tokens/s")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [l.get_label() for l in lines], loc="lower right", fontsize=8)
    ax.set_title(f"SpecEE on {num_layers} layers: the threshold trade-off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speed(result: dict, path: Path) -> None:
    """Decode tokens/s per variant, one group of bars per batch size; spec variants are labelled with
    their tokens per verify step and agreement with dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(result["speed"])
    variants = [v for v in VARIANTS if any(v in result["speed"][b] for b in batches)]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        speed = result["speed"][b]
        xs = [j + i * width for j, v in enumerate(variants) if v in speed]
        ys = [speed[v]["decode_tokens_per_s"] for v in variants if v in speed]
        bars = ax.bar(xs, ys, width, label=b.replace("_", " "))
        for bar, v in zip(bars, [v for v in variants if v in speed]):
            s = speed[v]
            note = f"{s['tokens_per_step']:.1f}/step" if "tokens_per_step" in s else ""
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6)
    if "dense" in result["speed"][batches[0]]:
        ax.axhline(result["speed"][batches[0]]["dense"]["decode_tokens_per_s"], color="grey", lw=0.6, ls=":")
    ax.set_xticks([j + width * (len(batches) - 1) / 2 for j in range(len(variants))])
    ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{Path(result['config']['model']).name} {result['dtype']}, {result['threads']} threads, CPU "
                 f"{result.get('cpu_capability', '?')} (native bf16: {result.get('native_bf16', '?')}), "
                 f"commit {result['git_commit']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    has_predictors = (cfg.model / "predictors.safetensors").is_file()
    ee_opts = dict(speculator=cfg.speculator, verify=cfg.verify, threshold=cfg.threshold,
                   max_disagreement=cfg.max_disagreement)
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, weights=cfg.weights,
                                          max_batch_size=max(int(b) for b in cfg.batch_sizes.split(",")),
                                          **(ee_opts if has_predictors else {}))
    modes = cfg.mode_list
    if "specee" in modes and engine.early_exit is None:
        raise ValueError(f"{cfg.model} has no predictors: drop 'specee' from --modes or train them")
    hf = None
    if any(m.startswith("hf") for m in modes):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(cfg.model), dtype=engine.model.dtype,
                                                  local_files_only=True).eval()
    needs_head = [m for m in modes if m.startswith("spec_") and m != "spec_lookup"]
    if needs_head and engine.draft is None:
        raise ValueError(f"{cfg.model} has no draft head: drop {needs_head} from --modes (spec_lookup needs none)")
    if "spec_t3" in modes and engine.early_exit is None:
        raise ValueError(f"{cfg.model} has no predictors: drop 'spec_t3' from --modes")
    runner = Runner(engine, hf, cfg)
    prompts = load_prompts(cfg, cfg.num_prompts, engine)
    bandwidth, read = copy_bandwidth_gb_s(), read_bandwidth_gb_s()
    per_token = weight_bytes_per_token(engine)
    if "auto" in modes:  # measured (or read from the cache) before any timing
        engine.prepare_plan([int(b) for b in cfg.batch_sizes.split(",")])
    result: dict = {"config": {k: str(v) for k, v in vars(cfg).items()}, "git_commit": git_commit(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
                    **machine_facts(engine.device), "dtype": str(engine.model.dtype).removeprefix("torch."),
                    "dtype_reason": engine.dtype_reason, **engine.weights_info(),
                    "num_layers": engine.config.num_hidden_layers,
                    "bandwidth": {"copy_gb_s": bandwidth, "read_gb_s": read, "weight_mb_per_token": per_token / 1e6,
                                  "batch_1_limit_tokens_per_s": read * 1e9 / per_token},
                    "prompt_tokens": [len(engine.encode_prompt(p)) for p in prompts], "speed": {}}
    if engine.early_exit is not None:
        o = engine.early_exit.options
        result["specee_options"] = {"threshold": o.threshold, "max_disagreement": o.max_disagreement,
                                    "exit_thresholds": engine.early_exit.thresholds, "verify": o.verify,
                                    "speculator": engine.early_exit.source,
                                    "offline_layers": engine.early_exit.schedule.offline_layers}
    for bs in [int(b) for b in cfg.batch_sizes.split(",")]:
        speed = time_decode(runner, modes, prompts, bs, cfg.max_new_tokens, cfg.repeats)
        for v in speed:
            if v != "hf" and "hf" in speed:
                speed[v].update(speedup(speed, v, "hf"))
            if bs == 1:
                speed[v]["share_of_bandwidth_limit"] = (speed[v]["decode_tokens_per_s"]
                                                        / result["bandwidth"]["batch_1_limit_tokens_per_s"])
        for v in ("specee", "auto") + SPEC_VARIANTS:
            if v in speed and "dense" in speed:
                speed[v].update(speedup(speed, v, "dense"))
                if v in SPEC_VARIANTS + ("auto",):
                    speed[v].update(spec_quality(runner, v, prompts, bs, cfg.max_new_tokens))
                    speed[v]["options"] = runner.spec.get(v, "the plan's")
        result["speed"][f"batch_{bs}"] = speed
        log.info("batch %d: %s", bs, json.dumps(speed))
    if "auto" in modes:
        result["plan"] = engine.spec_plan().to_json([int(b) for b in cfg.batch_sizes.split(",")])
    if cfg.dtypes:
        result["dtypes"] = time_dtypes(cfg, prompts, engine)
    if "specee" in modes:
        ths = [float(t) for t in cfg.thresholds.split(",") if t]
        if ths and cfg.quality_prompts:
            result["quality"] = quality(engine, cfg, ths)
        if cfg.heldout_windows and (cfg.corpus / "heldout.jsonl").is_file():
            result["heldout"] = {"dense": heldout_accuracy(engine, cfg, 2.0),
                                 "specee": heldout_accuracy(engine, cfg, engine.early_exit.options.threshold)}
    if cfg.plot and "quality" in result:
        plot_curve(result["quality"], engine.config.num_hidden_layers, Path(cfg.plot))
    if cfg.speed_plot:
        plot_speed(result, Path(cfg.speed_plot))
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if cfg.out:
        Path(cfg.out).write_text(text)
    return result


def main(argv: list[str] | None = None) -> None:
    run(parse_config(BenchConfig, __doc__, argv))


if __name__ == "__main__":
    main()
