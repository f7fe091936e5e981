"""Several batches in flight over one engine (pipeline.stage.GenerateRows with max_concurrent_batches > 1).

Each batch's rows are handed to the engine core (SpecEEEngine.submit) from its own thread and share decode
steps with the rows of the other batches in flight: a batch returns when its last row finishes, while the
rows of the next ones already fill the rows it leaves. Two things must not overlap other batches' rows, and
EngineGate holds them apart:
- a new SpecEE schedule: a lane's exit layers are fixed when it opens, and each row records the version it
  ran with, so a version is applied only once the rows in flight are done (the batches behind it wait);
- a batch whose engine call raised runs its rows again one at a time, alone: with other batches' rows
  beside it a row would fail for a neighbour's fault (a failed step costs its whole lane), or cost them.

PlanSteps counts mode auto's planned steps: each lane's planner keeps running totals, and a lane lives on
across batches, so per-row totals cannot be summed."""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Callable, Iterator


class EngineGate:
    """Shared use of the engine by the batches in flight; exclusive use waits for them to finish, and new
    shared users wait behind it (so that it cannot starve). on_idle() runs, under the gate's lock, each time
    the last user leaves: nothing of this process's is decoding then. (pipeline.processor.EngineRows holds
    the actor's calls in place and its quarantine apart with one too.)"""

    def __init__(self, on_idle: Callable[[], None] | None = None):
        self._cond = threading.Condition()
        self._shared = 0  # batches whose rows are in the engine now
        self._exclusive = False
        self._queued = 0  # exclusive users waiting: shared users queue behind them
        self._on_idle = on_idle
        self.peak = 0  # the most shared users at once

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._queued)
            self._shared += 1
            self.peak = max(self.peak, self._shared)
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._left()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._queued += 1
            try:
                self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._queued -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._left()

    def _left(self) -> None:
        if not self._shared and not self._exclusive:
            if self._on_idle is not None:
                self._on_idle()
            self._cond.notify_all()


class PlanSteps:
    """Mode auto's steps by plan ("dense", "depth_2", ...) over an engine's life, from its rows' results.

    A result's stats["plan_steps"] are its lane planner's running totals when the row finished
    (stats["lane"] names the lane), so only each lane's latest totals count. Lanes that ended are folded into
    one Counter whenever the engine is idle (EngineGate's on_idle: every lane has ended then), so memory stays
    bounded by the lanes of one busy stretch."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ended: Counter = Counter()
        self._lanes: dict[int, dict[str, int]] = {}  # lane -> its planner's latest totals

    def add(self, results) -> None:
        """Take the planner totals of these GenerationResults (those without: not planned)."""
        with self._lock:
            for r in results:
                steps, lane = r.stats.get("plan_steps"), r.stats.get("lane")
                if steps is None:
                    continue
                if lane is None:  # no lane named: totals of a planner of its own
                    self._ended.update(steps)
                    continue
                seen = self._lanes.get(lane)
                if seen is None or sum(steps.values()) > sum(seen.values()):  # results come back in any order
                    self._lanes[lane] = dict(steps)

    def fold(self) -> None:
        """The lanes seen so far have ended (the engine is idle): keep their sum only."""
        with self._lock:
            for steps in self._lanes.values():
                self._ended.update(steps)
            self._lanes.clear()

    def totals(self) -> dict[str, int]:
        with self._lock:
            out = Counter(self._ended)
            for steps in self._lanes.values():
                out.update(steps)
            return dict(sorted(out.items()))
