"""Train the per-layer exit predictors from full-depth decoding over training prompts.

    python -m jobs.train_predictors --model models/specee-tiny

Decodes --num-prompts training-split prompts greedily at full depth with the speculator's
candidates, records after every layer the candidate logits and the label "this layer's
candidate-local argmax is the final token", trains one MLP per layer (BCE, Adam), saves
<model>/predictors.safetensors and prints per-layer positive rate, precision and recall, the
speculators' hit rates and the oracle exit depth as JSON.
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
from specee_core import SpecEEEngine
from specee_core.collect import collect_exit_data, exit_labels, hit_rates, oracle_exit_layers, predictor_dataset
from specee_core.early_exit import DRAFT_DIR, PREDICTORS_FILE
from specee_core.predictors import PredictorBank, classification_report, train_layer
from specee_core.speculators import DraftHead, DraftSpeculator, PromptLookupSpeculator

log = logging.getLogger(__name__)


@dataclass
class PredictorTrainConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")
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
        self.model, self.corpus = Path(self.model), Path(self.corpus)
        if self.speculator not in ("draft", "lookup"):
            raise ValueError(f"speculator must be 'draft' or 'lookup', got {self.speculator!r}")


def make_speculator(engine, model_dir: Path, kind: str, k: int):
    draft = None
    if (model_dir / DRAFT_DIR / "config.json").is_file():
        draft = DraftSpeculator(DraftHead.load(model_dir / DRAFT_DIR, engine.config), engine.model, k=k)
    if kind == "draft":
        if draft is None:
            raise FileNotFoundError(f"no draft head at {model_dir / DRAFT_DIR}: run jobs.train_draft first")
        return draft
    return PromptLookupSpeculator(k=k, fallback=draft)


def train(cfg: PredictorTrainConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    engine = SpecEEEngine.from_pretrained(cfg.model, max_batch_size=cfg.batch_size)
    L = engine.config.num_hidden_layers
    prompts = sample_snippets(cfg.corpus / "train.jsonl", cfg.num_prompts, seed=cfg.seed)
    t0 = time.perf_counter()
    data = collect_exit_data(engine, prompts, make_speculator(engine, cfg.model, cfg.speculator, cfg.k),
                             cfg.max_new_tokens)
    z, cand, final = data.tensors()
    labels = exit_labels(z, cand, final)  # [S, L-1]
    collect_s = time.perf_counter() - t0
    oracle = oracle_exit_layers(labels, L).float()
    report: dict = {"steps": len(final), "collect_s": round(collect_s, 1),
                    "speculator": {cfg.speculator: hit_rates(cand, final)},
                    "oracle_avg_layers": oracle.mean().item(), "oracle_layer_fraction": oracle.mean().item() / L,
                    "layers": {}}
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
