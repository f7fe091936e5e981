"""A Serve request's way through one replica: admission (running plus queued, else 429 with Retry-After), its
engine work (a prompt per choice, seeded choices as requests of their own) and the submitted requests' one future."""
import asyncio
import math
import time
from dataclasses import dataclass
from functools import partial

from specee_core.decode.request import Request as EngineRequest
from specee_core.decode.runner import Runner
from specee_core.decode.engine import MODES
from specee_core.step.sampling import SamplingParams
from pipeline.openai_protocol import APIError
from pipeline.sampling import choice_params


def sampling_params(params: dict) -> SamplingParams:
    """The engine's SamplingParams of a request's sampling() dict (ValueError for a value it refuses)."""
    p = {k: v for k, v in params.items() if k != "max_disagreement"}
    return SamplingParams(**{**p, "stop": list(p["stop"]), "stop_token_ids": list(p["stop_token_ids"])})


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, params is a dict
class Work:
    """One request's engine work: a prompt per choice (each prompt n times in a row) and its sampling."""
    prompts: tuple[str, ...]
    params: dict  # OpenAIRequest.sampling(): SamplingParams fields and max_disagreement
    mode: str
    ids: tuple = ()  # the prompts' token ids (what the engine runs)

    def engine_requests(self, on_token=None) -> list[EngineRequest]:
        """The engine requests that run this work: one for all choices, or, when sampling with a seed,
        one per choice seeded with seed + its index (as vLLM does): a row's draws are keyed by its seed, so
        each choice is its own and the same whatever runs beside it (n, the other prompts, preemption)."""
        params = sampling_params(self.params)
        kw = {"max_disagreement": self.params.get("max_disagreement")}
        ids = [list(i) for i in self.ids]
        if params.seed is None or params.greedy or len(ids) == 1:
            return [EngineRequest(ids, params, self.mode, on_token=on_token, **kw)]
        return [EngineRequest([row], choice_params(params, k), self.mode,
                              on_token=None if on_token is None else partial(_shifted, on_token, k), **kw)
                for k, row in enumerate(ids)]


def _shifted(on_token, k: int, i: int, *rest) -> None:
    """on_token of the engine request that runs choice k alone: its prompt 0 is the work's choice k."""
    on_token(k + i, *rest)


class Submitted:
    """A Work's engine requests, submitted together to the runner: one future of all their results in
    the work's order; cancel() stops every one."""

    def __init__(self, runner: Runner, requests: list[EngineRequest]):
        self.requests = requests
        futures = []
        try:
            for r in requests:
                futures.append(asyncio.wrap_future(runner.submit(r)))
        except BaseException:
            self.cancel()
            raise
        self.future = asyncio.gather(*futures)

    async def results(self) -> list:
        return self.joined(await self.future)

    @staticmethod
    def joined(parts: list[list]) -> list:
        """The requests' results (one list each) as the work's, in its order."""
        return [r for part in parts for r in part]

    def cancel(self) -> None:
        for r in self.requests:
            if not r.done:
                r.cancel()

    @property
    def peak_batch(self) -> int:
        return max(r.peak_batch for r in self.requests)


def pick_mode(requested: str | None, *, has_predictors: bool) -> str:
    """The decode mode to run: `requested` when given, else auto (lossless on every model: without a
    draft head it drafts by prompt lookup). ValueError for a requested mode the model cannot run."""
    if requested is None:
        return "auto"
    if requested not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {requested!r}")
    if requested == "specee" and not has_predictors:
        raise ValueError("mode 'specee' is not available: this model has no predictors")
    return requested


class Admission:
    """Requests admitted into a replica: up to `running` (a batch) plus `queued` waiting; beyond
    that a request gets 429 with Retry-After, from the mean request time seen so far."""

    def __init__(self, running: int, queued: int):
        self.capacity = running + queued
        self.running = running
        self.active = 0
        self.mean_s = 1.0  # exponential average of admitted requests' seconds

    def enter(self) -> "Ticket":
        if self.active >= self.capacity:
            waiting = self.active - self.running + 1
            retry = min(60, max(1, math.ceil(self.mean_s * waiting / self.running)))
            raise APIError(f"the server has {self.active} requests in hand (at most {self.capacity}): retry in "
                           f"{retry} s", status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(retry)})
        self.active += 1
        return Ticket(self)

    def leave(self, seconds: float) -> None:
        self.active -= 1
        self.mean_s += 0.1 * (seconds - self.mean_s)


class Ticket:
    """One admitted request; released exactly once (explicitly, or when a stream that never ran is
    garbage-collected)."""

    def __init__(self, admission: Admission):
        self.admission, self.t0, self.done = admission, time.monotonic(), False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.admission.leave(time.monotonic() - self.t0)
