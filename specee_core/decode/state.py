"""Per-row decode state shared by the engine's decode loop and the decode steps: the engine owns and
writes a Batch (tokens, positions, the token to feed next, finish); steppers and proposers only read it.
Below both, so neither imports the other for it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specee_core.decode.sampling import SamplingParams
from specee_core.decode.stops import StopMatcher


@dataclass
class Batch:
    """Decode state of one generate() batch. Row b of every tensor is prompt b of the batch."""
    prompt_ids: list[list[int]]
    params: SamplingParams
    max_new: list[int]  # per row, clipped to the context
    generated: list[list[int]]
    exit_layers: list[list[int]]
    finish: list[str | None]
    texts: list[str | None]  # the text cut at a stop string; None = decode the tokens
    positions: torch.Tensor  # [B] host: position of the next token to feed = len(prompt) + len(generated) - 1
    next_tokens: torch.Tensor  # [B] device: the token to feed next
    last_hidden: torch.Tensor | None = None  # [B, D] hidden state of the last fed token (draft heads use it)
    t_first: float = 0.0
    t_done: list[float] = field(default_factory=list)
    on_token: Callable[[int, int], None] | None = None
    mode: str = "dense"
    stop_matchers: list[StopMatcher] = field(init=False)  # per row: the stop-string search of its text

    def __post_init__(self) -> None:
        self.stop_matchers = [StopMatcher(self.params.stop) for _ in self.prompt_ids]

    def alive(self) -> list[int]:
        return [b for b, f in enumerate(self.finish) if f is None]
