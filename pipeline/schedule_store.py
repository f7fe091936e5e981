"""The schedule store: one named Ray actor per batch run that aggregates the engines' exit
statistics and re-tunes the SpecEE predictor schedule while the run goes on.

Engines report each batch's statistics (fire and forget) and pick up the latest version before
their next batch without waiting for it (pipeline.stage). Every `retune_every_tokens` generated
tokens the store applies the scheduler's own update rule (specee_core.early_exit.scheduler.retune) to the
exit histogram of the tokens seen since the last re-tune, and publishes a new numbered version
when the chosen layers change. The driver saves each version as it appears.

With a tolerance (max_disagreement), the store also audits: engines run a share of their exited
tokens on to full depth anyway (EarlyExitOptions.audit_fraction) and report, per exit layer, how
many they checked and how many the full model would have chosen differently. The store keeps
each layer's counts with running confidence bounds (specee_core.early_exit.calibration's exact binomial (Clopper-Pearson) bounds,
Bonferroni over the layers) and, when a layer's lower bound passes the tolerance (the audit has
shown, at the stated confidence, that the layer disagrees more than allowed), publishes a new
version with that layer closed to exits. The bound is checked after every report: looking often
only makes closing a good layer more likely, never keeping a bad one, which is the safe side.
The summary reports per version the audited disagreement with its upper bound.

Its state is O(layers) per version: a histogram of L bins for the window and a few counters per
version, whatever the number of rows, so it never becomes the bottleneck (each report is one
small message per engine batch).
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Sequence

from specee_core.early_exit.calibration import check_tolerance, lower_bound, upper_bound
from specee_core.early_exit.scheduler import Schedule, disable_layers, retune

log = logging.getLogger(__name__)


class ScheduleStore:
    """Plain class (tests use it in-process); `remote_store` makes the Ray actor of it."""

    def __init__(self, schedule: dict | None, retune_every_tokens: int = 1024, min_exits: int = 1,
                 max_disagreement: float | None = None, confidence: float = 0.95):
        if retune_every_tokens < 1:
            raise ValueError(f"retune_every_tokens must be >= 1, got {retune_every_tokens}")
        check_tolerance(max_disagreement, confidence)
        self.max_disagreement, self.confidence = max_disagreement, confidence
        self.versions: list[Schedule] = [] if schedule is None else [Schedule(**schedule)]
        self.retune_every_tokens = retune_every_tokens
        self.min_exits = min_exits
        self.window: list[int] | None = None  # retune histogram of the tokens since the last re-tune
        self.window_tokens = 0
        self.retunes = 0  # update-rule applications, including those that kept the layers
        self.per_version: dict[int | None, dict] = {}  # version -> rows, tokens, layer_tokens, batches
        n = 0 if self.current is None else self.current.num_layers
        self.audit_exits, self.audit_disagree = [0] * n, [0] * n  # per exit layer, over the whole run
        self.closed: dict[int, dict] = {}  # layer -> the audit counts and bounds that closed it

    @property
    def current(self) -> Schedule | None:
        return self.versions[-1] if self.versions else None

    def latest(self, known_version: int | None = None) -> dict | None:
        """The current schedule when it is newer than known_version, else None."""
        s = self.current
        if s is None or (known_version is not None and s.version <= known_version):
            return None
        return asdict(s)

    def report(self, version: int | None, rows: int, tokens: int, layer_tokens: float,
               histogram: Sequence[int] | None, audit: tuple[Sequence[int], Sequence[int]] | None = None) -> int | None:
        """One engine batch's statistics; returns the current version (after any re-tune).
        audit: (audited exits, disagreements) per exit layer, or None."""
        stats = self.per_version.setdefault(version, {"batches": 0, "rows": 0, "tokens": 0, "layer_tokens": 0.0,
                                                      "audit_exits": 0, "audit_disagree": 0})
        stats["batches"] += 1
        stats["rows"] += rows
        stats["tokens"] += tokens
        stats["layer_tokens"] += layer_tokens
        if audit is not None and self.current is not None:
            self._audit(stats, *audit)
        if histogram is not None and self.current is not None:
            if len(histogram) != self.current.num_layers:
                raise ValueError(f"histogram of {len(histogram)} bins for a {self.current.num_layers}-layer schedule")
            self.window = list(histogram) if self.window is None else [a + b for a, b in zip(self.window, histogram)]
            self.window_tokens += tokens
            if self.window_tokens >= self.retune_every_tokens:
                self._retune()
        return None if self.current is None else self.current.version

    def _layer_delta(self) -> float:
        return (1 - self.confidence) / max(self.current.num_layers - 1, 1)

    def _audit(self, stats: dict, exits: Sequence[int], disagree: Sequence[int]) -> None:
        """Adds a batch's audit counts; closes every layer whose lower bound passes the tolerance."""
        if len(exits) != self.current.num_layers or len(disagree) != len(exits):
            raise ValueError(f"audit counts of {len(exits)}/{len(disagree)} layers for a "
                             f"{self.current.num_layers}-layer schedule")
        stats["audit_exits"] += sum(exits)
        stats["audit_disagree"] += sum(disagree)
        for i, (n, k) in enumerate(zip(exits, disagree)):
            self.audit_exits[i] += n
            self.audit_disagree[i] += k
        if self.max_disagreement is None:
            return
        delta, closing = self._layer_delta(), {}
        for i, (n, k) in enumerate(zip(self.audit_exits, self.audit_disagree)):
            layer = i + 1
            if n and layer not in self.current.disabled_layers and lower_bound(k, n, delta) > self.max_disagreement:
                closing[layer] = {"audit_exits": n, "audit_disagree": k, "lower_bound": lower_bound(k, n, delta),
                                  "upper_bound": upper_bound(k, n, delta)}
        if closing:
            old = self.current
            self.versions.append(disable_layers(old, list(closing)))
            self.closed.update({l: {**c, "closed_in_version": old.version + 1} for l, c in closing.items()})
            log.info("schedule v%d: layers %s closed by the audit (disagreement above %g)", old.version + 1,
                     sorted(closing), self.max_disagreement)

    def audit_report(self) -> dict | None:
        """The audit so far: per layer and in all, exits checked, disagreements, upper bounds."""
        if not any(self.audit_exits):
            return None
        delta = self._layer_delta()
        n, k = sum(self.audit_exits), sum(self.audit_disagree)
        return {"max_disagreement": self.max_disagreement, "confidence": self.confidence,
                "audit_exits": n, "audit_disagree": k, "disagreement": k / n,
                "upper_bound": upper_bound(k, n, 1 - self.confidence),
                "layers": {i + 1: {"audit_exits": a, "audit_disagree": d, "disagreement": d / a,
                                   "upper_bound": upper_bound(d, a, delta)}
                           for i, (a, d) in enumerate(zip(self.audit_exits, self.audit_disagree)) if a},
                "closed": self.closed}

    def _retune(self) -> None:
        old = self.current
        new = retune(old, self.window, min_tokens=self.min_exits)
        self.retunes += 1
        if new.version != old.version and new.offline_layers != old.offline_layers:
            self.versions.append(new)
            log.info("schedule v%d %s -> v%d %s (%d tokens)", old.version, old.offline_layers, new.version,
                     new.offline_layers, self.window_tokens)
        self.window, self.window_tokens = None, 0

    def since(self, version: int | None) -> list[dict]:
        """Every version newer than `version` (None: all), oldest first."""
        return [asdict(s) for s in self.versions if version is None or s.version > version]

    def state(self) -> dict:
        return {"versions": self.since(None), "retunes": self.retunes,
                "retune_every_tokens": self.retune_every_tokens,
                "audit": self.audit_report(),
                "per_version": [{"schedule_version": v, **s, "avg_layers": s["layer_tokens"] / s["tokens"]
                                 if s["tokens"] else None, **version_audit(s, self.confidence)}
                                for v, s in sorted(self.per_version.items(), key=lambda kv: (kv[0] is None, kv[0]))]}


def version_audit(stats: dict, confidence: float) -> dict:
    """A version's audited disagreement and its upper bound (empty without audited exits)."""
    n, k = stats["audit_exits"], stats["audit_disagree"]
    return {"audit_disagreement": k / n, "audit_upper_bound": upper_bound(k, n, 1 - confidence)} if n else {}


def remote_store(name: str, schedule: Schedule | None, retune_every_tokens: int, min_exits: int,
                 max_disagreement: float | None = None, confidence: float = 0.95):
    """The named store actor. No CPUs (it idles between small messages) and no restarts: if it is
    lost, engines keep the version they have and the run goes on without re-tuning."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=0)(ScheduleStore)
    return actor.options(name=name).remote(None if schedule is None else asdict(schedule), retune_every_tokens,
                                           min_exits, max_disagreement, confidence)
