"""A request to the engine core (prompts with one mode and sampling parameters; per prompt one result) and a
row (one prompt of a request in a lane's batch, or waiting, or preempted)."""
from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from specee_core.step.sampling import SamplingParams, row_key
from specee_core.step.state import GenerationResult, PromptError, SavedRow
from specee_core.step.stepper import StepperFactory

_REQUEST_IDS = itertools.count()


@dataclass(eq=False)
class Request:
    """Prompts (token ids) decoded with one mode and sampling parameters; per prompt one result.
    on_token(prompt index, token id) is called on the engine thread for every chosen token; if it
    raises, the request is cancelled with that error; with params.logprobs set it gets a third argument,
    the token's logprob entry (sampling.logprob_entries). stepper: (factory, KV headroom) of a custom
    decode step (measurement probes), instead of the mode's."""
    prompt_ids: list[list[int]]
    params: SamplingParams
    mode: str = "auto"
    spec: dict | None = None
    max_disagreement: float | None = None  # specee: calibrated thresholds for this tolerance
    on_token: Callable[[int, int], None] | None = None
    on_done: Callable[[Request], None] | None = None  # on the engine thread, once, when results or error are set
    stepper: tuple[StepperFactory | None, int] | None = None
    # admission: requests of a lower priority take free rows first, each as far as it goes; equal priorities
    # take one row each in turn (a batch job's earlier batch finishes first, Serve's requests share fairly)
    priority: int = 0
    results: list[GenerationResult | None] = field(init=False)
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    peak_batch: int = 0  # the most rows that decoded in one step with one of this request's

    def __post_init__(self) -> None:
        self.uid = next(_REQUEST_IDS)
        if not self.prompt_ids:
            raise PromptError("a request needs at least one prompt")
        self.results = [None] * len(self.prompt_ids)
        self.waiting: deque[int] = deque(range(len(self.prompt_ids)))  # prompt indices not yet in a lane
        self.running = 0  # prompts in lanes (prefilling or decoding) or preempted
        self.done = False
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop this request's rows at the next step boundary (any thread)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @functools.cached_property
    def lane_key(self) -> tuple:
        """Requests with equal keys share decode steps: the step's kind, not the sampling (computed once:
        admission compares it often)."""
        custom = None if self.stepper is None else ("stepper", id(self.stepper[0]))
        spec = tuple(sorted((self.spec or {}).items()))
        return (self.mode, spec, self.max_disagreement, custom)


@dataclass(eq=False)
class Row:
    """A prompt of a request, in a lane row or preempted."""
    request: Request
    index: int  # which prompt of the request
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)  # what its prefill computes: the prompt, or a resumed context
    done_tokens: int = 0  # of those, prefilled (or found in the prefix cache) so far
    hidden: list[torch.Tensor] = field(default_factory=list)  # [T_chunk, D] per prefill chunk
    cached: int = 0  # prompt tokens found in the prefix cache, first admission
    saved: SavedRow | None = None  # a preempted row's tokens
    computing: list[bytes] = field(default_factory=list)  # prefix-cache keys of the blocks its prefill computes
    resume_after: int = 0  # a preempted row waits until the core has finished more rows than this
    admitted: int = 0  # admission order (preemption takes the latest)
    key: int = 0  # its sampling key (sampling.row_key): of its seed, else drawn once, kept through preemption

    def __post_init__(self) -> None:
        if not self.key:
            self.key = row_key(self.request.params.seed)


class CancelledRequest(Exception):
    """A request cancelled before it finished."""
