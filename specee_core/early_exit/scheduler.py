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


@dataclass
class PayOffGate:
    """Whether SpecEE steps pay for their draft head and predictors on the machine at hand, measured
    while decoding (a third level of scheduling, over whole steps).

    SpecEE steps run in windows of `window` steps; dense steps (every layer, no draft, no
    predictors) in between time what a step costs without SpecEE: `probe` of them when a window
    ends without a dense time for its batch size, and again every `recheck` SpecEE steps. A window
    whose steps are not faster, in the median, than the dense steps of the same batch size is followed
    by `backoff` dense steps, doubling up to `max_backoff` while SpecEE keeps losing; a window that
    wins resets the backoff. Dense steps are exact, so the gate never adds disagreement; a SpecEE that
    does not pay costs only its losing windows. One gate serves every batch an engine decodes with
    these options (the verdict is the machine's, not the batch's); times are kept per batch size.
    Audited steps (which run exited rows to full depth on purpose) are not timed; a window with no
    timed step is followed by the next window."""
    window: int = 16
    probe: int = 4
    backoff: int = 16
    max_backoff: int = 256
    recheck: int = 128
    dense_steps: int = 0  # taken so far (statistics)
    specee_steps: int = 0
    mode: str = "specee"  # what the next step is
    _left: int = -1
    _next_backoff: int = -1
    _since_probe: int = 0
    _spec: list[tuple[float, int]] = field(default_factory=list)  # the window's (seconds, rows)
    _dense: dict[int, list[float]] = field(default_factory=dict)  # rows -> recent dense step seconds
    _decide_after: bool = False  # the current dense steps are a probe: decide when they end

    def __post_init__(self) -> None:
        if min(self.window, self.probe, self.backoff) < 1 or self.max_backoff < self.backoff:
            raise ValueError("window, probe and backoff must be >= 1 and max_backoff >= backoff")
        self._left, self._next_backoff = self.window, self.backoff

    def dense_next(self) -> bool:
        return self.mode == "dense"

    def record(self, seconds: float | None, rows: int = 1) -> None:
        """The step just taken (of kind `mode`, over `rows` rows) took `seconds` (None: not timed)."""
        self._left -= 1
        if self.mode == "dense":
            self.dense_steps += 1
            if seconds is not None:
                self._dense[rows] = (self._dense.get(rows, []) + [seconds])[-8:]
            if self._left <= 0:
                if self._decide_after:
                    self._decide()
                else:
                    self._go("specee", self.window)
            return
        self.specee_steps += 1
        self._since_probe += 1
        if seconds is not None:
            self._spec.append((seconds, rows))
        if self._left <= 0:
            if not self._spec:  # nothing timed (every step audited): nothing to compare
                self._go("specee", self.window)
            elif self._since_probe >= self.recheck or not any(n in self._dense for _, n in self._spec):
                self._since_probe, self._decide_after = 0, True
                self._go("dense", self.probe)
            else:
                self._decide()

    def _decide(self) -> None:
        import statistics

        self._decide_after = False
        spec, self._spec = self._spec, []
        ratios = [t / statistics.median(self._dense[n]) for t, n in spec if n in self._dense]
        if not ratios or statistics.median(ratios) < 1.0:
            self._next_backoff = self.backoff
            self._go("specee", self.window)
        else:
            self._go("dense", self._next_backoff)
            self._next_backoff = min(2 * self._next_backoff, self.max_backoff)

    def _go(self, mode: str, steps: int) -> None:
        self.mode, self._left = mode, steps
