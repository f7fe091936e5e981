"""Sampling parameters and the one sampler every mode uses, per row: the logits processing (logit_bias,
penalties, min_tokens), the token choice (greedy, temperature, top-k, top-p, min-p) and the log-probabilities
a row asks for (the model's raw distribution, before any processing, as vLLM reports them).

Every parameter is a row's own: rows of any settings share one decode step, and the sampler applies
their settings to the whole batch in a few tensor ops (vLLM's SamplingMetadata: per-row tensors).

How a sampled row draws (choose): the token that will stand at index i of the row's token list (prompt
included) is drawn from its distribution with random numbers that are a hash of the row's key (its seed,
or for a row without one a key drawn from torch's default generator), i and the token ids. So a row's
tokens depend on nothing but its own distributions and key: not on the rows beside it, the batch size, a
preemption, nor whether the step was dense or speculative. Speculative decoding verifies a drafted token
by asking whether it is the token the target draws there (the same random numbers): the committed tokens
are dense's, token for token, and keep the target's distribution exactly; a draft head drafts with the
same random numbers from its own distribution, which makes its guess agree with the target's draw
wherever the two distributions mostly agree (the Gumbel coupling)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from specee_core.step.grammar import check_structured, mask_logits, only_disallowed_best

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's probability (0: off)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    # OpenAI's: minus penalty * (count in the output) / minus penalty once a token is in the output
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # HF's / vLLM's: logits of tokens in the prompt or the output divided by it (> 0) or, when negative, multiplied
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    stop_token_ids: list[int] = field(default_factory=list)  # a row stops after emitting one (kept, like EOS)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    # log-probabilities of each chosen token and of its `logprobs` most likely alternatives (0: the chosen
    # token's alone; None: none): the model's raw distribution
    logprobs: int | None = None
    # structured output (specee_core.step.grammar): {"type": "json_object"} | {"type": "json_schema", "schema":
    # {...}} | {"type": "regex", "pattern": ...} | {"type": "choice", "choices": [...]} | {"type": "grammar",
    # "grammar": <Lark>}: every token is masked to what the constraint allows; the row ends when it is complete
    structured: dict | None = None

    def __post_init__(self) -> None:
        self.structured = check_structured(self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0 or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias maps token ids (int >= 0) to numbers in [-100, 100], got {tok!r}: {bias!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (int >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes(self) -> bool:
        """Whether logits are processed before the choice (logit_bias, a penalty, min_tokens, structured output)."""
        return bool(self.transforms_logits or self.structured)

    @property
    def transforms_logits(self) -> bool:
        """Whether logits change before the choice other than by a grammar's mask (logit_bias, a penalty,
        min_tokens)."""
        return bool(self.logit_bias or self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens)


    @property
    def penalizes(self) -> bool:
        """Whether the row's output (and, for the repetition penalty, its prompt) changes its logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)


# ---- the draw: one uniform per (row, token index) ---------------------------------------------------
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints whose outputs look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int | None, generator: torch.Generator | None = None) -> int:
    """A row's sampling key: of its seed, or drawn from `generator` (None: torch's default) for a row without one."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return _mix(seed & _M64)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _C1, _C2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_t(x: torch.Tensor) -> torch.Tensor:
    """_mix on int64 tensors (products wrap, as unsigned arithmetic does)."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _C1
    x = (x ^ _srl(x, 27)) * _C2
    return x ^ _srl(x, 31)


def _unit(h: torch.Tensor | int):
    """(0, 1] from 64 random bits (53 of them)."""
    return (((h >> 11) & ((1 << 53) - 1)) + 1) * 2.0**-53


def draw_bases(keys: list[int], index: list[int]) -> list[int]:
    """The random bits of the token at index[r] of the row of key keys[r] (what every draw for it derives from)."""
    return [_mix(k ^ _mix(i)) for k, i in zip(keys, index)]


def token_noise(bases: list[int], ids: torch.Tensor) -> torch.Tensor:
    """[R, K] float64 Exp(1) variates of tokens ids [R, K] (device) at draws bases[r]: a function of the base and
    the token id alone."""
    b = torch.tensor([_signed(x) for x in bases], dtype=torch.int64, device=ids.device)[:, None]
    return -torch.log(_unit(_mix_t(b + (ids + 1) * _C1)))


@dataclass
class RowSampling:
    """The choice's parameters of R logits rows, as tensors (vLLM's SamplingMetadata)."""
    greedy: list[bool]  # per row
    keys: list[int]  # per row: row_key
    temperature: torch.Tensor  # [R] fp32, 1 where greedy
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] fp32, 1 = off
    min_p: torch.Tensor  # [R] fp32, 0 = off

    @classmethod
    def of(cls, params: list[SamplingParams], keys: list[int], device: torch.device | str = "cpu") -> RowSampling:
        greedy = [p.greedy for p in params]
        return cls(greedy, list(keys),
                   torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], device=device),
                   torch.tensor([p.min_p for p in params], device=device))

    @functools.cached_property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @functools.cached_property
    def sampled(self) -> list[int]:
        """The rows that draw (temperature > 0)."""
        return [r for r, g in enumerate(self.greedy) if not g]

    def take(self, rows: list[int]) -> RowSampling:
        """The parameters of some of the rows, in that order."""
        idx = torch.tensor(rows, device=self.temperature.device)
        return RowSampling([self.greedy[r] for r in rows], [self.keys[r] for r in rows], self.temperature[idx],
                           self.top_k[idx], self.top_p[idx], self.min_p[idx])


def probabilities(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """logits [R, V] -> the distributions rows draw from [R, V] fp32: each row's temperature, top-k, top-p and
    min-p applied (a greedy row's: temperature 1)."""
    logits = logits.float() / s.temperature[:, None]
    if bool((s.top_k > 0).any()):
        k = s.top_k.clamp(max=logits.shape[-1])
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])  # [R, 1]
        kth = kth.masked_fill((k == 0)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = (s.top_p < 1).nonzero().squeeze(1)
    if len(nucleus):
        logits = logits.index_copy(0, nucleus, _nucleus(logits[nucleus], s.top_p[nucleus]))
    probs = logits.softmax(-1)
    if bool((s.min_p > 0).any()):
        floor = s.min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


HEAD = 64  # the most likely tokens a draw races among (the rest: the tail, drawn by inverse CDF)


NUCLEUS_FIRST = 256  # top-p looks among the most likely tokens first; a row they do not cover sorts them all


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [P, V] with every token dropped (-inf) whose more likely tokens already cover top_p [P] (the first
    always stays). A sort of the whole vocabulary is what costs: rows whose NUCLEUS_FIRST most likely tokens
    reach top_p decide among those."""
    probs = logits.softmax(-1)
    top, order = probs.topk(min(NUCLEUS_FIRST, logits.shape[-1]), dim=-1)  # [P, M] descending
    cum = top.cumsum(-1)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, cum - top <= top_p[:, None])
    short = (cum[:, -1] < top_p).nonzero().squeeze(1)  # the head does not reach top_p: sort the whole row
    if len(short):
        sorted_p, full = probs[short].sort(dim=-1, descending=True)
        keep[short] = torch.zeros_like(sorted_p, dtype=torch.bool).scatter_(
            1, full, sorted_p.cumsum(-1) - sorted_p <= top_p[short, None])
    return logits.masked_fill(~keep, float("-inf"))


def choose(logits: torch.Tensor, s: RowSampling, index: list[int]) -> torch.Tensor:
    """logits [R, V] (processed) -> token ids [R]: a greedy row's argmax (the first maximum), a sampled row's draw
    from probabilities() at draw_bases(keys, index).

    A draw: one uniform picks the HEAD most likely tokens or the rest, with their masses. Among the head, an
    exponential race (token j wins where p_j / E_j is largest, E_j ~ Exp(1) a function of the draw and j); in the
    tail, the inverse CDF of a second uniform over the tail in token order. Both are exact. They also keep a draw
    put where the decision is stable under the last-bit differences that another batch size makes in the logits:
    a race flips only on a near tie of two tokens' scores; the tail's boundaries move only by the tail's own noise,
    not by the head's (where an inverse CDF over the whole vocabulary would shift every later boundary)."""
    best = logits.max(dim=-1).indices  # max's indices: argmax's first maximum, in a third of its time on CPU bf16
    if s.all_greedy:
        return best
    rows = s.sampled
    every = len(rows) == len(s.greedy)
    part = s if every else s.take(rows)
    sub = logits if every else logits[torch.tensor(rows, device=logits.device)]
    probs = probabilities(sub, part)  # [S, V]
    bases = draw_bases(part.keys, [index[r] for r in rows])
    w, ids = probs.topk(min(HEAD, probs.shape[-1]), dim=-1)  # [S, K]
    w = w.double()
    head = w.sum(-1)
    total = probs.sum(-1, dtype=torch.float64)
    u = torch.tensor([_unit(_mix(b ^ 1)) for b in bases], dtype=torch.float64, device=probs.device)
    # the race's winner: the largest p_j / E_j (a token of zero probability never wins)
    drawn = ids.gather(1, (w / token_noise(bases, ids)).argmax(-1, keepdim=True))[:, 0]
    tail = (u * total > head).nonzero().squeeze(1).tolist()
    for t in tail:  # the draw falls past the head: its second uniform's inverse CDF over the rest
        rest = probs[t].double().index_fill(0, ids[t], 0.0)
        cdf = rest.cumsum(0)
        x = torch.tensor([_unit(_mix(bases[t] ^ 2)) * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
        if float(cdf[-1]) > 0:
            drawn[t] = torch.searchsorted(cdf, x.clamp(max=float(cdf[-1]) * (1 - 2**-52)), right=True)[0]
    if every:
        return drawn
    return best.index_copy(0, torch.tensor(rows, device=best.device), drawn)


# ---- logits processing --------------------------------------------------------------------------
def token_counts(outputs: list[list[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[R, V] fp32: how often each token occurs in outputs[r]."""
    counts = torch.zeros(len(outputs), vocab, device=device)
    rows = [r for r, out in enumerate(outputs) for _ in out]
    if rows:
        toks = torch.tensor([t for out in outputs for t in out], device=device)
        counts.index_put_((torch.tensor(rows, device=device), toks), torch.ones(len(rows), device=device),
                          accumulate=True)
    return counts


def process_logits(logits: torch.Tensor, params: list[SamplingParams], n_out: list[int],
                   stop_ids: list[frozenset[int]], counts: torch.Tensor | None = None,
                   prompt_seen: torch.Tensor | None = None, matchers: list | None = None,
                   paths: list[list[int]] | None = None, mask_keys: list | None = None,
                   mask_memo: dict | None = None) -> torch.Tensor:
    """logits [R, V] -> the logits the choice is made from, row r by params[r]: logit_bias added, the penalties
    applied (repetition over prompt and output, then frequency and presence over the output), row r's stop tokens
    (stop_ids[r]: EOS and its stop_token_ids) masked while its output (n_out[r] tokens, drafted ancestors
    included) is short of min_tokens, and its grammar's mask. counts [R, V]: each row's output token counts
    (token_counts), prompt_seen [R, V] bool: its prompt's tokens; needed where a row penalizes. matchers[r]: row
    r's structured-output matcher (None: none), paths[r] the drafted tokens it advances along first
    (grammar.mask_logits). The same tensor when no row processes anything."""
    if not any(p.processes for p in params):
        return logits
    transform = [r for r, p in enumerate(params) if p.transforms_logits]
    grammar = matchers is not None and any(m is not None and params[r].structured for r, m in enumerate(matchers))
    if grammar:
        matchers = [m if params[r].structured else None for r, m in enumerate(matchers)]
        paths = paths or [[] for _ in matchers]
        if not transform:
            # a greedy row is masked only where its grammar refuses its best token (grammar.only_disallowed_best):
            # under grammars alone that is decided on the raw logits, before any copy
            matchers = _greedy_refusing(logits, params, matchers, paths)
            if all(m is None for m in matchers):
                return logits
    out = logits.float()
    if out is logits:  # fp32 already: a copy, the caller's logits stay raw (logprobs read them)
        out = out.clone()
    if transform:
        _transform(out, params, transform, n_out, stop_ids, counts, prompt_seen)
    if grammar:
        if transform:
            matchers = _greedy_refusing(out, params, matchers, paths)
        mask_logits(out, matchers, paths, mask_keys, mask_memo)
    return out


def _greedy_refusing(logits: torch.Tensor, params: list[SamplingParams], matchers: list, paths: list) -> list:
    """matchers, with None for the greedy rows whose best token their grammar allows (sampled rows keep theirs)."""
    greedy = [r for r, (m, p) in enumerate(zip(matchers, params)) if m is not None and p.greedy]
    if not greedy:
        return matchers
    idx = torch.tensor(greedy, device=logits.device)
    kept = only_disallowed_best(logits[idx], [matchers[r] for r in greedy], [paths[r] for r in greedy])
    out = list(matchers)
    for r, m in zip(greedy, kept):
        out[r] = m
    return out


def _transform(out: torch.Tensor, params: list[SamplingParams], rows: list[int], n_out: list[int],
               stop_ids: list[frozenset[int]], counts: torch.Tensor | None, prompt_seen: torch.Tensor | None) -> None:
    """process_logits' logit_bias, penalties and min_tokens, in place on the rows `rows` of out [R, V] fp32."""
    dev = out.device
    b_rows = [r for r in rows for _ in params[r].logit_bias]
    if b_rows:
        toks = [t for r in rows for t in params[r].logit_bias]
        bias = [v for r in rows for v in params[r].logit_bias.values()]
        out.index_put_((torch.tensor(b_rows, device=dev), torch.tensor(toks, device=dev)),
                       torch.tensor(bias, dtype=out.dtype, device=dev), accumulate=True)
    pen = [r for r in rows if params[r].penalizes]
    if pen:  # vLLM's order: the repetition penalty, then frequency and presence
        idx = torch.tensor(pen, device=dev)
        x, c = out[idx], counts[idx]
        rep = torch.tensor([float(params[r].repetition_penalty) for r in pen], device=dev)[:, None]
        if bool((rep != 1).any()):
            seen = (c > 0) | prompt_seen[idx]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([float(params[r].frequency_penalty) for r in pen], device=dev)[:, None]
        pres = torch.tensor([float(params[r].presence_penalty) for r in pen], device=dev)[:, None]
        out[idx] = x - freq * c - pres * (c > 0)
    short = [(r, t) for r in rows if n_out[r] < params[r].min_tokens for t in sorted(stop_ids[r])]
    if short:
        r_idx, t_idx = zip(*short)
        out[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")


def logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
    """logits [M, V] (raw) and the token chosen from each row -> per row (the token's log-probability, the
    ids of the k most likely tokens, their log-probabilities), fp32 log_softmax."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [(c, [], []) for c in chosen]
    top = logp.topk(k, dim=-1)
    return list(zip(chosen, top.indices.tolist(), top.values.tolist()))


