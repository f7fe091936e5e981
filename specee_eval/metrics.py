"""Quality numbers of one decoding mode against dense: pass@1, agreement, perplexity."""
from __future__ import annotations

import math
import statistics


def pass_at_1(passed: list[bool]) -> float:
    """Greedy pass@1: the share of problems whose one completion passed."""
    return sum(passed) / len(passed) if passed else 0.0


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first position where the sequences differ (the shorter one's length when one is
    a prefix of the other, len(a) when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return len(a) if len(a) == len(b) else min(len(a), len(b))


def agreement(dense: list[list[int]], other: list[list[int]]) -> dict:
    """How close another mode's completions are to dense's, problem by problem:
    identical: share of completions equal token for token;
    first_divergence_mean / _median: tokens generated before the first difference;
    prefix_agreement: share of dense's tokens that the other mode reproduced before diverging;
    token_agreement: share of positions (up to the shorter length) holding the same token."""
    if len(dense) != len(other):
        raise ValueError(f"{len(dense)} dense completions against {len(other)}")
    if not dense:
        return {"identical": 0.0, "first_divergence_mean": 0.0, "first_divergence_median": 0.0,
                "prefix_agreement": 0.0, "token_agreement": 0.0}
    firsts = [first_divergence(d, o) for d, o in zip(dense, other)]
    same = sum(sum(x == y for x, y in zip(d, o)) for d, o in zip(dense, other))
    positions = sum(min(len(d), len(o)) for d, o in zip(dense, other))
    return {"identical": sum(d == o for d, o in zip(dense, other)) / len(dense),
            "first_divergence_mean": statistics.mean(firsts),
            "first_divergence_median": statistics.median(firsts),
            "prefix_agreement": sum(firsts) / max(sum(len(d) for d in dense), 1),
            "token_agreement": same / max(positions, 1)}


def outcome_agreement(dense: list[bool], other: list[bool]) -> float:
    """Share of problems where the mode passes exactly when dense passes."""
    return sum(a == b for a, b in zip(dense, other)) / max(len(dense), 1)


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean negative log-likelihood per token)."""
    return math.exp(nll_sum / tokens) if tokens else float("nan")


def speed(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
