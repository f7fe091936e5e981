"""Train the per-layer exit predictors from full-depth decoding over training prompts.

    python -m jobs.train_predictors --model models/specee-tiny                 # corpus snippets
    python -m jobs.train_predictors --model models/smollm2-135m-instruct --weights q4 \
        --prompts prompts/instructions_train.jsonl --exclude-first 672 --num-prompts 750 --calib-prompts 250

Decodes --num-prompts training prompts (corpus snippets, or with --prompts instruction rows
rendered with the chat template when the tokenizer has one) greedily at full depth with the
speculator's candidates, records after every layer the candidate logits and the label "this
layer's candidate-local argmax is the final token", trains one MLP per layer (BCE, Adam), saves
<model>/predictors.safetensors and <model>/predictors_report.json: per-layer positive rate,
precision and recall, the speculator's decode hit rates (a draft head with a vocabulary subset
also over the whole vocabulary) and the oracle exit depth.

With --calib-prompts N, N further prompts (never trained on) are decoded the same way and give
<model>/calibration.safetensors (specee_core.early_exit.calibration: per layer and candidate threshold, the exits
and disagreements with the full model, from which max_disagreement's thresholds are derived), the
per-layer precision/recall curves on them in the report and, with --plot, a figure of them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from jobs.cli import parse_config
from jobs.build_corpus import sample_snippets
from jobs.make_distill_data import render_prompt, sample_prompts
from specee_core import SpecEEEngine
from specee_core.early_exit.collect import (collect_exit_data, exit_labels, hit_rates, oracle_exit_layers,
                                            predictor_dataset)
from specee_core.early_exit.step import DRAFT_DIR, PREDICTORS_FILE
from specee_core.early_exit.calibration import CALIBRATION_FILE, Calibration
from specee_core.early_exit.predictors import (EXIT_TOKENS, FEATURE_SETS, PredictorBank, classification_report,
                                               exit_choice, exit_probability, train_layer)
from specee_core.draft.head import DraftHead, DraftModel
from specee_core.draft.lookup import LOOKUP_NGRAM, lookup_tokens, lookup_veto

log = logging.getLogger(__name__)


@dataclass
class PredictorTrainConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")
    prompts: Path | None = None  # instruction rows {"id", "prompt"} (JSON lines) instead of corpus snippets
    exclude: Path | None = None  # JSON lines whose ids --prompts skips (e.g. the draft's distill data)
    exclude_first: int = 0  # skip the first N rows of --prompts (the draft's distillation took --limit N)
    dtype: str = "float32"  # the engine's dtype: decode in the one it will serve with
    weights: str = "fp32"  # specee_core.model.quant.WEIGHT_FORMATS: q4 on SmolLM2 is its own weights at q4 speed
    ckpt_dir: Path = Path("runs/train_predictors")  # the decode data, kept for reruns
    num_prompts: int = 128
    calib_prompts: int = 0  # further prompts for calibration.safetensors (0: none)
    calibrate_only: bool = False  # keep the predictors beside the model; only (re)make calibration.safetensors
    plot: Path | None = None  # the precision/recall curves of the calibration split
    # calibrate under the lookup veto (draft.lookup.lookup_veto): an exit whose token contradicts prompt lookup's
    # match of at least this many tokens is not taken; 0: no veto
    lookup_veto: int = 2
    max_new_tokens: int = 128
    batch_size: int = 16
    k: int = 4
    speculator: str = "draft"  # whose candidates the predictors learn on: "draft" | "lookup"
    # predictors' feature set (specee_core.early_exit.predictors.FEATURE_SETS): "zpdq" adds the draft's
    # confidence in its candidates (needs speculator "draft"), "zpdqh" also its recent record (k >= 3),
    # "zpd" is the paper's; "auto": zpdqh with the draft, zpd with prompt lookup (which has no confidence)
    features: str = "auto"
    # what an exit emits, the token the predictors learn to trust (predictors.EXIT_TOKENS): "draft" the
    # draft head's top candidate, "local" (the paper's) the layer's argmax among the candidates; "auto":
    # draft with the draft head, local with prompt lookup
    exit_token: str = "auto"
    epochs: int = 100
    max_gap: int = 1  # the feature p - prev compares with the layer this far below (1: adjacent, as the engine)
    max_samples: int = 16000  # per layer
    seed: int = 0
    threads: int = 0

    def __post_init__(self) -> None:
        self.model, self.corpus, self.ckpt_dir = Path(self.model), Path(self.corpus), Path(self.ckpt_dir)
        self.prompts, self.exclude = optional_path(self.prompts), optional_path(self.exclude)
        self.plot = optional_path(self.plot)
        if self.speculator not in ("draft", "lookup"):
            raise ValueError(f"speculator must be 'draft' or 'lookup', got {self.speculator!r}")
        if self.features not in (*FEATURE_SETS, "auto"):
            raise ValueError(f"features must be one of {sorted(FEATURE_SETS)} or 'auto', got {self.features!r}")
        if self.exit_token not in (*EXIT_TOKENS, "auto"):
            raise ValueError(f"exit_token must be one of {EXIT_TOKENS} or 'auto', got {self.exit_token!r}")
        if self.exit_token == "auto":
            self.exit_token = "draft" if self.speculator == "draft" else "local"
        if not 0 <= self.lookup_veto <= LOOKUP_NGRAM:
            raise ValueError(f"lookup_veto must be in 0..{LOOKUP_NGRAM} (0: none), got {self.lookup_veto}")


def optional_path(p) -> Path | None:
    return None if p in (None, "") else Path(p)


def training_prompts(engine, corpus: Path, prompts: Path | None, n: int, seed: int,
                     exclude: Path | None = None, exclude_first: int = 0) -> list[str]:
    """n prompt texts: instruction rows of `prompts` through the chat template, else corpus snippets."""
    if prompts is None:
        return sample_snippets(corpus / "train.jsonl", n, seed=seed)
    rows = sample_prompts(prompts, n, seed=seed, exclude=exclude, exclude_first=exclude_first)
    return [render_prompt(engine, r["prompt"]) for r in rows]


def decode_data_key(cfg: PredictorTrainConfig) -> dict:
    """What the cached decode data depends on: the settings, and the draft head's weights (a retrained
    draft proposes other candidates with other confidences: its predictors need new data)."""
    key = {k: str(getattr(cfg, k)) for k in ("model", "corpus", "prompts", "exclude", "exclude_first", "dtype",
                                             "weights", "num_prompts", "calib_prompts", "max_new_tokens",
                                             "batch_size", "k", "speculator", "seed")}
    weights = cfg.model / DRAFT_DIR / "model.safetensors"
    key["draft"] = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else ""
    return key


def collect(engine, prompts: list[str], cfg: PredictorTrainConfig, part: str = "train") -> dict:
    """Full-depth decoding of prompts: {"z": [S, L-1, K], "cand": [S, K], "final": [S], "q": [S, K] or None,
    "record": [S, K] or None, "cand_whole": [S, K] or None, "lookup": [S, 3]} (q: the speculator's own
    probabilities of its candidates; record: the draft's record, predictors.DraftRecord; cand_whole: the
    draft head's candidates over the whole vocabulary when it ranks a subset; lookup: prompt lookup's
    followers, collect.ExitData.lookup), cached in --ckpt-dir so that a rerun with the same settings
    trains without decoding again."""
    key = decode_data_key(cfg)
    path = cfg.ckpt_dir / f"exit_data_{part}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key and "lookup" in saved:
            log.info("decode data loaded from %s", path)
            return saved
    if cfg.speculator == "draft" and engine.draft is None:
        raise FileNotFoundError(f"no draft head at {cfg.model / DRAFT_DIR}: run jobs.train_draft first")
    shadow = None
    if cfg.speculator == "draft" and engine.draft.subset is not None:  # the same head over the whole vocabulary
        shadow = DraftModel(DraftHead.load(cfg.model / DRAFT_DIR, engine.config), engine.model, use_subset=False)
    data = collect_exit_data(engine, prompts, cfg.speculator, cfg.k, cfg.max_new_tokens, shadow)
    z, cand, final, q, record = data.tensors()
    saved = {"key": key, "z": z, "cand": cand, "final": final, "q": q, "record": record,
             "cand_whole": None if shadow is None else torch.cat(data.shadow), "lookup": data.lookups()}
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save(saved, path)
    return saved


def train(cfg: PredictorTrainConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # no prefix cache: the prompts share no prefix, and its blocks only took memory (on Gemma 3 a 1,200-prompt
    # collection grew past 18 GB with it)
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, weights=cfg.weights,
                                          max_batch_size=cfg.batch_size, prefix_cache=False)
    L = engine.config.num_hidden_layers
    every = training_prompts(engine, cfg.corpus, cfg.prompts, cfg.num_prompts + cfg.calib_prompts, cfg.seed,
                             cfg.exclude, cfg.exclude_first)
    prompts, calib = every[: cfg.num_prompts], every[cfg.num_prompts :]
    if cfg.calibrate_only:
        if not calib:
            raise ValueError("--calibrate-only needs --calib-prompts > 0")
        report = json.loads((cfg.model / "predictors_report.json").read_text()) \
            if (cfg.model / "predictors_report.json").is_file() else {}
        report["calibration"] = calibrate(engine, PredictorBank.load(cfg.model / PREDICTORS_FILE), calib, cfg)
        (cfg.model / "predictors_report.json").write_text(json.dumps(report, indent=2))
        return report
    t0 = time.perf_counter()
    data = collect(engine, prompts, cfg)
    z, cand, final, q, record, cand_whole = (data[k] for k in ("z", "cand", "final", "q", "record", "cand_whole"))
    features = cfg.features if cfg.features != "auto" else ("zpd" if q is None else "zpdq" if record is None
                                                             else "zpdqh")
    if features in ("zpdq", "zpdqh") and q is None:
        raise ValueError(f"features {features!r} need a speculator that scores its candidates (the draft head); "
                         f"--speculator {cfg.speculator} does not")
    if features == "zpdqh" and record is None:
        raise ValueError(f"features 'zpdqh' need the draft's record, which needs --k >= 3 (got {cfg.k}); "
                         f"decode data cached before the record existed: delete {cfg.ckpt_dir}")
    q = q if features in ("zpdq", "zpdqh") else None
    record = record if features == "zpdqh" else None
    labels = exit_labels(z, cand, final, cfg.exit_token)  # [S, L-1]
    collect_s = time.perf_counter() - t0
    oracle = oracle_exit_layers(labels, L).float()
    report: dict = {"steps": len(final), "collect_s": round(collect_s, 1),
                    "speculator": {cfg.speculator: hit_rates(cand, final)}, "dtype": cfg.dtype,
                    "weights": cfg.weights, "prompts": str(cfg.prompts or cfg.corpus / "train.jsonl"),
                    "num_prompts": len(prompts), "exclude_first": cfg.exclude_first, "epochs": cfg.epochs,
                    "max_samples": cfg.max_samples, "max_gap": cfg.max_gap,
                    "max_new_tokens": cfg.max_new_tokens, "oracle_avg_layers": oracle.mean().item(), "oracle_layer_fraction": oracle.mean().item() / L,
                    "features": features, "exit_token": cfg.exit_token, "layers": {}}
    if cand_whole is not None:  # the same draft head ranking the whole vocabulary instead of its subset
        report["speculator"]["draft_whole_vocab"] = hit_rates(cand_whole, final)
    print(json.dumps({k: v for k, v in report.items() if k != "layers"}), flush=True)
    # split by time step: the last 20% of samples validate
    s = len(final)
    order = torch.randperm(s, generator=torch.Generator().manual_seed(cfg.seed))
    n_val = s // 5
    val, tr = order[:n_val], order[n_val:][: cfg.max_samples]
    mlps = {}
    for layer in range(1, L):
        x, y = predictor_dataset(z, labels, layer, max_gap=cfg.max_gap, seed=cfg.seed, draft_prob=q, record=record)
        mlps[layer] = train_layer(x[tr], y[tr], epochs=cfg.epochs, seed=cfg.seed + layer)
        rep = classification_report(mlps[layer], x[val], y[val])
        report["layers"][layer] = {k: round(v, 4) if isinstance(v, float) else v for k, v in rep.items()}
        print(json.dumps({"layer": layer, **report["layers"][layer]}), flush=True)
    meta = {"speculator": cfg.speculator, "steps": s, "train_samples_per_layer": len(tr),
            "features": features}
    bank = PredictorBank.from_mlps(cfg.k, mlps, meta, features=features, exit_token=cfg.exit_token)
    bank.save(cfg.model / PREDICTORS_FILE)
    if calib:
        report["calibration"] = calibrate(engine, bank, calib, cfg)
    report["train_s"] = round(time.perf_counter() - t0 - collect_s, 1)
    (cfg.model / "predictors_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    return report


def calibration_counts(data: dict, bank: PredictorBank, lookup_veto_ngram: int, seed: int = 0
                       ) -> tuple[dict, dict, dict]:
    """From decode data (collect): per predictor layer, the exit probability [S], whether the exit's token is
    the full model's [S], and (lookup_veto_ngram > 0) whether the lookup veto stops the exit [S]."""
    z, cand, final, q, record = (data[k] for k in ("z", "cand", "final", "q", "record"))
    labels = exit_labels(z, cand, final, bank.exit_token)
    choice = exit_choice(z, cand, bank.exit_token)  # [S, L-1]
    looked_up = lookup_tokens(data["lookup"], lookup_veto_ngram) if lookup_veto_ngram else None
    q = q if bank.reads_draft_prob else None
    if bank.reads_record and record is None:
        raise ValueError("these predictors read the draft's record, which the calibration decode data lacks")
    record = record if bank.reads_record else None
    p_exit, agree, veto = {}, {}, {}
    for layer in sorted(bank.layers):
        x, y = predictor_dataset(z, labels, layer, max_gap=1, seed=seed + 1000,  # the engine's feature
                                 draft_prob=q, record=record)
        with torch.no_grad():
            p_exit[layer] = exit_probability(x, bank.layers[layer])
        agree[layer] = y > 0.5
        if looked_up is not None:
            veto[layer] = lookup_veto(choice[:, layer - 1], looked_up)
    return p_exit, agree, veto


def calibrate(engine, bank: PredictorBank, prompts: list[str], cfg: PredictorTrainConfig) -> dict:
    """calibration.safetensors from full-depth decoding of the held-out prompts; returns the report's part:
    the split's size, per-layer precision/recall over the threshold grid (of the exits the veto leaves),
    the thresholds at a few tolerances."""
    data = collect(engine, prompts, cfg, part="calib")
    p_exit, agree, veto = calibration_counts(data, bank, cfg.lookup_veto, cfg.seed)
    cal = Calibration.count(p_exit, agree, prompts=len(prompts), source=str(cfg.prompts or cfg.corpus),
                            meta={"dtype": cfg.dtype, "weights": cfg.weights, "max_new_tokens": cfg.max_new_tokens,
                                  "exclude_first": cfg.exclude_first, "seed": cfg.seed},
                            veto=veto or None, lookup_veto=cfg.lookup_veto or None)
    cal.save(cfg.model / CALIBRATION_FILE)
    curves = {l: {"positive_rate": round(agree[l].float().mean().item(), 4),
                  "threshold": c.thresholds,
                  "precision": [round(1 - k / n, 4) if n else None for n, k in zip(c.exits, c.disagree)],
                  "recall": [round((n - k) / max(int(agree[l].sum()), 1), 4) for n, k in zip(c.exits, c.disagree)]}
              for l, c in cal.layer_counts().items()}
    at = {str(eps): {l: c.threshold for l, c in cal.thresholds(eps).items()} for eps in (0.01, 0.02, 0.05, 0.1)}
    if cfg.plot:
        plot_curves(curves, cfg.plot, f"{cfg.model.name}: exit predictors on {len(prompts)} held-out prompts "
                                      f"({cal.tokens} tokens)")
    log.info("calibration: %d prompts, %d tokens -> %s", len(prompts), cal.tokens, cfg.model / CALIBRATION_FILE)
    out = {"prompts": len(prompts), "tokens": cal.tokens, "curves": curves, "thresholds": at}
    if veto:  # how often lookup matched, and how often it vetoed an exit's token (share of tokens, per layer)
        matched = (lookup_tokens(data["lookup"], cfg.lookup_veto) >= 0).float().mean().item()
        out["lookup_veto"] = {"min_ngram": cfg.lookup_veto, "matched": round(matched, 4),
                              "vetoed": {l: round(v.float().mean().item(), 4) for l, v in veto.items()}}
    return out


def plot_curves(curves: dict, path: Path, title: str) -> None:
    """Precision against recall per layer (colour by depth), the points being the threshold grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    cmap, layers = plt.get_cmap("viridis"), sorted(curves)
    for i, l in enumerate(layers):
        c = curves[l]
        pts = [(r, p) for r, p in zip(c["recall"], c["precision"]) if p is not None]
        if pts:
            ax.plot(*zip(*pts), marker=".", color=cmap(i / max(len(layers) - 1, 1)), lw=1,
                    label=f"layer {l}" if i % 4 == 0 or l == layers[-1] else None)
    for eps in (0.01, 0.02, 0.05):
        ax.axhline(1 - eps, color="grey", lw=0.6, ls="--")
        ax.text(1.0, 1 - eps, f"1 - {eps} ", va="center", ha="right", fontsize=7, color="grey",
                transform=ax.get_yaxis_transform())
    ax.set_ylim(0.5, 1.005)
    ax.set_xlabel("recall (share of agreeing tokens that exit)")
    ax.set_ylabel("precision (share of exits that agree with the full model)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    train(parse_config(PredictorTrainConfig, __doc__, argv))


if __name__ == "__main__":
    main()
