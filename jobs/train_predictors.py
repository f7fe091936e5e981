"""Train the per-layer exit predictors from full-depth decoding over training prompts.

    python -m jobs.train_predictors --model models/specee-tiny                 # corpus snippets
    python -m jobs.train_predictors --model models/smollm2-135m-instruct --dtype bfloat16 \
        --prompts prompts/instructions_train.jsonl --exclude data/distill/smollm2.jsonl

Decodes --num-prompts training prompts (corpus snippets, or with --prompts instruction rows
rendered with the chat template when the tokenizer has one) greedily at full depth with the
speculator's candidates, records after every layer the candidate logits and the label "this
layer's candidate-local argmax is the final token", trains one MLP per layer (BCE, Adam), saves
<model>/predictors.safetensors and <model>/predictors_report.json: per-layer positive rate,
precision and recall, the speculator's decode hit rates (a draft head with a vocabulary subset
also over the whole vocabulary) and the oracle exit depth.
"""
from __future__ import annotations

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
from specee_core.collect import collect_exit_data, exit_labels, hit_rates, oracle_exit_layers, predictor_dataset
from specee_core.early_exit import DRAFT_DIR, PREDICTORS_FILE
from specee_core.predictors import PredictorBank, classification_report, train_layer
from specee_core.speculators import DraftHead, DraftSpeculator, PromptLookupSpeculator, Speculator

log = logging.getLogger(__name__)


@dataclass
class PredictorTrainConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")
    prompts: Path | None = None  # instruction rows {"id", "prompt"} (JSON lines) instead of corpus snippets
    exclude: Path | None = None  # JSON lines whose ids --prompts skips (e.g. the draft's distill data)
    dtype: str = "float32"  # the engine's dtype: decode in the one it will serve with
    ckpt_dir: Path = Path("runs/train_predictors")  # the decode data, kept for reruns
    num_prompts: int = 128
    max_new_tokens: int = 128
    batch_size: int = 16
    k: int = 4
    speculator: str = "draft"  # whose candidates the predictors learn on: "draft" | "lookup"
    epochs: int = 100
    max_samples: int = 16000  # per layer
    seed: int = 0
    threads: int = 0

    def __post_init__(self) -> None:
        self.model, self.corpus, self.ckpt_dir = Path(self.model), Path(self.corpus), Path(self.ckpt_dir)
        self.prompts, self.exclude = optional_path(self.prompts), optional_path(self.exclude)
        if self.speculator not in ("draft", "lookup"):
            raise ValueError(f"speculator must be 'draft' or 'lookup', got {self.speculator!r}")


def optional_path(p) -> Path | None:
    return None if p in (None, "") else Path(p)


def training_prompts(engine, corpus: Path, prompts: Path | None, n: int, seed: int,
                     exclude: Path | None = None) -> list[str]:
    """n prompt texts: instruction rows of `prompts` through the chat template, else corpus snippets."""
    if prompts is None:
        return sample_snippets(corpus / "train.jsonl", n, seed=seed)
    return [render_prompt(engine, r["prompt"]) for r in sample_prompts(prompts, n, seed=seed, exclude=exclude)]


class ShadowSpeculator(Speculator):
    """Proposes with `main` and records what `shadow` would have proposed from the same inputs
    (the shadow's decode hit rate, measured in the same run)."""

    def __init__(self, main: Speculator, shadow: Speculator):
        self.main, self.shadow, self.k = main, shadow, main.k
        self.cands: list[torch.Tensor] = []  # per step [N, K]

    def start(self, prompt_ids, features, lens, max_len) -> None:
        self.main.start(prompt_ids, features, lens, max_len)
        self.shadow.start(prompt_ids, features, lens, max_len)

    def propose(self, rows, history, tokens, features) -> torch.Tensor:
        self.cands.append(self.shadow.propose(rows, history, tokens, features).cpu())
        return self.main.propose(rows, history, tokens, features)


def make_speculator(engine, model_dir: Path, kind: str, k: int):
    draft = None
    if (model_dir / DRAFT_DIR / "config.json").is_file():
        draft = DraftSpeculator(DraftHead.load(model_dir / DRAFT_DIR, engine.config), engine.model, k=k)
    if kind == "draft":
        if draft is None:
            raise FileNotFoundError(f"no draft head at {model_dir / DRAFT_DIR}: run jobs.train_draft first")
        return draft
    return PromptLookupSpeculator(k=k, fallback=draft)


def collect(engine, prompts: list[str], cfg: PredictorTrainConfig):
    """(z [S, L-1, K], cand [S, K], final [S], cand_whole [S, K] or None) from full-depth decoding,
    cached in --ckpt-dir so that a rerun with the same settings trains without decoding again.
    cand_whole: the draft head's candidates over the whole vocabulary when it ranks a subset."""
    key = {k: str(getattr(cfg, k)) for k in ("model", "corpus", "prompts", "exclude", "dtype", "num_prompts",
                                             "max_new_tokens", "batch_size", "k", "speculator", "seed")}
    path = cfg.ckpt_dir / "exit_data.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key:
            log.info("decode data loaded from %s", path)
            return saved["z"], saved["cand"], saved["final"], saved["cand_whole"]
    speculator = make_speculator(engine, cfg.model, cfg.speculator, cfg.k)
    shadow = None
    if isinstance(speculator, DraftSpeculator) and speculator.subset is not None:
        head = DraftHead.load(cfg.model / DRAFT_DIR, engine.config)
        shadow = speculator = ShadowSpeculator(speculator, DraftSpeculator(head, engine.model, k=cfg.k, use_subset=False))
    z, cand, final = collect_exit_data(engine, prompts, speculator, cfg.max_new_tokens).tensors()
    cand_whole = None if shadow is None else torch.cat(shadow.cands)
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "z": z, "cand": cand, "final": final, "cand_whole": cand_whole}, path)
    return z, cand, final, cand_whole


def train(cfg: PredictorTrainConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, max_batch_size=cfg.batch_size)
    L = engine.config.num_hidden_layers
    prompts = training_prompts(engine, cfg.corpus, cfg.prompts, cfg.num_prompts, cfg.seed, cfg.exclude)
    t0 = time.perf_counter()
    z, cand, final, cand_whole = collect(engine, prompts, cfg)
    labels = exit_labels(z, cand, final)  # [S, L-1]
    collect_s = time.perf_counter() - t0
    oracle = oracle_exit_layers(labels, L).float()
    report: dict = {"steps": len(final), "collect_s": round(collect_s, 1),
                    "speculator": {cfg.speculator: hit_rates(cand, final)}, "dtype": cfg.dtype,
                    "prompts": str(cfg.prompts or cfg.corpus / "train.jsonl"), "num_prompts": len(prompts),
                    "max_new_tokens": cfg.max_new_tokens, "oracle_avg_layers": oracle.mean().item(), "oracle_layer_fraction": oracle.mean().item() / L,
                    "layers": {}}
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
        x, y = predictor_dataset(z, labels, layer, seed=cfg.seed)
        mlps[layer] = train_layer(x[tr], y[tr], cfg.k, epochs=cfg.epochs, seed=cfg.seed + layer)
        rep = classification_report(mlps[layer], x[val], y[val])
        report["layers"][layer] = {k: round(v, 4) if isinstance(v, float) else v for k, v in rep.items()}
        print(json.dumps({"layer": layer, **report["layers"][layer]}), flush=True)
    meta = {"speculator": cfg.speculator, "label": "local", "steps": s, "train_samples_per_layer": len(tr)}
    PredictorBank.from_mlps(cfg.k, mlps, meta).save(cfg.model / PREDICTORS_FILE)
    report["train_s"] = round(time.perf_counter() - t0 - collect_s, 1)
    (cfg.model / "predictors_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    train(parse_config(PredictorTrainConfig, __doc__, argv))


if __name__ == "__main__":
    main()
