"""Per-row decode state: the one object that owns every running row's tokens, positions, the token to
feed next and its stop state. The engine core places prompts in its rows and commits each decode
step's decisions through its methods; steppers and proposers only read it. Below both, so neither
imports the other for it."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specee_core.step.grammar import Grammar
from specee_core.step.sampling import (RowSampling, SamplingParams, choose, logprob_entries, process_logits,
                                      token_counts)
from specee_core.step.stops import StopMatcher

FREE = "free"  # finish of an empty row (not None: not alive)
PREFILL = "prefill"  # ... of a row whose prompt is still being prefilled


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
    # per row, per token of `tokens`: (its log-probability, the top ids, their log-probabilities), when the
    # lane's params ask for logprobs (sampling.logprob_entries)
    logprobs: list[list[tuple[float, list[int], list[float]]]] | None = None


class PromptError(ValueError):
    """A prompt the engine cannot run (wrong type, empty, longer than the context or the KV budget)."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    exit_layers: list[int]  # per generated token: layers run (1-based); num_layers in dense mode
    prompt_tokens: int
    metrics: dict = field(default_factory=dict)  # ttft_s, tpot_s, e2e_latency_s, tokens_per_s, ...
    stats: dict = field(default_factory=dict)  # early-exit statistics (histogram, average layers, ...)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    # per generated token, when asked (SamplingParams.logprobs): {"token": id, "logprob": float,
    # "top_logprobs": [[id, logprob], ...]} of the model's raw distribution
    logprobs: list[dict] | None = None


def exit_stats(exit_layers: list[int], num_layers: int) -> dict:
    """Histogram (index = layers run, 1..L) and average layers of one request's tokens."""
    hist = [0] * (num_layers + 1)
    for l in exit_layers:
        hist[l] += 1
    n = max(len(exit_layers), 1)
    avg = sum(exit_layers) / n
    return {"exit_histogram": hist[1:], "avg_layers": avg, "layer_fraction": avg / num_layers}


@dataclass
class TextRules:
    """What settles a row: the model's end-of-sequence ids, the tokenizer's decode (stop strings) and, for
    structured output, the tokenizer as llguidance reads it (built on first use). One object per engine,
    shared by its lanes' Batches."""
    eos_ids: frozenset[int]
    decode: Callable[[list[int]], str]
    num_layers: int
    grammar_tokenizer: Callable[[], object] | None = None

    _grammars: dict = field(default_factory=dict, repr=False)  # compiled constraints by spec (the latest 64)

    def grammar(self, spec: dict) -> Grammar:
        """The compiled constraint of a structured-output spec (ValueError when it does not compile)."""
        if self.grammar_tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        key = json.dumps(spec, sort_keys=True)
        g = self._grammars.pop(key, None) or Grammar(spec, self.grammar_tokenizer())
        self._grammars[key] = g  # most recent last
        while len(self._grammars) > 64:
            self._grammars.pop(next(iter(self._grammars)))
        return g


@dataclass
class SavedRow:
    """A preempted row's tokens and stop state (Batch.save): it resumes with them, its context prefilled again."""
    generated: list[int]
    exit_layers: list[int]
    stop_matcher: StopMatcher
    t_first: float
    logprobs: list | None
    matcher: object | None  # structured output: its matcher, advanced over its tokens


@dataclass
class Batch:
    """Decode state of the rows of one KV cache (a lane of the engine core). Row b of every tensor is
    cache row b; a row is FREE, PREFILL (its prompt being prefilled) or alive (finish None) until it
    settles ("stop" / "length"). Each row samples by its own SamplingParams (reserve). Built by Batch.empty only."""
    # per row: its whole token history, the prompt then every generated token (the one copy: lookup reads it)
    tokens: list[list[int]]
    n_prompt: list[int]  # per row: how many of its tokens are the prompt
    max_new: list[int]  # per row, clipped to the context
    exit_layers: list[list[int]]
    finish: list[str | None]
    texts: list[str | None]  # the text cut at a stop string; None = decode the tokens
    positions: torch.Tensor  # [B] host: position of the next token to feed = len(tokens) - 1
    next_tokens: torch.Tensor  # [B] device: the token to feed next
    last_hidden: torch.Tensor  # [B, D] hidden state of the last fed token (draft heads use it)
    rules: TextRules
    vocab_size: int
    mode: str = "dense"
    on_token: Callable[[int, int], None] | None = None  # (row, token id) for every token recorded
    stop_matchers: list[StopMatcher] = field(init=False)  # per row: the stop-string search of its text
    logprobs: list[list | None] = field(init=False)  # per row, when its params ask: one entry per generated token
    t_first: list[float] = field(init=False)  # per row: when its first token was chosen
    t_done: list[float] = field(init=False)  # per row: when it settled

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.stop_matchers = [StopMatcher(()) for _ in range(n)]
        self.logprobs = [None] * n
        self.sampling: list[SamplingParams | None] = [None] * n  # per row: its own sampling
        self.keys = [0] * n  # per row: its sampling key (sampling.row_key)
        self.stop_ids: list[frozenset[int]] = [frozenset()] * n  # per row: EOS unless ignore_eos, its stop_token_ids
        self.grammars: list[Grammar | None] = [None] * n  # per row, with structured output: its constraint
        self.matchers: list = [None] * n  # ... and its llguidance matcher
        # grammar masks by (row, drafted path) since the matchers last advanced (grammar._bitmask's memo)
        self.mask_memo: dict = {}
        # [B, V] fp32 output token counts and [B, V] bool prompt tokens, kept for the rows whose params penalize
        # (made when one first does)
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._sampling_memo: dict[tuple, RowSampling] = {}  # RowSampling by the rows it describes
        self.t_first, self.t_done = [0.0] * n, [0.0] * n

    @classmethod
    def empty(cls, rows: int, hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
              rules: TextRules, mode: str, on_token: Callable[[int, int], None] | None = None) -> Batch:
        """`rows` FREE rows."""
        return cls(tokens=[[] for _ in range(rows)], n_prompt=[0] * rows, max_new=[0] * rows, vocab_size=vocab_size,
                   exit_layers=[[] for _ in range(rows)], finish=[FREE] * rows,
                   texts=[None] * rows, positions=torch.zeros(rows, dtype=torch.int64),
                   next_tokens=torch.zeros(rows, dtype=torch.int64, device=device),
                   last_hidden=torch.zeros(rows, hidden_size, dtype=dtype, device=device), rules=rules, mode=mode,
                   on_token=on_token)

    @property
    def size(self) -> int:
        """Rows (free ones included)."""
        return len(self.tokens)

    def alive(self) -> list[int]:
        return [b for b, f in enumerate(self.finish) if f is None]

    def prompt(self, b: int) -> list[int]:
        return self.tokens[b][: self.n_prompt[b]]

    def output(self, b: int) -> list[int]:
        """Row b's generated tokens (a copy)."""
        return self.tokens[b][self.n_prompt[b] :]

    def n_generated(self, b: int) -> int:
        return len(self.tokens[b]) - self.n_prompt[b]

    def last(self, b: int) -> int:
        """Row b's last token: the one it feeds next (a draft's root)."""
        return self.tokens[b][-1]

    def processed(self, logits: torch.Tensor, rows: list[int], paths: list[list[int]] | None = None,
                  fresh: bool = False) -> torch.Tensor:
        """logits [R, V] of batch rows `rows` (one per logits row; repeats allowed) as each row's params
        process them (sampling.process_logits); paths[r]: the drafted tokens between row rows[r]'s output and
        the choice made from logits row r; fresh: the rows have not started yet (their first token). The same
        tensor when no row's params process anything."""
        params = [self.sampling[b] for b in rows]
        if not any(p.processes for p in params):
            return logits
        counts = seen = None
        if any(p.penalizes for p in params):
            idx = torch.tensor(rows, device=logits.device)
            counts, seen = self.counts[idx], self.prompt_seen[idx]
            drafted = [(r, t) for r, path in enumerate(paths or []) for t in path]
            if drafted:  # the drafted ancestors count as output
                r_idx, t_idx = zip(*drafted)
                counts.index_put_((torch.tensor(r_idx, device=logits.device), torch.tensor(t_idx, device=logits.device)),
                                  torch.ones(len(drafted), device=logits.device), accumulate=True)
        n_out = [0] * len(rows) if fresh else [self.n_generated(b) + (len(paths[r]) if paths else 0)
                                               for r, b in enumerate(rows)]
        keys = [(b, tuple(paths[r]) if paths else ()) for r, b in enumerate(rows)]
        return process_logits(logits, params, n_out, [self.stop_ids[b] for b in rows], counts, seen,
                              [self.matchers[b] for b in rows], paths, keys, self.mask_memo)

    def row_sampling(self, rows: list[int]) -> RowSampling:
        """The choice's parameters of batch rows `rows` (repeats allowed), kept while the rows stay."""
        key = tuple(rows)
        s = self._sampling_memo.get(key)
        if s is None:
            if len(self._sampling_memo) >= 64:
                self._sampling_memo.clear()
            s = self._sampling_memo[key] = RowSampling.of([self.sampling[b] for b in rows], [self.keys[b] for b in rows],
                                                          self.next_tokens.device)
        return s

    def choose(self, logits: torch.Tensor, rows: list[int], index: list[int] | None = None) -> torch.Tensor:
        """Token ids [R] chosen from (processed) logits [R, V] of batch rows `rows` by each row's params
        (sampling.choose); index[r]: where the token will stand in its row's token list (default: next)."""
        s = self.row_sampling(rows)
        if s.all_greedy:
            return logits.max(dim=-1).indices
        return choose(logits, s, [len(self.tokens[b]) for b in rows] if index is None else index)

    def greedy(self, rows: list[int]) -> bool:
        """Whether every one of these rows chooses greedily."""
        return all(self.sampling[b].greedy for b in rows)

    def constrained(self, rows: list[int]) -> bool:
        """Whether any of these rows has structured output."""
        return any(self.matchers[b] is not None for b in rows)

    def logprob_entries(self, logits: torch.Tensor, rows: list[int], tokens: list[int]) -> list | None:
        """Per logits row r (of batch row rows[r]): the logprob entry of tokens[r] from raw logits [R, V] with its
        row's top_logprobs, or None where the row asks for none; None when no row asks."""
        ks = [self.sampling[b].logprobs for b in rows]
        want = [r for r, k in enumerate(ks) if k is not None]
        if not want:
            return None
        sub = logits if len(want) == len(rows) else logits[torch.tensor(want, device=logits.device)]
        entries = logprob_entries(sub, [tokens[r] for r in want], max(ks[r] for r in want))
        out: list = [None] * len(rows)
        for r, (lp, ids, vals) in zip(want, entries):
            out[r] = (lp, ids[: ks[r]], vals[: ks[r]])
        return out

    def step_logprobs(self, logits: torch.Tensor, rows: list[int], tokens: list[int]) -> list | None:
        """logprob_entries as a StepOutput of one token per row holds them."""
        entries = self.logprob_entries(logits, rows, tokens)
        return None if entries is None else [None if e is None else [e] for e in entries]

    def fed(self, alive: list[int], rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a dense step of the rows `alive` feeds: their next tokens [N] (device) and positions [N] (host);
        rows [N] (device) indexes them, None when every row is alive (no gathers)."""
        if rows is None:
            return self.next_tokens, self.positions
        return self.next_tokens[rows], self.positions[torch.tensor(alive)]

    def room(self, b: int) -> int:
        """Tokens row b may still emit."""
        return self.max_new[b] - self.n_generated(b)

    # ---- a row's life -------------------------------------------------------------------------
    def reserve(self, b: int, params: SamplingParams, key: int, prompt: list[int], generated: list[int] = ()) -> None:
        """Row b takes a prompt whose prefill has not finished yet, to be sampled by params with sampling key
        `key` (sampling.row_key); generated: a preempted row's tokens so far. With structured output, a fresh
        matcher: its first token is masked too."""
        self.finish[b] = PREFILL
        self.sampling[b], self.keys[b] = params, key
        self.stop_ids[b] = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.rules.eos_ids)
        self.grammars[b] = None if params.structured is None else self.rules.grammar(params.structured)
        self.matchers[b] = None if self.grammars[b] is None else self.grammars[b].matcher()
        self.mask_memo.clear()
        self._sampling_memo.clear()
        if params.penalizes:
            dev = self.next_tokens.device
            if self.counts is None:
                self.counts = torch.zeros(self.size, self.vocab_size, device=dev)
                self.prompt_seen = torch.zeros(self.size, self.vocab_size, dtype=torch.bool, device=dev)
            self.counts[b] = token_counts([list(generated)], self.vocab_size, dev)[0]
            self.prompt_seen[b] = False
            self.prompt_seen[b, torch.tensor(prompt, device=dev)] = True

    def start(self, rows: list[int], prompts: list[list[int]], max_new: list[int], stops: list[list[str]],
              first: torch.Tensor, last_hidden: torch.Tensor, saved: list[SavedRow | None] | None = None,
              first_logprobs: list | None = None) -> None:
        """Rows whose prompts are prefilled start decoding: first [N] the token chosen from the prompt's
        last hidden state last_hidden [N, D]. saved[r]: a preempted row's state (save()); its context
        (context()) was prefilled again, first is its last generated token, and nothing is recorded again.
        first_logprobs[r]: the first token's logprob entry, when the params ask for them."""
        now = time.perf_counter()
        self.mask_memo.clear()  # resumed rows take their own matchers back
        fresh = []
        for r, b in enumerate(rows):
            old = None if saved is None else saved[r]
            self.n_prompt[b], self.max_new[b] = len(prompts[r]), max_new[r]
            if old is None:
                self.tokens[b], self.exit_layers[b], self.texts[b] = list(prompts[r]), [], None
                self.logprobs[b] = None if self.sampling[b].logprobs is None else []
                self.stop_matchers[b] = StopMatcher(stops[r])
                self.t_first[b] = now
                fresh.append(r)
            else:
                self.tokens[b], self.exit_layers[b], self.texts[b] = prompts[r] + old.generated, old.exit_layers, None
                self.logprobs[b] = old.logprobs
                self.matchers[b] = old.matcher
                self.stop_matchers[b], self.t_first[b] = old.stop_matcher, old.t_first
            self.positions[b] = len(prompts[r]) + max(self.n_generated(b) - 1, 0)
            self.t_done[b] = 0.0
            self.finish[b] = None
        idx = torch.tensor(rows, device=self.next_tokens.device)
        self.next_tokens[idx] = first
        self.last_hidden[idx] = last_hidden
        if fresh:
            toks = first.tolist()
            self.record([rows[r] for r in fresh], [[toks[r]] for r in fresh], [[self.rules.num_layers]] * len(fresh),
                        None if first_logprobs is None else [[first_logprobs[r]] for r in fresh])

    def context(self, b: int) -> list[int]:
        """The tokens whose KV row b holds before its next fed token: the prompt and every generated
        token but the last (what a row admitted now was prefilled with)."""
        return self.tokens[b][:-1] if self.n_generated(b) else list(self.tokens[b])

    def save(self, b: int) -> SavedRow:
        """Row b's generated state, to resume it after preemption (its KV is dropped)."""
        return SavedRow(self.output(b), self.exit_layers[b], self.stop_matchers[b], self.t_first[b], self.logprobs[b],
                        self.matchers[b])

    def release(self, b: int) -> None:
        self.finish[b] = FREE
        self.matchers[b] = self.grammars[b] = None
        self._sampling_memo.clear()

    # ---- a decode step ------------------------------------------------------------------------
    def commit(self, alive: list[int], rows: torch.Tensor | None, out: StepOutput) -> None:
        """Take a step's decisions for the rows `alive` (rows: them on the device, None = every row): each
        row's last token is fed next (with its hidden state), its tokens are recorded."""
        last = torch.tensor([block[-1] for block in out.tokens], device=self.next_tokens.device)
        if rows is None:  # every row is alive
            self.next_tokens.copy_(last)
            if out.hidden is not None:
                self.last_hidden.copy_(out.hidden)
        else:
            self.next_tokens[rows] = last
            if out.hidden is not None:
                self.last_hidden[rows] = out.hidden
        self.record(alive, out.tokens, out.layers, out.logprobs)

    def record(self, alive: list[int], toks: list[list[int]], layers: list[list[int]],
               logprobs: list[list] | None = None) -> None:
        """Append each alive row's new tokens (one, or a verified block; with their logprob entries when
        the params ask), advance positions, and settle finished rows: no token after a row's stop (EOS, a
        stop token, a stop string, max_new) is kept."""
        now = time.perf_counter()
        self.mask_memo.clear()  # the matchers advance
        for i, (b, block, block_layers) in enumerate(zip(alive, toks, layers)):
            entries = None if logprobs is None else logprobs[i]
            for j, (tok, layer) in enumerate(zip(block, block_layers)):
                if self.finish[b] is None:
                    self._record_one(b, tok, layer, now, None if entries is None else entries[j])

    def _record_one(self, b: int, tok: int, layer: int, now: float, logprob=None) -> None:
        self.tokens[b].append(tok)
        if self.counts is not None and self.sampling[b].penalizes:
            self.counts[b, tok] += 1
        if self.logprobs[b] is not None:
            self.logprobs[b].append(logprob)
        if self.on_token is not None:
            self.on_token(b, tok)
        self.exit_layers[b].append(layer)
        # the token just chosen is fed next, right after the prompt and the tokens before it: the
        # prefill's token goes in at position len(prompt), not one past it
        self.positions[b] = len(self.tokens[b]) - 1
        matcher = self.matchers[b]
        if matcher is not None:
            matcher.consume_token(tok)
        if tok in self.stop_ids[b] or (matcher is not None and matcher.is_stopped()):  # the constraint is complete
            self.finish[b] = "stop"
        elif self.stop_matchers[b].stops:
            # the whole id list is decoded (a character split across tokens comes out right); only
            # the new tail is searched
            text = self.rules.decode(self.output(b))
            cut = self.stop_matchers[b].update(text)
            if cut >= 0:
                self.texts[b] = text[:cut]
                self.finish[b] = "stop"
        if self.finish[b] is None and self.n_generated(b) >= self.max_new[b]:
            self.finish[b] = "length"
        if self.finish[b] is not None:
            self.t_done[b] = now

    # ---- results ------------------------------------------------------------------------------
    def result(self, b: int, t0: float, stats: dict, cached_prompt_tokens: int = 0) -> GenerationResult:
        """Row b's result; t0: when its work started (its request's submission), stats: its stepper's."""
        ids = self.output(b)
        text = self.texts[b] if self.texts[b] is not None else self.rules.decode(ids)
        n_tok = len(ids)
        e2e = self.t_done[b] - t0
        decode_s = self.t_done[b] - self.t_first[b]
        metrics = {
            "ttft_s": self.t_first[b] - t0,
            "tpot_s": decode_s / max(n_tok - 1, 1),  # mean inter-token latency after the first token
            "e2e_latency_s": e2e,
            "tokens_per_s": n_tok / e2e if e2e > 0 else 0.0,
            "decode_tokens_per_s": (n_tok - 1) / decode_s if decode_s > 0 else 0.0,
        }
        layers = self.exit_layers[b]
        row = exit_stats(layers, self.rules.num_layers)
        row["mode"] = self.mode
        row.update(stats)
        # what the scheduler's update rule should consume: unbiased exploration exits when taken
        row["retune_histogram"] = row.get("explore_histogram") or row["exit_histogram"]
        return GenerationResult(text=text, token_ids=list(ids), finish_reason=self.finish[b], exit_layers=list(layers),
                                prompt_tokens=self.n_prompt[b], metrics=metrics, stats=row,
                                cached_prompt_tokens=cached_prompt_tokens, logprobs=self._logprobs(b))

    def _logprobs(self, b: int) -> list[dict] | None:
        if self.logprobs[b] is None:
            return None
        return [{"token": tok, "logprob": lp, "top_logprobs": [[i, v] for i, v in zip(ids, vals)]}
                for tok, (lp, ids, vals) in zip(self.output(b), self.logprobs[b])]
