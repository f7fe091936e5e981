"""The engine core: one scheduler and one decode loop over KV memory with a budget, for
`SpecEEEngine.generate`, the batch job's engine actors and the Serve replica alike.

Requests (prompts with one mode and sampling parameters) are queued; each `step()` is one iteration:
- admission: waiting prompts take free rows in turn per request (a request of 1000 prompts takes one
  row in turn with every other request), preempted rows first; a row is admitted when its lane has
  room for its prompt's blocks in the KV budget (else it waits);
- chunked prefill: at most `prefill_chunk` prompt tokens per lane per iteration, so a long prompt does
  not stall the rows decoding beside it; full prompt blocks found in the prefix cache are copied, not
  computed;
- one decode step for every decoding row, in every mode (the lane's stepper: dense, auto, spec,
  specee, T3);
- finishing: a settled row's result is handed to its request, its row freed at once.

A *lane* is the rows that can share decode steps: those of one mode and one set of spec / early-exit
options, whatever their sampling (every SamplingParams field is a row's own: specee_core.step.sampling): one KV cache (contiguous per row, so attention and the
fused decode kernel read it in place), one Batch (specee_core.step.state) and one stepper. Its cache
takes blocks from the budget (specee_core.decode.memory) as its rows grow. When a step would need
blocks the budget does not have (after evicting prefix blocks), the most
recently admitted row is preempted: its blocks are freed, its tokens kept, and it resumes by
prefilling its context again (a stream sends no token twice; a sampled row draws the same tokens after it:
its draws are keyed by its own seed and token index).

Not thread-safe except where said: one thread at a time runs `step()` (a lock makes `run()` from
another thread wait its turn); other threads hand requests over through `submit` (a queue) and stop
them with `Request.cancel()`.
"""
from __future__ import annotations

import functools
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

from specee_core.decode.dense import DenseStepper
from specee_core.decode.memory import HeapTrim, KVBudget, PrefixBlock, PrefixCache
from specee_core.step.sampling import SamplingParams, row_key
from specee_core.step.state import FREE, PREFILL, Batch, GenerationResult, PromptError, SavedRow
from specee_core.step.stepper import StepperFactory

log = logging.getLogger(__name__)

MIN_SLOTS = 256  # a new lane's first allocation per row (it grows from there)
WINDOW_HEADROOM = 64  # slots a sliding-window layer keeps beyond its window and a prompt chunk: a verified draft's
_REQUEST_IDS = itertools.count()
_ADMISSIONS = itertools.count()
_LANE_IDS = itertools.count()


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


class Lane:
    """Rows sharing decode steps over one KV cache that grows in blocks up to max_len slots per row."""

    def __init__(self, core: EngineCore, key: tuple, request: Request, slots: int, max_len: int, capacity: int):
        engine = core.engine
        self.core, self.key, self.slots, self.max_len = core, key, slots, max_len
        m = engine.model
        self.mode = request.mode
        factory, self.headroom = core.stepper_of(request)
        self.cache = m.new_cache(slots, capacity, core.window_room)
        dev = m.device
        self.batch = Batch.empty(slots, m.config.hidden_size, m.config.vocab_size, m.dtype, dev, engine.rules,
                                 request.mode, on_token=self._on_token)
        # a stepper over no prompt yet: rows are admitted one by one
        empty = torch.zeros(slots, 1, m.config.hidden_size, dtype=m.dtype, device=dev)
        self.stepper = (factory or DenseStepper)(engine, self.batch, self.cache, empty,
                                                 torch.ones(slots, dtype=torch.int64))
        self.caches = [self.cache, *self.stepper.caches()]
        self.rows: dict[int, Row] = {}
        self.failed = False  # a step raised: the lane is dropped once its rows are out
        self.uid = next(_LANE_IDS)  # results carry it (stats["lane"]): whose stepper's running totals they hold

    @property
    def capacity(self) -> int:
        """Slots per row allocated now."""
        return self.cache.max_len

    def blocks(self, budget: KVBudget, capacity: int | None = None) -> int:
        return self.slots * budget.blocks(self.capacity if capacity is None else capacity)

    def resize(self, capacity: int) -> None:
        for c in self.caches:
            c.resize(capacity)

    def need(self) -> int:
        """Slots per row the next iteration may write: a decoding row's length, its next token and the
        stepper's headroom (a verify chunk); a prefilling row's whole context and its first token."""
        b = self.batch
        alive = b.alive()
        need = int(b.positions[alive].max()) + 1 + self.headroom if alive else 0
        for s, row in self.rows.items():
            if b.finish[s] == PREFILL:
                need = max(need, len(row.tokens) + 1 + self.headroom)
        return need

    # ---- rows ------------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.rows]

    def fits(self, row_len: int) -> bool:
        return row_len + self.headroom <= self.max_len

    def place(self, row: Row, prefix: list[PrefixBlock]) -> None:
        """Row takes a free slot; prefix: cached blocks of its first tokens, copied into its KV."""
        s = self.free_slots()[0]
        self.rows[s] = row
        self.batch.reserve(s, row.request.params, row.key, row.prompt, row.saved.generated if row.saved else [])
        row.done_tokens, row.hidden = 0, []
        if prefix:
            self.cache.write_prefix(s, torch.cat([p.k for p in prefix], 2), torch.cat([p.v for p in prefix], 2))
            row.hidden = [torch.cat([p.hidden for p in prefix])]
            row.done_tokens = len(prefix) * self.core.budget.block_size
        else:
            self.cache.truncate(torch.tensor([s]), torch.zeros(1, dtype=torch.int64))
        if row.saved is None:
            row.cached = row.done_tokens

    def remove(self, s: int) -> Row:
        row = self.rows.pop(s)
        self.batch.release(s)
        self.core.computed(row)
        return row

    def _on_token(self, s: int, tok: int) -> None:
        row = self.rows[s]
        req = row.request
        if req.on_token is not None and not req.cancelled:
            try:
                if req.params.logprobs is None:
                    req.on_token(row.index, tok)
                else:  # the token's logprob entry too (Batch records it first)
                    req.on_token(row.index, tok, self.batch.logprobs[s][-1])
            except Exception as e:  # noqa: BLE001 -- the caller's callback: it ends its own request only
                req.error = req.error or e
                req.cancel()

    # ---- one iteration ---------------------------------------------------------------------------
    def prefill(self, budget: int) -> None:
        """Advance the prefilling rows by up to `budget` prompt tokens in all (one forward), oldest first;
        rows whose prompt is whole get their first token and join the decoding rows."""
        m, dev = self.core.engine.model, self.core.engine.device
        todo = []
        for s, row in sorted(self.rows.items(), key=lambda kv: kv[1].admitted):
            if self.batch.finish[s] != PREFILL or budget <= 0:
                continue
            n = min(len(row.tokens) - row.done_tokens, budget)
            todo.append((s, row, n))
            budget -= n
        if not todo:
            return
        t = max(n for _, _, n in todo)
        tokens = torch.zeros(len(todo), t, dtype=torch.int64)
        positions = torch.zeros(len(todo), t, dtype=torch.int64)
        for r, (s, row, n) in enumerate(todo):
            tokens[r, :n] = torch.tensor(row.tokens[row.done_tokens : row.done_tokens + n])
            positions[r] = row.done_tokens + torch.arange(t)
        valid = torch.tensor([n for _, _, n in todo])
        ids = [s for s, _, _ in todo]
        slots = None if ids == list(range(self.slots)) else torch.tensor(ids, device=dev)
        h = m.forward(tokens.to(dev), positions.to(dev), self.cache, slots, n_valid=valid)  # [N, t, D]
        whole = []
        for r, (s, row, n) in enumerate(todo):
            row.hidden.append(h[r, :n])
            row.done_tokens += n
            if row.done_tokens == len(row.tokens):
                whole.append((s, row))
        if whole:
            self._start_rows(whole)

    def _start_rows(self, whole: list[tuple[int, Row]]) -> None:
        m = self.core.engine.model
        slots = [s for s, _ in whole]
        lens = torch.tensor([len(row.tokens) for _, row in whole])
        t = int(lens.max())
        hidden = torch.zeros(len(whole), t, m.config.hidden_size, dtype=m.dtype, device=m.device)
        for r, (_, row) in enumerate(whole):
            hidden[r, : len(row.tokens)] = torch.cat(row.hidden)
            row.hidden = []
        last = hidden[torch.arange(len(whole)), lens - 1]  # [N, D]
        logits = m.logits(last)
        first = self.batch.choose(self.batch.processed(logits, slots, fresh=True), slots,
                                  [len(row.prompt) for _, row in whole])
        saved = [row.saved for _, row in whole]
        for r, (_, row) in enumerate(whole):  # a resumed row goes on with the token it had chosen
            if row.saved is not None:
                first[r] = row.saved.generated[-1]
        first_logprobs = self.batch.logprob_entries(logits, slots, first.tolist())
        self.batch.start(slots, [row.prompt for _, row in whole], [row.max_new for _, row in whole],
                         [row.request.params.stop for _, row in whole], first, last, saved, first_logprobs)
        for _, row in whole:
            row.saved = None
        self.stepper.admit(slots, hidden, lens)
        prefix = self.core.prefix
        if prefix is not None:
            for r, (s, row) in enumerate(whole):
                prefix.insert(row.tokens, lambda a, b, s=s, r=r: PrefixBlock(*self.cache.read_slots(s, a, b),
                                                                            hidden[r, a:b].clone(),
                                                                            self.cache.holds(s, a)))
        for _, row in whole:
            self.core.computed(row)

    def decode(self) -> None:
        alive = self.batch.alive()
        if not alive:
            return
        for s in alive:
            req = self.rows[s].request
            req.peak_batch = max(req.peak_batch, len(alive))
        rows = None if len(alive) == self.slots else torch.tensor(alive, device=self.core.engine.device)
        self.batch.commit(alive, rows, self.stepper.step(alive, rows))

    def finished(self) -> list[tuple[Row, GenerationResult | None]]:
        """Rows that finished (with their results) or were cancelled (None), their slots freed."""
        out = []
        for s, row in list(self.rows.items()):
            fin = self.batch.finish[s]
            if row.request.cancelled:
                out.append((row, None))
            elif fin in ("stop", "length"):
                # latency and time to first token from the request's submission: waiting for a row counts
                stats = {**self.stepper.row_stats(s), "lane": self.uid}
                out.append((row, self.batch.result(s, row.request.submitted, stats, row.cached)))
            else:
                continue
            self.remove(s)
        return out


class EngineCore:
    """Runs Requests with continuous batching over one engine within a KV budget of kv_bytes (blocks of
    block_size slots). `step()` is one iteration (see the module's docstring)."""

    def __init__(self, engine, max_rows: int = 8, prefill_chunk: int = 256, kv_bytes: int = 1 << 30,
                 block_size: int = 16, prefix_cache: bool = True, max_lanes: int = 4,
                 min_lane_rows: int | None = None):
        """min_lane_rows: the rows a new lane has at least (None: max_rows, room for requests that join
        later); fewer when fewer prompts of its kind wait, so a lane's rows are all decoding and its steps
        take the path without gathers (SpecEEEngine.generate's core: 1)."""
        if max_rows < 1 or prefill_chunk < 1 or max_lanes < 1:
            raise ValueError("max_rows, prefill_chunk and max_lanes must be >= 1")
        self.engine, self.max_rows, self.prefill_chunk = engine, max_rows, prefill_chunk
        self.max_lanes = max_lanes
        self.min_lane_rows = max_rows if min_lane_rows is None else min(min_lane_rows, max_rows)
        self.min_slots = MIN_SLOTS  # a new lane's first allocation per row, and the shortest max_len
        # what a sliding-window layer holds beyond its window: the most one forward writes (a prompt chunk, or a
        # verified draft)
        self.window_room = prefill_chunk + WINDOW_HEADROOM
        self.budget = KVBudget(kv_bytes, block_size, engine.slot_bytes(),
                               lambda slots: engine.row_bytes(slots, self.window_room))
        windows = [w for w in engine.model.windows if w]
        self.prefix = PrefixCache(self.budget, max(windows, default=0)) if prefix_cache else None
        self.heap = HeapTrim()
        self.computing: dict[bytes, int] = {}  # prefix blocks being prefilled now -> rows computing them
        self.inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.requests: deque[Request] = deque()  # with prompts waiting for a row, in turn order
        self.resumes: deque[Row] = deque()  # preempted rows, resumed before any new prompt
        self.active: list[Request] = []  # every request not done
        self.lanes: list[Lane] = []
        self.steps = self.preemptions = self.finished_rows = 0
        self.load = (0, 0)  # (rows in lanes, prompts waiting) after the last step: safe to read from any thread
        self._lock = threading.RLock()

    # ---- from any thread -------------------------------------------------------------------------
    def stepper_of(self, request: Request) -> tuple[StepperFactory | None, int]:
        if request.stepper is not None:
            return request.stepper
        return self.engine.stepper_factory(request.mode, request.spec, request.max_disagreement)

    def submit(self, request: Request) -> Request:
        """Queue a request (validated here: ValueError / PromptError for what cannot run, such as a
        prompt whose prompt + max_tokens could never fit the whole KV budget)."""
        _, headroom = self.stepper_of(request)  # a mode or options the engine cannot run raise here
        p = request.params
        if p.processes and (request.mode == "specee" or (request.spec or {}).get("t3")):
            raise ValueError("logit_bias, penalties, min_tokens and structured output apply in modes auto, dense "
                             "and spec: SpecEE's exits (and spec's t3) choose among the draft's candidates without them")
        if p.structured:
            self.engine.rules.grammar(p.structured)  # a spec that does not compile fails here, not in a lane
        vocab = self.engine.config.vocab_size
        bad = [t for t in (*p.logit_bias, *p.stop_token_ids) if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} in logit_bias or stop_token_ids are outside the vocabulary "
                             f"(0..{vocab - 1})")
        ctx = self.engine.context_len
        for i, p in enumerate(request.prompt_ids):
            if not p:
                raise PromptError(f"prompt {i} is empty")
            if len(p) >= ctx:
                raise PromptError(f"prompt {i} has {len(p)} tokens; the context holds {ctx}")
            need = self.budget.blocks(len(p) + min(request.params.max_new_tokens, ctx - len(p)) + headroom)
            if need > self.budget.capacity:
                raise PromptError(f"prompt {i} ({len(p)} tokens) with max_tokens {request.params.max_new_tokens} "
                                  f"needs {need} KV blocks; the engine's KV budget holds {self.budget.capacity} "
                                  f"(kv_cache_gb): lower max_tokens")
        self.inbox.put(request)
        return request

    def memory(self) -> dict:
        """The KV budget and what holds it (safe to read from any thread: a snapshot of counters)."""
        out = self.budget.report()
        out["prefix_cache_blocks"] = 0 if self.prefix is None else len(self.prefix)
        out["prefix_cache_hit_rate"] = (round(self.prefix.hits / self.prefix.queries, 4)
                                        if self.prefix is not None and self.prefix.queries else 0.0)
        out["preemptions"] = self.preemptions
        return out

    # ---- the engine thread -----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.active) or not self.inbox.empty()

    def running_rows(self) -> int:
        return sum(len(lane.rows) for lane in self.lanes)

    def waiting_prompts(self) -> int:
        return sum(len(r.waiting) for r in self.requests) + len(self.resumes)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One iteration; returns the requests that ended in it (results or error set)."""
        with self._lock:
            return self._step()

    def _step(self) -> list[Request]:
        ended: list[Request] = []
        while not self.inbox.empty():
            req = self.inbox.get()
            self.active.append(req)
            self.requests.append(req)
        self._drop_cancelled()
        self._admit()
        for lane in list(self.lanes):
            if lane not in self.lanes:  # emptied by a preemption this iteration
                continue
            try:
                lane.prefill(self.prefill_chunk)
                if self._room(lane) and lane in self.lanes:
                    lane.decode()
            except Exception as e:  # noqa: BLE001 -- a failed step costs its lane's requests, not the others
                log.exception("a %s lane failed; its %d rows' requests fail", lane.mode, len(lane.rows))
                for row in lane.rows.values():
                    row.request.error = row.request.error or e
                    row.request.cancel()  # finished() below collects the rows and frees their slots
                lane.failed = True
            if lane not in self.lanes:  # emptied by preemption
                continue
            for row, result in lane.finished():
                self.finished_rows += 1
                req = row.request
                req.running -= 1
                if result is not None:
                    req.results[row.index] = result
            if not lane.rows:
                self._retire(lane)
        self._settle(ended)
        self.steps += 1
        self.load = (self.running_rows(), self.waiting_prompts())
        self.heap.maybe()
        return ended

    def _drop_cancelled(self) -> None:
        for req in self.requests:
            if req.cancelled:
                req.waiting.clear()
        self.requests = deque(r for r in self.requests if r.waiting)
        for row in [r for r in self.resumes if r.request.cancelled]:
            self.resumes.remove(row)
            row.request.running -= 1

    # ---- memory ----------------------------------------------------------------------------------
    def _take(self, blocks: int) -> bool:
        """Take blocks from the budget, evicting prefix blocks (least recently used) as needed."""
        short = blocks - self.budget.free()
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.budget.take(blocks)

    def _drop(self, lane: Lane) -> None:
        self.budget.give(lane.blocks(self.budget))
        lane.caches.clear()
        # its memory goes with the last reference: the stepper holds the caches too, and the lane sits in a cycle
        # (its batch calls back into it), which only the cyclic collector frees; that freed a lane's 150 MB of
        # caches in the middle of a later call's decode steps (a 90 ms pause at 32 rows)
        lane.cache = lane.stepper = None

    def _resize(self, lane: Lane, need: int, shrink: bool = False) -> bool:
        """Grow the lane's cache to hold `need` slots per row (shrink: also shrink it to that, when that
        frees a block); whether the budget allowed it. Growth takes half again as much as it has where
        the budget and max_len allow, to copy rarely."""
        bs = self.budget.block_size
        if need <= lane.capacity and (not shrink or self.budget.blocks(need) >= self.budget.blocks(lane.capacity)):
            return True
        if need > lane.capacity:
            want = min(lane.max_len, max(need, lane.capacity + lane.capacity // 2))
            for cap in dict.fromkeys((want, need)):
                cap = min(-(-cap // bs) * bs, lane.max_len) if cap < lane.max_len else lane.max_len
                extra = lane.blocks(self.budget, cap) - lane.blocks(self.budget)
                if self._take(extra):
                    lane.resize(cap)
                    return True
            return False
        cap = max(-(-need // bs) * bs, bs)  # shrink: far more than the rows need
        self.budget.give(lane.blocks(self.budget) - lane.blocks(self.budget, cap))
        lane.resize(cap)
        return True

    def _room(self, lane: Lane) -> bool:
        """Make room for the lane's next decode step, preempting the most recently admitted rows
        (any lane's) until the budget has it; False when the lane itself is left without decoding rows."""
        while not self._resize(lane, lane.need()):
            victim = self._latest_row()
            if victim is None:
                raise MemoryError("the KV budget cannot hold one row's next step")
            self._preempt(*victim)
            if lane not in self.lanes or not lane.batch.alive():
                return False
        return True

    def _latest_row(self) -> tuple[Lane, int] | None:
        best = None
        for lane in self.lanes:
            for s, row in lane.rows.items():
                if best is None or row.admitted > best[2]:
                    best = (lane, s, row.admitted)
        return None if best is None else best[:2]

    def _preempt(self, lane: Lane, s: int) -> None:
        """Free row s of the lane: its tokens are kept and it is resumed (its context prefilled again)."""
        b = lane.batch
        row = lane.rows[s]
        if b.finish[s] is None:
            row.saved = b.save(s)
            row.tokens = b.context(s)
        lane.remove(s)  # a prefilling row starts its prefill over
        row.resume_after = self.finished_rows  # memory comes back when a row finishes: no churn before
        self.resumes.appendleft(row)
        self.preemptions += 1
        log.info("KV budget full: preempted a row of %d tokens (%d blocks in use of %d)", len(row.tokens),
                 self.budget.used, self.budget.capacity)
        if not lane.rows:
            self.lanes.remove(lane)
            self._drop(lane)
        else:
            self._resize(lane, lane.need(), shrink=True)

    def _retire(self, lane: Lane) -> None:
        """An emptied lane gives its memory back. It is not kept for reuse: its stepper was built from the
        engine's state of its day (plan, early-exit options), and a new lane costs a small allocation."""
        self.lanes.remove(lane)
        self._drop(lane)

    # ---- admission -------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Free rows to preempted rows, then to waiting prompts, while the KV budget has their prompts' blocks:
        one per request in turn, or where priorities differ, the lowest priority's first (Request.priority)."""
        room = self.max_rows - self.running_rows()
        while room > 0 and self.resumes:
            row = self.resumes[0]
            if (self.lanes and self.finished_rows <= row.resume_after) or not self._place(row):
                return  # its blocks are not free yet: nothing newer goes before it
            self.resumes.popleft()
            room -= 1
        skipped = 0
        ordered = len({r.priority for r in self.requests}) > 1
        if ordered:
            self.requests = deque(sorted(self.requests, key=lambda r: r.priority))  # stable: arrival order within
        while room > 0 and self.requests and skipped < len(self.requests):
            req = self.requests[0]
            if not ordered:
                self.requests.rotate(-1)
            i = req.waiting[0]
            prompt = req.prompt_ids[i]
            row = Row(req, i, prompt, min(req.params.max_new_tokens, self.engine.context_len - len(prompt)),
                      tokens=prompt)
            try:
                placed = self._place(row)
            except Exception as e:  # noqa: BLE001 -- e.g. its stepper cannot be built: this request fails
                log.exception("no lane for a %s request", req.mode)
                req.error = req.error or e
                req.cancel()
                req.waiting.clear()
                self.requests = deque(r for r in self.requests if r is not req)
                continue
            if not placed:  # its lane is full or its blocks are not free: the next request's turn
                skipped += 1
                if ordered:
                    self.requests.rotate(-1)
                continue
            skipped = 0
            req.waiting.popleft()
            req.running += 1
            room -= 1
            if not req.waiting:
                self.requests = deque(r for r in self.requests if r is not req)

    def _place(self, row: Row) -> bool:
        """Put the row in a lane of its key with a free slot and room in the budget for its context. It
        waits while another row prefills the next block it could take from the prefix cache."""
        keys = self.prefix.keys(row.tokens) if self.prefix is not None else []
        prefix = self.prefix.match(row.tokens, keys) if keys else []
        if len(prefix) < len(keys) and keys[len(prefix)] in self.computing:
            return False  # do not compute that block twice: it will be cached in a step or two
        lane = self._lane_for(row.request, len(row.prompt) + row.max_new, len(row.tokens))
        if lane is None:
            return False
        if not self._resize(lane, max(lane.need(), len(row.tokens) + 1 + lane.headroom)):
            if not lane.rows:
                self._retire(lane)
            return False
        row.computing = keys[len(prefix):]
        for k in row.computing:
            self.computing[k] = self.computing.get(k, 0) + 1
        row.admitted = next(_ADMISSIONS)
        lane.place(row, prefix)
        if self.prefix is not None:
            self.prefix.queries += len(row.tokens)
            self.prefix.hits += row.done_tokens
        return True

    def computed(self, row: Row) -> None:
        """The row's prefill ended (done, preempted or dropped): its blocks are no longer in flight."""
        for k in row.computing:
            if self.computing.get(k, 0) <= 1:
                self.computing.pop(k, None)
            else:
                self.computing[k] -= 1
        row.computing = []

    def _lane_for(self, req: Request, row_len: int, context: int) -> Lane | None:
        key = req.lane_key
        for lane in self.lanes:
            if lane.key == key and lane.fits(row_len) and lane.free_slots():
                return lane
        if any(lane.key == key and lane.fits(row_len) for lane in self.lanes):
            return None  # its lane is full
        bs, cap_blocks = self.budget.block_size, self.budget.capacity
        # rows for the prompts of this key waiting now (a generate() call's), at least min_lane_rows (Serve:
        # room for requests that join later); a lane with free rows decodes through a gather of its rows
        demand = sum(len(r.waiting) for r in self.requests if r.lane_key == key)
        demand += sum(1 for row in self.resumes if row.request.lane_key == key)
        want = min(self.max_rows, max(self.min_lane_rows, demand, 1))
        if len(self.lanes) >= self.max_lanes:
            return None  # its turn comes when a lane empties
        _, headroom = self.stepper_of(req)
        # long enough for the longest of those rows (up to `want` of them): a row that did not fit would open a
        # lane of its own and decode beside this one, a forward per step each, the same rows in two batches
        ctx = self.engine.context_len
        waiting = sorted((len(r.prompt_ids[i]) + min(r.params.max_new_tokens, ctx - len(r.prompt_ids[i]))
                          for r in self.requests if r.lane_key == key for i in r.waiting), reverse=True)
        row_len = max([row_len, *waiting[:want]])
        max_len = self.min_slots
        while max_len < row_len + headroom:
            max_len *= 2
        max_len = min(max_len, cap_blocks * bs)
        slots = max(1, min(want, cap_blocks // self.budget.blocks(max_len)))
        first = min(max_len, max(self.min_slots, -(-(context + 1 + headroom) // bs) * bs))
        if not self._take(slots * self.budget.blocks(first)):
            return None
        try:
            lane = Lane(self, key, req, slots, max_len, first)
        except BaseException:
            self.budget.give(slots * self.budget.blocks(first))
            raise
        self.lanes.append(lane)
        return lane

    def _settle(self, ended: list[Request]) -> None:
        still = []
        for req in self.active:
            if req.waiting or req.running:
                still.append(req)
                continue
            if req.cancelled and req.error is None:
                req.error = CancelledRequest("the request was cancelled")
            req.done = True
            ended.append(req)
            if req.on_done is not None:
                try:
                    req.on_done(req)
                except Exception:  # noqa: BLE001 -- the caller's callback must not stop the others' requests
                    log.exception("on_done of a request failed")
        self.active = still

    def fail_all(self, error: BaseException) -> None:
        """End every request with `error` and drop the lanes (after a step failed outside a lane)."""
        with self._lock:
            for lane in self.lanes:
                self._drop(lane)
            self.lanes.clear()
            self.resumes.clear()
            self.computing.clear()
            while not self.inbox.empty():
                self.active.append(self.inbox.get())
            for req in self.active:
                req.error = req.error or error
                req.waiting.clear()
                req.running = 0
                req.cancel()
            self.requests.clear()
            self._settle([])

    def run(self, request: Request) -> list[GenerationResult]:
        """Submit one request and step until it is done (generate; any thread, one step at a time)."""
        return self.run_all([request])[0]

    def run_all(self, requests: list[Request]) -> list[list[GenerationResult]]:
        """Submit requests (their lanes decode side by side) and step until every one is done; the first
        error of one is raised once all are done."""
        for r in requests:
            self.submit(r)
        while not all(r.done for r in requests):
            self.step()
        for r in requests:
            if r.error is not None:
                raise r.error
        return [r.results for r in requests]


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
    """An EngineCore stepping on its own thread whenever it has work. submit() from any thread returns a
    concurrent Future of the request's results (asyncio: `asyncio.wrap_future`)."""
    busy_what = "a decode step"

    def __init__(self, core: EngineCore, stall_timeout_s: float = 600.0):
        super().__init__(stall_timeout_s)
        self.core = core
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specee-core", daemon=True)
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
        self.core.submit(request)  # raises here for a request that cannot run
        self._wake.set()
        return fut

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # before looking for work: a submit after this sets it again
            while self.core.busy:
                self._busy_since = time.monotonic()
                try:
                    self.core.step()
                except BaseException as e:  # noqa: BLE001 -- a bug or out of memory: fail what is running, go on
                    log.exception("engine core step failed; failing %d requests", len(self.core.active))
                    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
                        self._fatal = repr(e)
                    try:
                        self.core.fail_all(e)
                    except BaseException as again:  # noqa: BLE001 -- nothing left to do: report it in check()
                        self._fatal = f"{e!r}, then {again!r}"
                        raise
                finally:
                    self._busy_since = None

    def check(self) -> None:
        super().check()
        if not self._thread.is_alive():
            raise RuntimeError("the engine core's thread has stopped")
