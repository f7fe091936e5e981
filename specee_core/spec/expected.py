"""Acceptance in mode auto: a row's estimate of how often its drafted tokens are accepted (Acceptance, a prior
and an exponential average per proposer) and what a chain of some depth is then expected to commit."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Acceptance:
    """How deep one proposer's drafts get accepted on one row, as a geometric model: each drafted
    level is accepted with probability alpha = accepted / (accepted + stops) over the levels tried,
    where a stop is the level that was rejected. It starts from `prior` worth `prior_weight` levels;
    every level tried since weighs `decay` times less per level after it, so a collapse shows within a
    few steps; a step that tries nothing moves the estimate back toward the prior by `idle_decay`, so
    the planner tries a proposer again now and then."""
    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.75
    idle_decay: float = 0.97
    accepted: float = field(init=False)
    stops: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted, self.stops = self.prior * self.prior_weight, (1 - self.prior) * self.prior_weight

    @property
    def alpha(self) -> float:
        return self.accepted / max(self.accepted + self.stops, 1e-9)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        stop = accepted < drafted
        f = self.decay ** (accepted + stop)  # levels tried this step
        self.accepted = self.accepted * f + accepted
        self.stops = self.stops * f + stop

    def idle(self) -> None:
        i, w = self.idle_decay, self.prior_weight
        self.accepted = self.accepted * i + self.prior * w * (1 - i)
        self.stops = self.stops * i + (1 - self.prior) * w * (1 - i)


# what a structured-output row's forced tokens are expected to be accepted with before any is seen: the
# grammar leaves the model no other bytes there, only (rarely) another spelling of them in tokens
FORCED_PRIOR = 0.9


def expected_tokens(alpha: float, depth: int) -> float:
    """Tokens a verify step commits from a chain of `depth` drafted tokens: the bonus token plus each
    drafted one while every one before it was accepted (sum of alpha^i, i = 0..depth)."""
    return expected_tokens_upto(alpha, depth)[-1]


def expected_tokens_upto(alpha: float, depth: int) -> list[float]:
    """[expected_tokens(alpha, d) for d in 0..depth], the same sums, in one pass."""
    out, s = [], 0
    for i in range(depth + 1):
        s += alpha ** i
        out.append(s)
    return out


def tokens_var(alpha: float, depth: int) -> float:
    """The variance of the tokens a verify step commits from a chain of `depth` drafted tokens, each accepted
    with probability alpha while every one before it was: j tokens (j <= depth) with alpha^(j-1) (1 - alpha),
    depth + 1 with alpha^depth."""
    p = [alpha ** (j - 1) * (1 - alpha) for j in range(1, depth + 1)] + [alpha ** depth]
    mean = sum(j * q for j, q in enumerate(p, 1))
    return max(0.0, sum(j * j * q for j, q in enumerate(p, 1)) - mean * mean)
