"""SpecEE's options (mode="specee"): where its candidates come from, when a row exits (a threshold, or the quality
contract's calibrated thresholds), what an exit emits, the skipped layers' KV, how exited rows leave the batch, the
online schedule's window, exploration and the live audit, and whether the pay-off gate runs whole steps dense."""
from __future__ import annotations

from dataclasses import dataclass

from specee_core.early_exit.calibration import check_tolerance


@dataclass
class EarlyExitOptions:
    speculator: str = "auto"  # "draft" | "lookup" (prompt lookup, draft as fallback if present) | "auto"
    # exit when sigmoid(predictor) > threshold; > 1 switches exits off. 0.9, not the paper's 0.5: a higher bar
    # keeps exited tokens closer to dense's (max_disagreement below states the bound instead)
    threshold: float = 0.9
    # the quality contract (specee_core.early_exit.calibration): per-layer thresholds such that the share of
    # exited tokens that differ from the full model's argmax stays <= max_disagreement with this
    # confidence on held-out calibration data. None: the raw `threshold` above, uncalibrated.
    max_disagreement: float | None = None
    confidence: float = 0.95
    # live audit: this share of steps runs exited rows on to full depth anyway (their output is
    # unchanged) and counts per exit layer whether the full model agreed; 0 = never
    audit_fraction: float = 0.0
    # "local": the token the predictors learnt to trust (PredictorBank.exit_token: the argmax among the k
    # candidates, or the draft's top one) | "full": LM-head argmax at the exit layer
    verify: str = "local"
    # "row": an exited row leaves the batch, later layers run over the rows still active (compacted),
    # so a batch gets cheaper as rows exit (large batches on a GPU). "batch": exited rows keep flowing
    # (their KV stays exact) and layers are skipped once every row has exited: on a weight-bound CPU
    # a layer costs the same for 5 rows as for 8, and compaction's KV gathers cost more than they save.
    # "auto": row on CUDA, batch elsewhere. Identical at batch 1.
    skip: str = "auto"
    window: int | None = None  # online window N; None = the schedule's
    offsets: tuple[int, ...] | None = None  # online offsets; None = the schedule's
    explore_every: int = 0  # every n-th step runs every predictor (unbiased stats for re-tuning); 0 = never
    predictor_backend: str = "auto"  # "auto" (Triton on CUDA) | "triton" | "torch"
    schedule: str | None = None  # path of a schedule JSON; None = schedule.json beside the model
    # whether whole steps run dense when SpecEE's exits do not pay for its draft head and predictors here
    # (specee_core.step.policy.PayOffGate: the costs timed once per engine, then decided from the exits): "measured";
    # "off": every step a SpecEE step; "auto": measured on CPUs (host timers see the work), off on CUDA
    # (asynchronous: a host timer would time the launches)
    gate: str = "auto"

    def __post_init__(self) -> None:
        checks = {"speculator": ("auto", "draft", "lookup"), "verify": ("local", "full"),
                  "predictor_backend": ("auto", "triton", "torch"),
                  "skip": ("auto", "row", "batch"), "gate": ("auto", "measured", "off")}
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 <= self.threshold:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")
        check_tolerance(self.max_disagreement, self.confidence)
        if not 0.0 <= self.audit_fraction <= 1.0:
            raise ValueError(f"audit_fraction must be in [0, 1], got {self.audit_fraction}")
