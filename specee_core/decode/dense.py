"""mode="dense": the decode step that runs every layer for one token per row."""
from __future__ import annotations

import torch

from specee_core.step.dense import dense_step
from specee_core.step.state import Batch
from specee_core.step.stepper import StepEngine, StepOutput


class DenseStepper:
    """One token per row per step through every layer."""

    def __init__(self, engine: StepEngine, batch: Batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor):
        self.model, self.batch, self.cache = engine.model, batch, cache

    def step(self, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
        return dense_step(self.model, self.batch, self.cache, alive, rows)

    def row_stats(self, b: int) -> dict:
        return {}

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        pass  # no per-row state

    def caches(self) -> list:
        return []
