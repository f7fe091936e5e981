"""The contract between the engine's decode loop and a decode step.

The engine owns every row's state (tokens, positions, the token to feed next, finish); a stepper
decides what the next tokens are and returns them in a StepOutput, which the engine commits. A
stepper reads the batch but never writes to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specee_core.decode.state import Batch
    from specee_core.model.kv_cache import KVCache
    from specee_core.model.model import LlamaModel


@dataclass
class StepOutput:
    """What one decode step decided for the alive rows it was given (in that order)."""
    tokens: list[list[int]]  # per row: the tokens decided this step, in order (one, or a verified block)
    layers: list[list[int]]  # per row: the layers each of those tokens ran (num_layers = all)
    # [N, D] per row: the hidden state (before the final norm) whose logits chose the row's last token;
    # None when the stepper keeps its own features (the engine's copy is then left as it was)
    hidden: torch.Tensor | None = None
    # [N, D] the final-normed hidden state the last token was chosen from, where the stepper's differs from
    # final_norm(hidden) or it keeps no hidden (early exit: the exit layer's); measurement reads it, the engine not
    normed: torch.Tensor | None = None


class StepEngine(Protocol):
    """What a stepper (and a proposer) may read of the engine that builds it: the model. The engine
    (specee_core.decode.engine.SpecEEEngine) is one; steppers do not import it."""

    @property
    def model(self) -> LlamaModel: ...


class Stepper(Protocol):
    """Decode steps of one batch. Built once per batch by a StepperFactory after the prefill."""

    def step(self, alive: list[int], rows: torch.Tensor | None, generator: torch.Generator | None) -> StepOutput:
        """One step for the batch rows `alive`; rows [N] (device) indexes them in the KV cache, None
        when every cache row is alive."""
        ...

    def row_stats(self, b: int) -> dict:
        """Statistics of batch row b for its GenerationResult.stats."""
        ...

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        """Continuous batching: batch rows `rows` now hold new prompts, prefilled (prefill_hidden [N, T, D]
        right-padded, lens [N]; the batch already has their first token and last hidden state). Forget
        what the rows held before and start them as the constructor starts a batch's rows."""
        ...


class StepperFactory(Protocol):
    def __call__(self, engine: StepEngine, batch: Batch, cache: KVCache, prefill_hidden: torch.Tensor,
                 lens: torch.Tensor) -> Stepper:
        """prefill_hidden [B, T, D]: the prefill's last hidden states (right-padded); lens [B]."""
        ...
