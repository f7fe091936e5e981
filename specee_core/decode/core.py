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

import itertools
import logging
import queue
import threading
from collections import deque

import torch

from specee_core.decode.lane import Lane
from specee_core.decode.memory import HeapTrim, KVBudget, PrefixCache
from specee_core.decode.request import CancelledRequest, Request, Row
from specee_core.step.state import GenerationResult, PromptError
from specee_core.step.stepper import StepperFactory

log = logging.getLogger(__name__)

MIN_SLOTS = 256  # a new lane's first allocation per row (it grows from there)
WINDOW_HEADROOM = 64  # slots a sliding-window layer keeps beyond its window and a prompt chunk: a verified draft's
_ADMISSIONS = itertools.count()  # rows' admission order (preemption takes the latest)


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
        # (its batch calls back into it), which only the cyclic collector frees, at a moment of its choosing: in
        # the middle of a later call's decode steps, a pause as long as freeing the lane's caches
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
