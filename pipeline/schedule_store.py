"""The schedule store: one named Ray actor per batch run that aggregates the engines' exit
statistics and re-tunes the SpecEE predictor schedule while the run goes on.

Engines report each batch's statistics (fire and forget) and pick up the latest version before
their next batch without waiting for it (pipeline.stage). Every `retune_every_tokens` generated
tokens the store applies the scheduler's own update rule (specee_core.scheduler.retune) to the
exit histogram of the tokens seen since the last re-tune, and publishes a new numbered version
when the chosen layers change. The driver saves each version as it appears.

Its state is O(layers) per version: a histogram of L bins for the window and a few counters per
version, whatever the number of rows, so it never becomes the bottleneck (each report is one
small message per engine batch).
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Sequence

from specee_core.scheduler import Schedule, retune

log = logging.getLogger(__name__)


class ScheduleStore:
    """Plain class (tests use it in-process); `remote_store` makes the Ray actor of it."""

    def __init__(self, schedule: dict | None, retune_every_tokens: int = 1024, min_exits: int = 1):
        if retune_every_tokens < 1:
            raise ValueError(f"retune_every_tokens must be >= 1, got {retune_every_tokens}")
        self.versions: list[Schedule] = [] if schedule is None else [Schedule(**schedule)]
        self.retune_every_tokens = retune_every_tokens
        self.min_exits = min_exits
        self.window: list[int] | None = None  # retune histogram of the tokens since the last re-tune
        self.window_tokens = 0
        self.retunes = 0  # update-rule applications, including those that kept the layers
        self.per_version: dict[int | None, dict] = {}  # version -> rows, tokens, layer_tokens, batches

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
               histogram: Sequence[int] | None) -> int | None:
        """One engine batch's statistics; returns the current version (after any re-tune)."""
        stats = self.per_version.setdefault(version, {"batches": 0, "rows": 0, "tokens": 0, "layer_tokens": 0.0})
        stats["batches"] += 1
        stats["rows"] += rows
        stats["tokens"] += tokens
        stats["layer_tokens"] += layer_tokens
        if histogram is not None and self.current is not None:
            if len(histogram) != self.current.num_layers:
                raise ValueError(f"histogram of {len(histogram)} bins for a {self.current.num_layers}-layer schedule")
            self.window = list(histogram) if self.window is None else [a + b for a, b in zip(self.window, histogram)]
            self.window_tokens += tokens
            if self.window_tokens >= self.retune_every_tokens:
                self._retune()
        return None if self.current is None else self.current.version

    def _retune(self) -> None:
        old = self.current
        new = retune(old, self.window, min_tokens=self.min_exits)
        self.retunes += 1
        if new.version != old.version and new.offline_layers != old.offline_layers:
            new.version = old.version + 1
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
                "per_version": [{"schedule_version": v, **s, "avg_layers": s["layer_tokens"] / s["tokens"]
                                 if s["tokens"] else None}
                                for v, s in sorted(self.per_version.items(), key=lambda kv: (kv[0] is None, kv[0]))]}


def remote_store(name: str, schedule: Schedule | None, retune_every_tokens: int, min_exits: int):
    """The named store actor. No CPUs (it idles between small messages) and no restarts: if it is
    lost, engines keep the version they have and the run goes on without re-tuning."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=0)(ScheduleStore)
    return actor.options(name=name).remote(None if schedule is None else asdict(schedule), retune_every_tokens,
                                           min_exits)
