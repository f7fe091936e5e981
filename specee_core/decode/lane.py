"""A lane: the rows that share decode steps (one mode and one set of spec / early-exit options, whatever their
sampling): one KV cache, one Batch and one stepper; its rows placed, prefilled in chunks, decoded and finished."""
from __future__ import annotations

import itertools

import torch

from specee_core.decode.dense import DenseStepper
from specee_core.decode.memory import KVBudget, PrefixBlock
from specee_core.decode.request import Request, Row
from specee_core.step.state import PREFILL, Batch, GenerationResult

_LANE_IDS = itertools.count()


class Lane:
    """Rows sharing decode steps over one KV cache that grows in blocks up to max_len slots per row. core: the
    EngineCore the lane belongs to (its engine, budget, prefix cache, steppers and window room)."""

    def __init__(self, core, key: tuple, request: Request, slots: int, max_len: int, capacity: int):
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
