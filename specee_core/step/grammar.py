"""Structured output: a constraint (a JSON schema, any JSON object, a regular expression, one of some
strings, a Lark grammar) compiled by llguidance into a per-row matcher whose token mask the sampler applies.
The matcher advances with every committed token; a speculative step advances it along each drafted path to
mask that path's nodes and rolls it back, so the constrained distribution is verified exactly."""
from __future__ import annotations

import json
import re

import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


def check_structured(spec: dict | None) -> dict | None:
    """A structured-output spec as SamplingParams takes it ({"type": kind, ...}); ValueError naming what is wrong."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise ValueError(f"structured output must be a dict with type one of {', '.join(KINDS)}, got {spec!r:.200}")
    kind = spec["type"]
    need = {"json_schema": ("schema", dict), "regex": ("pattern", str), "choice": ("choices", list),
            "grammar": ("grammar", str)}.get(kind)
    if need is not None and not isinstance(spec.get(need[0]), need[1]):
        raise ValueError(f"structured output {kind!r} needs {need[0]!r} ({need[1].__name__}), got {spec!r:.200}")
    if kind == "choice" and not (spec["choices"] and all(isinstance(c, str) and c for c in spec["choices"])):
        raise ValueError(f"structured output 'choice' needs non-empty strings, got {spec['choices']!r:.200}")
    return spec


def grammar_text(spec: dict) -> str:
    """The llguidance grammar of a spec (check_structured's)."""
    from llguidance import LLMatcher

    kind = spec["type"]
    # compact JSON (no free whitespace between tokens): a model cannot pad a reply with newlines until
    # max_tokens cuts the object off
    compact = {"whitespace_flexible": False}
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=compact)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json.dumps(spec["schema"]), defaults=compact)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec["pattern"])
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec["choices"]))
    return LLMatcher.grammar_from_lark(spec["grammar"])


class Grammar:
    """One compiled constraint over one tokenizer (llguidance's LLTokenizer): matcher() gives each row its own
    state. ValueError when the spec does not compile (a bad schema or pattern)."""

    def __init__(self, spec: dict, tokenizer):
        from llguidance import LLMatcher

        self.spec, self.tokenizer = spec, tokenizer
        self.text = grammar_text(spec)
        err = LLMatcher(tokenizer, self.text).get_error()
        if err:
            raise ValueError(f"structured output does not compile: {err}")

    def matcher(self):
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer, self.text)

    def forced(self, matcher, path: list[int], limit: int) -> list[int]:
        """Up to limit tokens the constraint forces after path (matcher's state unchanged): the tokenizer's own
        tokenization of the bytes no other text can take there (a JSON key, the punctuation between values),
        cut before any token the matcher refuses; [] where nothing is forced or it refuses path. A guess to
        verify like any draft: the model may spell the same bytes with other tokens."""
        if limit <= 0:
            return []
        consumed = matcher.try_consume_tokens(path) if path else 0
        try:
            if consumed < len(path) or matcher.is_stopped():
                return []
            forced = matcher.compute_ff_bytes()
            if not forced:
                return []
            toks = self.tokenizer.tokenize_bytes(forced)[:limit]
            return toks[: matcher.validate_tokens(toks)]
        finally:
            if consumed:
                matcher.rollback(consumed)


def _bitmask(matchers: list, paths: list[list[int]], vocab: int, keys: list | None = None,
             memo: dict | None = None) -> tuple[list[int], torch.Tensor | None]:
    """(the rows with a matcher, their llguidance bitmask [len(rows), ceil(vocab / 32)] int32): what each allows
    after consuming its path (then rolled back); all bits set where a matcher refuses its path or is complete.
    memo: masks already computed since the matchers last advanced, by keys[r] (a draft's level and the verify
    node on the same path need one mask, not two)."""
    rows = [r for r, m in enumerate(matchers) if m is not None]
    if not rows:
        return rows, None
    # all allowed: what a refused path keeps. (llguidance.torch is not imported: it torch.compiles its mask
    # kernel at import and on first use, ~5 s in each new process, for what two tensor ops do here.)
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        if memo is not None and keys[r] in memo:
            bitmask[i] = memo[keys[r]]
            continue
        m = matchers[r]
        consumed = m.try_consume_tokens(paths[r]) if paths[r] else 0  # stops before a refused token, no error state
        if consumed == len(paths[r]) and not m.is_stopped():
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), bitmask.shape[1] * 4)  # row i is contiguous
        if consumed:
            m.rollback(consumed)
        if memo is not None:
            memo[keys[r]] = bitmask[i].clone()
    return rows, bitmask


def refusing(matchers: list, paths: list[list[int]], tokens: list[int]) -> list:
    """matchers, with None where row r's grammar takes paths[r] and then tokens[r] (state unchanged): one
    check per row, where a mask is a pass over the vocabulary. The rows left are those a mask could change."""
    return [None if m is None or m.validate_tokens([*p, t]) == len(p) + 1 else m
            for m, p, t in zip(matchers, paths, tokens)]


def only_disallowed_best(logits: torch.Tensor, matchers: list, paths: list[list[int]]) -> list:
    """matchers, with None where row r's best token (greedy's choice) is one its grammar allows after paths[r]:
    masking that row would not change its argmax, so greedy masks only the others."""
    return refusing(matchers, paths, logits.argmax(-1).tolist())


def mask_logits(logits: torch.Tensor, matchers: list, paths: list[list[int]], keys: list | None = None,
                memo: dict | None = None) -> torch.Tensor:
    """logits [R, V] float, in place: row r keeps only the tokens matchers[r] allows after consuming paths[r]
    (then rolled back). A path the matcher refuses leaves its row unmasked: such a node follows a token its
    parent's mask excluded, so no step can accept it. matchers[r] None: row r is not constrained."""
    rows, bitmask = _bitmask(matchers, paths, logits.shape[-1], keys, memo)
    if not rows:
        return logits
    refused = ~_bits(bitmask, logits.shape[-1]).to(logits.device)
    if len(rows) == len(matchers):  # every row constrained (one lane, one constraint): in place
        return logits.masked_fill_(refused, float("-inf"))
    logits[rows] = logits[rows].masked_fill_(refused, float("-inf"))
    return logits


_BITS = torch.arange(32, dtype=torch.int32)


def _bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool from llguidance's bitmask [R, ceil(vocab / 32)] int32 (token t: bit t % 32 of word t // 32)."""
    return ((bitmask[:, :, None] >> _BITS) & 1).bool().reshape(len(bitmask), -1)[:, :vocab]


def allowed_tokens(matchers: list, paths: list[list[int]], vocab: int, keys: list | None = None,
                   memo: dict | None = None) -> torch.Tensor:
    """[R, vocab] bool: the tokens matchers[r] allows after paths[r] (every token where a row has no matcher,
    refuses its path or is complete). What the draft head's proposals are masked with."""
    rows, bitmask = _bitmask(matchers, paths, vocab, keys, memo)
    out = torch.ones(len(matchers), vocab, dtype=torch.bool)
    if rows:
        out[rows] = _bits(bitmask, vocab)
    return out
