"""Continuous (iteration-level) batching: requests join the running batch at step boundaries and
leave it when they finish, in every decode mode.

A *lane* is a batch that lives across requests: `slots` rows over one KV cache, one Batch (the
engine's per-row state) and one stepper, for the requests that can share decode steps (same mode,
spec options and sampling parameters; max_tokens and stop strings are per row). A prompt joins a
lane in a free slot: its prefill runs in chunks of at most `prefill_chunk` tokens per iteration, so
a long prompt does not stall the rows decoding beside it; when it is whole, the prompt's first token
is sampled and the stepper admits the row (`Stepper.admit`: its draft cache, online window, ...).
Each iteration then runs one decode step over every decoding row of every lane. A finished row's
slot is free for the next prompt at once.

Admission is fair per request: free rows go round-robin to the requests with prompts waiting, so a
request of 1000 prompts takes one row in turn with every other request, not all of them.
Lanes are sized by the longest sequence they may hold (a power of two, at least `min_len`); an
emptied lane of up to IDLE_MAX_LEN_FACTOR x min_len is kept for reuse (up to `idle_lanes` of them, the
oldest dropped first), so a steady stream of requests does not allocate a KV cache each, while the
memory of lanes for long sequences goes back as soon as they empty.

Not thread-safe: one thread runs `step()`; other threads hand requests over through `submit` (a
queue) and stop them with `Request.cancel()`.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import torch

from specee_core.decode.engine import DenseStepper, GenerationResult, PromptError, SpecEEEngine
from specee_core.decode.sampling import SamplingParams, sample
from specee_core.decode.state import Batch
from specee_core.decode.stops import StopMatcher

log = logging.getLogger(__name__)

IDLE_MAX_LEN_FACTOR = 4  # emptied lanes up to 4 x min_len long are kept for reuse
FREE = "free"  # Batch.finish of an empty slot (not None: not alive)
_REQUEST_IDS = itertools.count()
PREFILL = "prefill"  # ... of a slot whose prompt is still being prefilled


@dataclass(eq=False)
class Request:
    """Prompts (token ids) decoded with one mode and sampling parameters; per prompt one result.
    on_token(prompt index, token id) is called on the engine thread for every chosen token; if it
    raises, the request is cancelled with that error."""
    prompt_ids: list[list[int]]
    params: SamplingParams
    mode: str = "auto"
    spec: dict | None = None
    max_disagreement: float | None = None  # specee: calibrated thresholds for this tolerance
    on_token: Callable[[int, int], None] | None = None
    on_done: Callable[[Request], None] | None = None  # on the engine thread, once, when results or error are set
    results: list[GenerationResult | None] = field(init=False)
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _waiting: deque = field(init=False)  # prompt indices not yet in a lane
    _running: int = 0  # prompts in lanes (prefilling or decoding)
    _done: bool = False
    peak_batch: int = 0  # the most rows that decoded in one step with one of this request's

    def __post_init__(self) -> None:
        self.uid = next(_REQUEST_IDS)
        if not self.prompt_ids:
            raise PromptError("a request needs at least one prompt")
        self.results = [None] * len(self.prompt_ids)
        self._waiting = deque(range(len(self.prompt_ids)))

    def cancel(self) -> None:
        """Stop this request's rows at the next step boundary (any thread)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._done

    def lane_key(self) -> tuple:
        """Requests with equal keys can share decode steps."""
        p = self.params
        greedy = p.temperature == 0
        seed = ("seeded", self.uid) if (p.seed is not None and not greedy) else None  # one generator per lane
        spec = tuple(sorted((self.spec or {}).items()))
        sampling = (0.0, 1.0, 0) if greedy else (p.temperature, p.top_p, p.top_k)
        return (self.mode, spec, self.max_disagreement, *sampling, p.ignore_eos, seed)


@dataclass(eq=False)
class Row:
    """A prompt in a lane slot."""
    request: Request
    index: int  # which prompt of the request
    prompt: list[int]
    max_new: int
    t0: float  # when it entered the lane
    done_tokens: int = 0  # prompt tokens prefilled so far
    hidden: list[torch.Tensor] = field(default_factory=list)  # [T_chunk, D] per prefill chunk
    t_first: float = 0.0


class Lane:
    def __init__(self, engine: SpecEEEngine, key: tuple, request: Request, slots: int, max_len: int):
        self.engine, self.key, self.slots, self.max_len = engine, key, slots, max_len
        m = engine.model
        p = request.params
        # the lane's params: sampling and ignore_eos shared, max_new_tokens and stops per row
        self.params = SamplingParams(max_new_tokens=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                     seed=p.seed, ignore_eos=p.ignore_eos)
        self.generator = None if p.seed is None else torch.Generator(device=m.device).manual_seed(p.seed)
        self.mode = request.mode
        factory, self.headroom = engine.stepper_factory(request.mode, request.spec, request.max_disagreement)
        self.cache = m.new_cache(slots, max_len)
        dev = m.device
        self.batch = Batch(prompt_ids=[[] for _ in range(slots)], params=self.params, max_new=[0] * slots,
                           generated=[[] for _ in range(slots)], exit_layers=[[] for _ in range(slots)],
                           finish=[FREE] * slots, texts=[None] * slots, positions=torch.zeros(slots, dtype=torch.int64),
                           next_tokens=torch.zeros(slots, dtype=torch.int64, device=dev),
                           last_hidden=torch.zeros(slots, m.config.hidden_size, dtype=m.dtype, device=dev),
                           t_done=[0.0] * slots, on_token=self._on_token, mode=request.mode)
        # a stepper over no prompt yet: rows are admitted one by one
        empty = torch.zeros(slots, 1, m.config.hidden_size, dtype=m.dtype, device=dev)
        self.stepper = (factory or DenseStepper)(engine, self.batch, self.cache, empty, torch.ones(slots, dtype=torch.int64))
        self.rows: dict[int, Row] = {}
        self.failed = False  # a step raised: the lane is dropped once its rows are out

    def reusable(self, max_len: int) -> bool:
        """Whether to keep this emptied lane for the next requests of its key."""
        return not self.failed and self.max_len <= max_len and self.key[-1] is None  # seeded lanes: one request

    # ---- slots -----------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.rows]

    def fits(self, row_len: int) -> bool:
        return row_len + self.headroom <= self.max_len

    def place(self, row: Row) -> None:
        s = self.free_slots()[0]
        self.rows[s] = row
        self.batch.finish[s] = PREFILL
        self.cache.truncate(torch.tensor([s]), torch.zeros(1, dtype=torch.int64))

    def _on_token(self, s: int, tok: int) -> None:
        row = self.rows[s]
        req = row.request
        if req.on_token is not None and not req.cancelled:
            try:
                req.on_token(row.index, tok)
            except Exception as e:  # noqa: BLE001 -- the caller's callback: it ends its own request only
                req.error = req.error or e
                req.cancel()

    # ---- one iteration ---------------------------------------------------------------------------
    def prefill(self, budget: int) -> None:
        """Advance the prefilling rows by up to `budget` prompt tokens in all (one forward), oldest first;
        rows whose prompt is whole get their first token and join the decoding rows."""
        m, dev = self.engine.model, self.engine.device
        todo = []
        for s, row in sorted(self.rows.items(), key=lambda kv: kv[1].t0):
            if self.batch.finish[s] != PREFILL or budget <= 0:
                continue
            n = min(len(row.prompt) - row.done_tokens, budget)
            todo.append((s, row, n))
            budget -= n
        if not todo:
            return
        t = max(n for _, _, n in todo)
        tokens = torch.zeros(len(todo), t, dtype=torch.int64)
        positions = torch.zeros(len(todo), t, dtype=torch.int64)
        for r, (s, row, n) in enumerate(todo):
            tokens[r, :n] = torch.tensor(row.prompt[row.done_tokens : row.done_tokens + n])
            positions[r] = row.done_tokens + torch.arange(t)
        valid = torch.tensor([n for _, _, n in todo])
        slots = torch.tensor([s for s, _, _ in todo], device=dev)
        h = m.forward(tokens.to(dev), positions.to(dev), self.cache, slots, n_valid=valid)  # [N, t, D]
        whole = []
        for r, (s, row, n) in enumerate(todo):
            row.hidden.append(h[r, :n])
            row.done_tokens += n
            if row.done_tokens == len(row.prompt):
                whole.append((s, row))
        if whole:
            self._start_rows(whole)

    def _start_rows(self, whole: list[tuple[int, Row]]) -> None:
        m, b = self.engine.model, self.batch
        slots = [s for s, _ in whole]
        lens = torch.tensor([len(row.prompt) for _, row in whole])
        t = int(lens.max())
        hidden = torch.zeros(len(whole), t, m.config.hidden_size, dtype=m.dtype, device=m.device)
        for r, (_, row) in enumerate(whole):
            hidden[r, : len(row.prompt)] = torch.cat(row.hidden)
            row.hidden = []
        last = hidden[torch.arange(len(whole)), lens - 1]  # [N, D]
        first = sample(m.logits(last), self.params, self.generator)
        now = time.perf_counter()
        idx = torch.tensor(slots, device=m.device)
        for r, (s, row) in enumerate(whole):
            b.prompt_ids[s] = row.prompt
            b.generated[s], b.exit_layers[s], b.texts[s] = [], [], None
            b.max_new[s] = row.max_new
            b.positions[s] = len(row.prompt)
            b.stop_matchers[s] = StopMatcher(row.request.params.stop)
            b.t_done[s] = 0.0
            b.finish[s] = None
            row.t_first = now
        b.next_tokens[idx] = first
        b.last_hidden[idx] = last
        self.stepper.admit(slots, hidden, lens)
        self.engine._record(b, slots, [[tok] for tok in first.tolist()], [[m.num_layers]] * len(slots))

    def decode(self) -> None:
        alive = self.batch.alive()
        if not alive:
            return
        for s in alive:
            req = self.rows[s].request
            req.peak_batch = max(req.peak_batch, len(alive))
        rows = None if len(alive) == self.slots else torch.tensor(alive, device=self.engine.device)
        self.engine._commit(self.batch, alive, rows, self.stepper.step(alive, rows, self.generator))

    def finished(self) -> list[tuple[Row, GenerationResult | None]]:
        """Rows that finished (with their results) or were cancelled (None), their slots freed."""
        out = []
        for s, row in list(self.rows.items()):
            fin = self.batch.finish[s]
            if row.request.cancelled:
                out.append((row, None))
            elif fin in ("stop", "length"):
                # latency and time to first token from the request's submission: waiting for a row counts
                out.append((row, self.engine._result(self.batch, s, row.request.submitted, self.stepper,
                                                     t_first=row.t_first)))
            else:
                continue
            del self.rows[s]
            self.batch.finish[s] = FREE
        return out


class Scheduler:
    """Runs Requests with continuous batching over one engine. `step()` is one iteration: take new
    requests, give free rows to waiting prompts (round-robin over requests), prefill a chunk per lane,
    one decode step per lane, hand out finished requests."""

    def __init__(self, engine: SpecEEEngine, max_rows: int = 8, prefill_chunk: int = 256, min_len: int = 256,
                 idle_lanes: int = 2, max_lanes: int = 4):
        if max_rows < 1 or prefill_chunk < 1 or min_len < 1 or idle_lanes < 0:
            raise ValueError("max_rows, prefill_chunk and min_len must be >= 1, idle_lanes >= 0")
        self.engine, self.max_rows, self.prefill_chunk, self.min_len = engine, max_rows, prefill_chunk, min_len
        self.idle_lanes = idle_lanes
        self.max_lanes = max_lanes  # lanes with rows at once (each holds max_rows slots of KV memory)
        self.idle: list[Lane] = []  # emptied lanes kept for reuse, oldest first
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.requests: deque[Request] = deque()  # with prompts waiting for a row, in turn order
        self.active: list[Request] = []  # every request not done
        self.lanes: list[Lane] = []
        self.steps = 0
        self.load = (0, 0)  # (rows in lanes, prompts waiting) after the last step: safe to read from any thread

    # ---- from any thread -------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request (validated here: ValueError / PromptError for what cannot run)."""
        self.engine.stepper_factory(request.mode, request.spec, request.max_disagreement)  # a mode or options the engine cannot run
        for i, p in enumerate(request.prompt_ids):
            if not p:
                raise PromptError(f"prompt {i} is empty")
            if len(p) >= self.engine.context_len:
                raise PromptError(f"prompt {i} has {len(p)} tokens; the context holds {self.engine.context_len}")
        self.inbox.put(request)
        return request

    # ---- the engine thread -----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.active) or not self.inbox.empty()

    def running_rows(self) -> int:
        return sum(len(lane.rows) for lane in self.lanes)

    def waiting_prompts(self) -> int:
        return sum(len(r._waiting) for r in self.requests)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One iteration; returns the requests that ended in it (results or error set)."""
        ended: list[Request] = []
        while not self.inbox.empty():
            req = self.inbox.get()
            self.active.append(req)
            self.requests.append(req)
        self._drop_cancelled()
        self._admit()
        for lane in list(self.lanes):
            try:
                lane.prefill(self.prefill_chunk)
                lane.decode()
            except Exception as e:  # noqa: BLE001 -- a failed step costs its lane's requests, not the others
                log.exception("a %s lane failed; its %d rows' requests fail", lane.mode, len(lane.rows))
                for row in lane.rows.values():
                    row.request.error = row.request.error or e
                    row.request.cancel()  # finished() below collects the rows and frees their slots
                lane.failed = True
            for row, result in lane.finished():
                req = row.request
                req._running -= 1
                if result is not None:
                    req.results[row.index] = result
            if not lane.rows:
                self.lanes.remove(lane)
                if lane.reusable(IDLE_MAX_LEN_FACTOR * self.min_len):  # long lanes give their memory back
                    self.idle.append(lane)
                    del self.idle[: max(0, len(self.idle) - self.idle_lanes)]
        self._settle(ended)
        self.steps += 1
        self.load = (self.running_rows(), self.waiting_prompts())
        return ended

    def _drop_cancelled(self) -> None:
        for req in self.requests:
            if req.cancelled:
                req._waiting.clear()
        self.requests = deque(r for r in self.requests if r._waiting)

    def _admit(self) -> None:
        """Free rows to waiting prompts, one per request in turn."""
        room = self.max_rows - self.running_rows()
        skipped = 0
        while room > 0 and self.requests and skipped < len(self.requests):
            req = self.requests[0]
            self.requests.rotate(-1)
            i = req._waiting[0]
            prompt = req.prompt_ids[i]
            max_new = min(req.params.max_new_tokens, self.engine.context_len - len(prompt))
            try:
                lane = self._lane_for(req, len(prompt) + max_new)
            except Exception as e:  # noqa: BLE001 -- e.g. no memory for its lane's KV cache: this request fails
                log.exception("no lane for a %s request", req.mode)
                req.error = req.error or e
                req.cancel()
                req._waiting.clear()
                self.requests = deque(r for r in self.requests if r is not req)
                continue
            if lane is None:  # every lane of its kind is full: the next request's turn
                skipped += 1
                continue
            skipped = 0
            req._waiting.popleft()
            req._running += 1
            lane.place(Row(req, i, prompt, max_new, time.perf_counter()))
            room -= 1
            if not req._waiting:
                self.requests = deque(r for r in self.requests if r is not req)

    def _lane_for(self, req: Request, row_len: int) -> Lane | None:
        key = req.lane_key()
        for lane in self.lanes:
            if lane.key == key and lane.fits(row_len) and lane.free_slots():
                return lane
        if any(lane.key == key and lane.fits(row_len) for lane in self.lanes):
            return None  # its lane is full
        for lane in self.idle:
            if lane.key == key and lane.fits(row_len):
                self.idle.remove(lane)
                self.lanes.append(lane)
                return lane
        if len(self.lanes) >= self.max_lanes:
            return None  # its turn comes when a lane empties
        _, headroom = self.engine.stepper_factory(req.mode, req.spec, req.max_disagreement)
        max_len = self.min_len
        while max_len < row_len + headroom:
            max_len *= 2
        while self.idle and len(self.lanes) + len(self.idle) >= self.max_lanes:
            self.idle.pop(0)  # the oldest idle lane's memory first
        lane = Lane(self.engine, key, req, self.max_rows, max_len)
        self.lanes.append(lane)
        return lane

    def _settle(self, ended: list[Request]) -> None:
        still = []
        for req in self.active:
            if req._waiting or req._running:
                still.append(req)
                continue
            if req.cancelled and req.error is None:
                req.error = CancelledRequest("the request was cancelled")
            req._done = True
            ended.append(req)
            if req.on_done is not None:
                try:
                    req.on_done(req)
                except Exception:  # noqa: BLE001 -- the caller's callback must not stop the others' requests
                    log.exception("on_done of a request failed")
        self.active = still

    def fail_all(self, error: BaseException) -> None:
        """End every request with `error` and drop the lanes (after a step failed outside a lane)."""
        self.lanes.clear()
        self.idle.clear()
        while not self.inbox.empty():
            self.active.append(self.inbox.get())
        for req in self.active:
            req.error = req.error or error
            req._waiting.clear()
            req._running = 0
            req.cancel()
        self.requests.clear()
        self._settle([])

    def run(self, request: Request) -> list[GenerationResult]:
        """Submit one request and step until it is done (single-threaded use, tests)."""
        self.submit(request)
        while not request.done:
            self.step()
        if request.error is not None:
            raise request.error
        return request.results


class CancelledRequest(Exception):
    """A request cancelled before it finished."""


class Watchdog:
    """What a health check needs of the thread that runs an engine: since when its current step or
    call runs, and whether the engine failed for good."""
    busy_what = "an engine call"

    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = stall_timeout_s
        self._busy_since: float | None = None
        self._fatal: str | None = None

    def check(self) -> None:
        """RuntimeError when the engine failed for good or the current step has run past stall_timeout_s."""
        if self._fatal:
            raise RuntimeError(f"engine failed: {self._fatal}")
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.stall_timeout_s:
            raise RuntimeError(f"{self.busy_what} has run for over {self.stall_timeout_s:.0f} s")


class Runner(Watchdog):
    """A Scheduler stepping on its own thread whenever it has work. submit() from any thread returns a
    concurrent Future of the request's results (asyncio: `asyncio.wrap_future`)."""
    busy_what = "a decode step"

    def __init__(self, scheduler: Scheduler, stall_timeout_s: float = 600.0):
        super().__init__(stall_timeout_s)
        self.scheduler = scheduler
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specee-continuous", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        fut: Future = Future()
        then = request.on_done

        def done(r: Request) -> None:
            try:
                if then is not None:
                    then(r)
            finally:
                try:
                    if r.error is not None:
                        fut.set_exception(r.error)
                    else:
                        fut.set_result(r.results)
                except InvalidStateError:  # cancelled by the caller (asyncio.wrap_future does, with its task)
                    pass

        request.on_done = done
        self.scheduler.submit(request)  # raises here for a request that cannot run
        self._wake.set()
        return fut

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # before looking for work: a submit after this sets it again
            while self.scheduler.busy:
                self._busy_since = time.monotonic()
                try:
                    self.scheduler.step()
                except BaseException as e:  # noqa: BLE001 -- a bug or out of memory: fail what is running, go on
                    log.exception("continuous batching step failed; failing %d requests", len(self.scheduler.active))
                    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
                        self._fatal = repr(e)
                    try:
                        self.scheduler.fail_all(e)
                    except BaseException as again:  # noqa: BLE001 -- nothing left to do: report it in check()
                        self._fatal = f"{e!r}, then {again!r}"
                        raise
                finally:
                    self._busy_since = None

    def check(self) -> None:
        super().check()
        if not self._thread.is_alive():
            raise RuntimeError("the continuous batching thread has stopped")
