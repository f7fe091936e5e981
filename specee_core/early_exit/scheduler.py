"""Two-level predictor scheduling (SpecEE T2).

Offline level: the layers where tokens exit most often, chosen from an exit-layer histogram
(profiling, or live statistics: the Ray pipeline re-tunes with the same rule).
Online level: the exit layers of the last N tokens of a row, plus offsets.
Layers are 1-based "layers run" counts everywhere: a predictor at layer l runs after the l-th
decoder layer, and a token that exits there has exit layer l. The last layer never needs one.
"""
from __future__ import annotations

import json
import os
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence


@dataclass
class Schedule:
    num_layers: int
    offline_layers: list[int]  # 1-based, sorted
    window: int = 5  # N: exit layers of the last N tokens feed the online level
    offsets: tuple[int, ...] = (-2, 0, 2)
    version: int = 0
    source: str = "profile"
    # layers where no row may exit: the live audit found their disagreement above the tolerance
    disabled_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.disabled_layers = sorted(set(int(l) for l in self.disabled_layers))
        self.offline_layers = sorted(set(int(l) for l in self.offline_layers) - set(self.disabled_layers))
        self.offsets = tuple(int(o) for o in self.offsets)
        bad = [l for l in self.offline_layers + self.disabled_layers if not 1 <= l < self.num_layers]
        if bad:
            raise ValueError(f"schedule layers {bad} out of range: predictor layers are 1..{self.num_layers - 1}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"schedule not found: {path}")
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path}: not a valid schedule ({e})") from None

    @classmethod
    def all_layers(cls, num_layers: int, **kw) -> Schedule:
        """A predictor after every layer but the last (profiling)."""
        return cls(num_layers=num_layers, offline_layers=list(range(1, num_layers)), window=0, **kw)


def select_offline_layers(exit_histogram: Sequence[int], num_predictors: int,
                          disabled: Sequence[int] = ()) -> list[int]:
    """The update rule: the num_predictors layers with the most exits (none of `disabled`).

    exit_histogram[i] counts tokens that exited with i + 1 layers run (length L; the last
    entry, full depth, is not a candidate). Ties go to the shallower layer, which saves more.
    """
    counts = list(exit_histogram)[:-1]
    ranked = sorted((i for i in range(len(counts)) if i + 1 not in set(disabled)), key=lambda i: (-counts[i], i))
    return sorted(i + 1 for i in ranked[:num_predictors])


def retune(schedule: Schedule, exit_histogram: Sequence[int], min_tokens: int = 1) -> Schedule:
    """The next schedule version from live exit statistics (same rule as offline profiling).
    Keeps the schedule when fewer than min_tokens exits were seen."""
    if len(exit_histogram) != schedule.num_layers:
        raise ValueError(f"exit histogram has {len(exit_histogram)} bins, expected {schedule.num_layers}")
    if sum(exit_histogram[:-1]) < min_tokens:
        return schedule
    layers = select_offline_layers(exit_histogram, len(schedule.offline_layers), schedule.disabled_layers)
    return replace(schedule, offline_layers=layers, version=schedule.version + 1, source="retune")


def disable_layers(schedule: Schedule, layers: Sequence[int], source: str = "audit") -> Schedule:
    """The next version with `layers` closed to exits (the audit's tightening)."""
    return replace(schedule, disabled_layers=sorted(set(schedule.disabled_layers) | set(layers)),
                   version=schedule.version + 1, source=source)


@dataclass
class OnlineWindow:
    """Per-row online level: the active set is offline ∪ {recent exit + offset}."""
    schedule: Schedule
    recent: deque = field(default_factory=deque)

    def push(self, exit_layer: int) -> None:
        self.recent.append(exit_layer)
        while len(self.recent) > self.schedule.window:
            self.recent.popleft()

    def active_layers(self) -> set[int]:
        s = self.schedule
        active = set(s.offline_layers)
        for l in self.recent:
            for o in s.offsets:
                if 1 <= l + o < s.num_layers:
                    active.add(l + o)
        return active - set(s.disabled_layers)


@dataclass(frozen=True)
class PayOffCosts:
    """What SpecEE's steps cost here, timed once per engine and options: a SpecEE step's extra work (draft
    head, predictors) as a share of a dense step, and the share of a dense step spent in decoder layers."""
    overhead: float
    layer_share: float

    def pays(self, skipped_per_step: float, num_layers: int) -> bool:
        """Whether skipping this many layers per step saves more than the extra work costs."""
        return skipped_per_step / num_layers * self.layer_share > self.overhead


class PayOffGate:
    """Whether SpecEE steps pay for their draft head and predictors on the machine at hand (a third level
    of scheduling, over whole steps); one per batch.

    SpecEE steps run in windows of `window` steps. After a window, the layers its exits skipped per
    step are weighed against PayOffCosts: if they do not pay, `backoff` dense steps follow (every layer,
    no draft, no predictors), doubling up to `max_backoff` while SpecEE keeps losing; a window that pays
    resets the backoff; a window whose exits skipped nothing never pays. The costs are timed once per
    engine and options (`costs`, shared through
    `box`): the first window's SpecEE steps against `probe` dense steps after it. From then on the
    gate decides from the exits alone, so a batch's output does not depend on timing. Dense steps are
    exact: the gate never adds disagreement. Audited steps (exited rows run every layer on purpose)
    count the layers their exits would have skipped, and are not timed.

    `prior_skip`: the layers per step the exits at these thresholds skip on the calibration tokens
    (None: unknown). Where they would not pay for the costs (and where they are 0: nothing to pay
    with, costs or not), the batch starts with `max_backoff` dense steps, then checks its own exits in
    a window: a short generation whose exits cannot pay runs as fast as dense."""

    def __init__(self, box: dict, num_layers: int, window: int = 16, probe: int = 4, backoff: int = 16,
                 max_backoff: int = 256, prior_skip: float | None = None):
        if min(window, probe, backoff) < 1 or max_backoff < backoff:
            raise ValueError("window, probe and backoff must be >= 1 and max_backoff >= backoff")
        self.box, self.num_layers = box, num_layers  # box["costs"]: the engine's PayOffCosts, once timed
        self.window, self.probe, self.backoff, self.max_backoff = window, probe, backoff, max_backoff
        self.mode, self._left, self._next_backoff = "specee", window, backoff
        self.dense_steps = self.specee_steps = 0
        self._skipped = 0.0  # layers skipped by the window's exits
        self._spec: list[float] = []  # the window's step times (timing the costs)
        self._dense: list[tuple[float, float]] = []  # probe steps: (seconds, seconds in layers)
        self._probing = False
        costs = self.costs
        if prior_skip is not None and (prior_skip <= 0 or (costs is not None and not costs.pays(prior_skip, num_layers))):
            self._go("dense", max_backoff)
            self._next_backoff = max_backoff

    @property
    def costs(self) -> PayOffCosts | None:
        return self.box.get("costs")

    def dense_next(self) -> bool:
        return self.mode == "dense"

    def record_specee(self, skipped: float, seconds: float | None) -> None:
        """A SpecEE step whose exits skipped `skipped` layers took `seconds` (None: not timed)."""
        self.specee_steps += 1
        self._skipped += skipped
        if seconds is not None and self.costs is None:
            self._spec.append(seconds)
        self._left -= 1
        if self._left > 0:
            return
        if self.costs is None and self._spec:
            self._probing = True
            self._go("dense", self.probe)
        else:
            self._decide()

    def record_dense(self, seconds: float, layer_seconds: float) -> None:
        self.dense_steps += 1
        if self._probing:
            self._dense.append((seconds, layer_seconds))
        self._left -= 1
        if self._left > 0:
            return
        if self._probing:
            self._probing = False
            self._time_costs()
            self._decide()
        else:
            self._go("specee", self.window)

    def _time_costs(self) -> None:
        if "costs" in self.box:  # another batch timed them meanwhile
            return
        dense = statistics.median(t for t, _ in self._dense)
        layer_share = min(1.0, statistics.median(lt / t for t, lt in self._dense))
        spec = statistics.median(self._spec)
        skipped = self._skipped / max(self.window, 1)  # this window's exits made its steps cheaper: add it back
        overhead = spec / dense - 1 + skipped / self.num_layers * layer_share
        self.box["costs"] = PayOffCosts(overhead=overhead, layer_share=layer_share)

    def _decide(self) -> None:
        skipped, steps = self._skipped, self.window
        self._skipped = 0.0
        costs = self.costs
        if skipped > 0 and (costs is None or costs.pays(skipped / steps, self.num_layers)):
            self._next_backoff = self.backoff
            self._go("specee", self.window)
        else:
            self._go("dense", self._next_backoff)
            self._next_backoff = min(2 * self._next_backoff, self.max_backoff)

    def _go(self, mode: str, steps: int) -> None:
        self.mode, self._left = mode, steps
