"""The dense step: one token per row through every layer. Mode dense runs it (specee_core.decode.dense), and so do
the dense steps of modes auto and spec (specee_core.spec.spec_decode)."""
from __future__ import annotations

import torch

from specee_core.step.state import Batch, StepOutput


def dense_step(model, batch: Batch, cache, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
    """The dense step: one token per alive row through every layer, each row's token chosen by its own sampling;
    StepOutput.hidden holds the rows' hidden states [N, D] before the final norm. Every stepper's dense step is
    this one (mode dense, and the dense steps of modes auto and spec)."""
    fed, positions = batch.fed(alive, rows)
    h = model.forward(fed[:, None], positions.to(model.device)[:, None], cache, rows)[:, 0]  # [N, D]
    logits = model.logits(h)
    toks = batch.choose(batch.processed(logits, alive), alive).tolist()
    return StepOutput([[t] for t in toks], [[model.num_layers]] * len(alive), h,
                      logprobs=batch.step_logprobs(logits, alive, toks))
