"""mode="dense": the decode step that runs every layer for one token per row."""
from __future__ import annotations

import torch

from specee_core.step.state import Batch
from specee_core.step.stepper import StepEngine, StepOutput


class DenseStepper:
    """One token per row per step through every layer."""

    def __init__(self, engine: StepEngine, batch: Batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor):
        self.model, self.batch, self.cache = engine.model, batch, cache

    def step(self, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
        batch, m = self.batch, self.model
        fed, positions = batch.fed(alive, rows)
        h = m.forward(fed.unsqueeze(1), positions.unsqueeze(1).to(m.device), self.cache, rows)[:, 0]  # [N, D]
        logits = m.logits(h)
        toks = batch.choose(batch.processed(logits, alive), alive).tolist()
        return StepOutput([[t] for t in toks], [[m.num_layers]] * len(alive), h, logprobs=batch.step_logprobs(logits, alive, toks))

    def row_stats(self, b: int) -> dict:
        return {}

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        pass  # no per-row state

    def caches(self) -> list:
        return []
