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
