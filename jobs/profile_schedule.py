"""Offline level of the two-level scheduler: run SpecEE with a predictor after every layer on
profiling prompts, rank layers by exit frequency, and write <model>/schedule.json.

    python -m jobs.profile_schedule --model models/specee-tiny
    python -m jobs.profile_schedule --model models/smollm2-135m-instruct --weights q4 \
        --prompts prompts/instructions_train.jsonl --max-disagreement 0.02

Profiling prompts are corpus snippets, or with --prompts instruction rows rendered with the
chat template when the tokenizer has one. The report also goes to <model>/schedule_report.json.

The number of offline layers is the smallest set covering --coverage of all early exits
(clamped to [--min-layers, --max-layers]); the choice itself is scheduler.select_offline_layers,
the same rule the Ray pipeline re-tunes with.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.cli import parse_config
from jobs.train_predictors import optional_path, training_prompts
from specee_core import SpecEEEngine
from specee_core.early_exit.step import SCHEDULE_FILE
from specee_core.early_exit.scheduler import Schedule, select_offline_layers


@dataclass
class ProfileConfig:
    model: Path = Path("models/specee-tiny")
    corpus: Path = Path("data/corpus")
    prompts: Path | None = None  # instruction rows {"id", "prompt"} (JSON lines) instead of corpus snippets
    dtype: str = "float32"  # the engine's dtype: profile in the one it will serve with
    weights: str = "fp32"  # specee_core.model.quant.WEIGHT_FORMATS
    num_prompts: int = 48
    max_new_tokens: int = 96
    coverage: float = 0.8
    min_layers: int = 2
    max_layers: int = 6
    speculator: str = "draft"
    threshold: float = 0.9  # profile at the threshold the engine will run with
    max_disagreement: float | None = None  # ... or with the thresholds calibrated to this tolerance
    seed: int = 1

    def __post_init__(self) -> None:
        self.model, self.corpus, self.prompts = Path(self.model), Path(self.corpus), optional_path(self.prompts)
        if not 0 < self.coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage}")


def layers_for_coverage(histogram: list[int], coverage: float) -> int:
    exits = sorted(histogram[:-1], reverse=True)
    total, acc = sum(exits), 0
    for n, c in enumerate(exits, 1):
        acc += c
        if total == 0 or acc >= coverage * total:
            return n
    return len(exits)


def profile(cfg: ProfileConfig) -> dict:
    engine = SpecEEEngine.from_pretrained(cfg.model, dtype=cfg.dtype, weights=cfg.weights, speculator=cfg.speculator,
                                          threshold=cfg.threshold, max_disagreement=cfg.max_disagreement)
    L = engine.config.num_hidden_layers
    engine.set_schedule(Schedule.all_layers(L, source="profile-all"))
    prompts = training_prompts(engine, cfg.corpus, cfg.prompts, cfg.num_prompts, cfg.seed)
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, mode="specee")
    hist = [sum(r.stats["exit_histogram"][i] for r in results) for i in range(L)]
    n = max(cfg.min_layers, min(cfg.max_layers, layers_for_coverage(hist, cfg.coverage)))
    schedule = Schedule(num_layers=L, offline_layers=select_offline_layers(hist, n), source="profile")
    schedule.save(cfg.model / SCHEDULE_FILE)
    tokens = sum(hist)
    report = {"exit_histogram": hist, "tokens": tokens, "avg_layers_all_predictors": sum((i + 1) * c for i, c in enumerate(hist)) / tokens,
              "offline_layers": schedule.offline_layers, "coverage": sum(hist[l - 1] for l in schedule.offline_layers) / max(1, sum(hist[:-1])),
              "prompts": str(cfg.prompts or cfg.corpus / "train.jsonl"), "num_prompts": len(prompts),
              "max_new_tokens": cfg.max_new_tokens, "threshold": cfg.threshold,
              "max_disagreement": cfg.max_disagreement, "dtype": cfg.dtype, "weights": cfg.weights,
              "seconds": round(time.perf_counter() - t0, 1)}
    (cfg.model / "schedule_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    profile(parse_config(ProfileConfig, __doc__, argv))


if __name__ == "__main__":
    main()
