"""Sampling parameters and the one sampler every mode uses: the logits processing (logit_bias, penalties,
min_tokens), the per-step token choice (greedy, temperature, top-k, top-p) and the log-probabilities a
request asks for (the model's raw distribution, before any processing, as vLLM reports them)."""
from __future__ import annotations

import json
from collections import Counter
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

    def lane_key(self) -> tuple:
        """What rows sharing decode steps must agree on (max_new_tokens and stop strings are per row)."""
        sampling = (0.0, 1.0, 0) if self.greedy else (self.temperature, self.top_p, self.top_k)
        return (*sampling, self.ignore_eos, self.frequency_penalty, self.presence_penalty, self.repetition_penalty,
                tuple(sorted(self.logit_bias.items())), tuple(self.stop_token_ids), self.min_tokens, self.logprobs,
                json.dumps(self.structured, sort_keys=True))


def process_logits(logits: torch.Tensor, params: SamplingParams, texts: list[tuple[list[int], list[int]]],
                   stop_ids: frozenset[int], matchers: list | None = None,
                   paths: list[list[int]] | None = None, mask_keys: list | None = None,
                   mask_memo: dict | None = None) -> torch.Tensor:
    """logits [R, V] -> the logits the choice is made from: logit_bias added, the penalties applied over each
    row's text (repetition over prompt and output, then frequency and presence over the output), and the stop tokens (stop_ids: EOS and stop_token_ids) masked while a row is short of
    min_tokens. texts[r]: (prompt, output) of logits row r, output being every token before the one chosen
    from it (drafted ancestors included). matchers[r]: row r's structured-output matcher (None: none), paths[r]
    the drafted tokens it advances along first (grammar.mask_logits). Unchanged (the same tensor) when params
    process nothing."""
    if not params.processes:
        return logits
    grammar = params.structured and matchers is not None
    paths = paths or ([[] for _ in matchers] if grammar else None)
    # greedy masks only the rows whose best token (after the other processing) its grammar refuses
    # (grammar.only_disallowed_best): under a grammar alone that is decided on the raw logits, before any copy
    if grammar and params.greedy and not params.transforms_logits:
        matchers = only_disallowed_best(logits, matchers, paths)
        if all(m is None for m in matchers):
            return logits
    out = logits.float()
    if out is logits:  # fp32 already: a copy, the caller's logits stay raw (logprobs read them)
        out = out.clone()
    dev = out.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=dev)
        out[:, ids] += torch.tensor(list(params.logit_bias.values()), device=dev)
    rows, toks, counts, seen_rows, seen_toks = [], [], [], [], []
    for r, (prompt, output) in enumerate(texts):
        if params.frequency_penalty or params.presence_penalty:
            for tok, c in Counter(output).items():
                rows.append(r), toks.append(tok), counts.append(c)
        if params.repetition_penalty != 1.0:
            seen = set(prompt) | set(output)
            seen_rows += [r] * len(seen)
            seen_toks += list(seen)
    if seen_rows:  # vLLM's order: the repetition penalty, then frequency and presence
        r_idx, t_idx = torch.tensor(seen_rows, device=dev), torch.tensor(seen_toks, device=dev)
        x = out[r_idx, t_idx]
        out[r_idx, t_idx] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if rows:
        r_idx, t_idx = torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)
        c = torch.tensor(counts, dtype=out.dtype, device=dev)
        out[r_idx, t_idx] -= params.frequency_penalty * c + params.presence_penalty
    if params.min_tokens:
        short = [r for r, (_, output) in enumerate(texts) if len(output) < params.min_tokens]
        if short and stop_ids:
            out[torch.tensor(short, device=dev)[:, None], torch.tensor(sorted(stop_ids), device=dev)] = float("-inf")
    if grammar:
        if params.greedy and params.transforms_logits:
            matchers = only_disallowed_best(out, matchers, paths)
        mask_logits(out, matchers, paths, mask_keys, mask_memo)
    return out


def logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
    """logits [M, V] (raw) and the token chosen from each row -> per row (the token's log-probability, the
    ids of the k most likely tokens, their log-probabilities), fp32 log_softmax."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [(c, [], []) for c in chosen]
    top = logp.topk(k, dim=-1)
    return list(zip(chosen, top.indices.tolist(), top.values.tolist()))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution sampling draws from (temperature, top-k, top-p applied), fp32."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already cover top_p (the first always stays)
        drop = probs.cumsum(-1) - probs > params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> token ids [N]."""
    if params.greedy:  # max's indices: the first maximum, as argmax, in a third of argmax's time on CPU bf16
        return logits.max(dim=-1).indices
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)
