"""The contract between the engine's decode loop and a decode step.

The engine core owns every row's state (specee_core.step.state.Batch: tokens, positions, the token
to feed next, finish); a stepper decides what the next tokens are and returns them in a StepOutput,
which the core commits. A stepper reads the batch but never writes to it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from specee_core.step.state import Batch, StepOutput  # noqa: F401 -- StepOutput: part of this contract

if TYPE_CHECKING:
    from specee_core.model.kv_cache import KVCache
    from specee_core.model.model import DecoderModel


class StepEngine(Protocol):
    """What a stepper (and a proposer) may read of the engine that builds it: the model. The engine
    (specee_core.decode.engine.SpecEEEngine) is one; steppers do not import it."""

    @property
    def model(self) -> DecoderModel: ...


class Stepper(Protocol):
    """Decode steps of one lane's rows. Built once per lane by a StepperFactory over rows that are all
    free; each prompt then joins through admit."""

    def step(self, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
        """One step for the batch rows `alive`; rows [N] (device) indexes them in the KV cache, None
        when every cache row is alive. Each row's token is chosen by its own sampling (Batch.choose)."""
        ...

    def row_stats(self, b: int) -> dict:
        """Statistics of batch row b for its GenerationResult.stats."""
        ...

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        """Batch rows `rows` now hold new prompts (or resumed rows), prefilled: prefill_hidden [N, T, D] of
        each row's context (Batch.context) right-padded, lens [N]; the batch already has their first token
        and last hidden state. Forget what the rows held before."""
        ...

    def caches(self) -> list[KVCache]:
        """The KV caches it keeps beside the target's (a draft head's): the engine core grows them with
        the target's and counts them in its memory budget."""
        ...


class StepperFactory(Protocol):
    def __call__(self, engine: StepEngine, batch: Batch, cache: KVCache, prefill_hidden: torch.Tensor,
                 lens: torch.Tensor) -> Stepper:
        """The stepper of a lane of B rows (batch), cache its KV; prefill_hidden [B, T, D] and lens [B] describe
        what the rows hold at construction (the engine core builds lanes empty: T = 1, lens 1)."""
        ...
