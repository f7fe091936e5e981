"""The measured plan of mode auto: how much speculation pays on the machine at hand (the dtype "auto"
picks is specee_core.machine's).

Speculative decoding is lossless, but whether it is *faster* depends on the machine: a verify
forward over T draft tokens costs about one dense step where the GEMMs are weight-bound (bf16 on
CPUs with native bf16, GPUs) and about T dense steps where they are compute-bound (fp32 on a
2-core AVX2 CPU, large batches). So the engine measures what a forward of T rows costs here, once
per machine, model, dtype, torch version and thread count (cached under $SPECEE_CACHE/plans), and
chooses each decode step from that table and the acceptance seen so far:

    rate(shape) = expected tokens committed by the batch / (verify ms(B, T) + draft ms)

over dense (T = 1) and chains of every depth up to the limit, with prompt lookup or the draft
head per row. When no shape beats a dense step, the step is a plain dense step. SpecEE's own idea,
spend work where it pays, applied to speculation.

The choice is a pure function (`best_step`) of a CostTable and per-row acceptance estimates
(`Acceptance`), so it is unit-testable on synthetic tables; `Planner` keeps the per-row estimates
of one batch, and specee_core.spec.costs measures and caches the tables.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from specee_core.machine import measuring_lock
from specee_core.spec.costs import CostTable, load_costs, measure_costs, save_costs
from specee_core.spec.expected import FORCED_PRIOR, Acceptance, expected_tokens_upto, tokens_var
from specee_core.step.policy import Outlook, StepPlan, StepPolicy, batch_bucket

log = logging.getLogger(__name__)

STEP_MARGIN = 1.1  # best_step: the lead over dense's estimated rate a drafted shape must show

# ---- the choice -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowView:
    """What the planner knows of one row at a step."""
    room: int  # drafted tokens the row may still use (tokens left minus the bonus token)
    lookup: int  # length of prompt lookup's continuation found now (0: none)
    alpha_lookup: float
    alpha_draft: float  # 0 without a draft head
    forced: int = 0  # length of the tokens its structured output forces next (a JSON key, punctuation)
    alpha_forced: float = 0.0


def best_step(costs: CostTable, rows: list[RowView], max_depth: int, has_draft: bool,
              margin: float = STEP_MARGIN, overhead: float = 1.0) -> StepPlan:
    """The step shape with the most expected tokens per millisecond for these rows: a dense step, or
    for each depth d <= max_depth, every row's best chain (lookup's, the draft head's or its grammar's
    forced tokens, each no longer than the row's room), verified in one forward of 1 + (longest chain)
    tokens per row, after
    d draft-head levels when any row drafts with it. overhead: what a drafted step really costs over
    the table's estimate, relative to a dense step's (bookkeeping the table does not time). A shape
    must beat dense by `margin`: the model is an estimate, and near a tie a drafted step that misjudged
    its acceptance or its cost loses more than it could gain."""
    n = len(rows)
    dense_ms = costs.verify_ms(n, 1)
    best = StepPlan.dense(n, dense_ms)
    best_rate = n / dense_ms * margin
    # each row's expected tokens at every depth, once per step (not once per shape tried: at 32 rows the shapes'
    # loop called expected_tokens ~800 times a step)
    ahead = [tuple(expected_tokens_upto(a, max_depth) for a in (r.alpha_lookup, r.alpha_draft, r.alpha_forced))
             for r in rows]
    for d in range(1, max_depth + 1):
        for use_draft in ((False, True) if has_draft else (False,)):
            kinds, depths, tokens = [], [], 0.0
            for r, (upto_l, upto_d, upto_f) in zip(rows, ahead):
                dl = min(d, r.lookup, r.room)
                dd = min(d, r.room) if use_draft else 0
                df = min(d, r.forced, r.room)
                el, ed, ef = upto_l[dl], upto_d[dd], upto_f[df]
                if df > 0 and ef >= max(el, ed):
                    kinds.append("forced"), depths.append(df)
                    tokens += ef
                elif dl > 0 and el >= ed:
                    kinds.append("lookup"), depths.append(dl)
                    tokens += el
                elif dd > 0:
                    kinds.append("draft"), depths.append(dd)
                    tokens += ed
                else:
                    kinds.append(""), depths.append(0)
                    tokens += 1.0
            if max(depths) == 0:
                continue
            drafting = kinds.count("draft")
            ms = (costs.verify_ms(n, 1 + max(depths)) + (d * costs.draft_ms(drafting) if drafting else 0.0)) * overhead
            if tokens / ms > best_rate:
                best = StepPlan(d, tuple(kinds), tuple(depths), tokens, ms, dense_ms)
                best_rate = tokens / ms
    if best.depth == 0:
        return best
    alphas = {"lookup": lambda r: r.alpha_lookup, "draft": lambda r: r.alpha_draft, "forced": lambda r: r.alpha_forced}
    var = sum(tokens_var(alphas[k](r), d) for r, k, d in zip(rows, best.kinds, best.depths) if k) / n
    return StepPlan(best.depth, best.kinds, best.depths, best.expected_tokens, best.est_ms, best.dense_ms, var)


def chains_could_pay(costs: CostTable, n: int, alpha: float, max_depth: int, overhead: float = 1.0) -> bool:
    """An upper bound on best_step for n rows whose every chain is accepted with probability at most alpha:
    whether any depth could beat a dense step by STEP_MARGIN were every row to draft that deep at no draft cost.
    False means best_step picks dense for such rows (one row's sums, not the shapes' loop over every row: that loop
    was 0.8% of a dense step at 8 rows held to AVX2, where the table makes every step dense)."""
    dense_rate = n / costs.verify_ms(n, 1) * STEP_MARGIN
    upto = expected_tokens_upto(alpha, max_depth)
    return any(n * upto[d] / (costs.verify_ms(n, 1 + d) * overhead) > dense_rate for d in range(1, max_depth + 1))


def could_pay(costs: CostTable, b: int, max_depth: int, has_draft: bool, alpha: float = 0.9) -> bool:
    """Whether speculation could beat dense decoding at batch size b even if drafts were accepted
    with probability alpha (an optimistic bound: False means never draft at this size)."""
    rows = [RowView(room=max_depth, lookup=max_depth, alpha_lookup=alpha, alpha_draft=alpha if has_draft else 0.0)] * b
    return best_step(costs, rows, max_depth, has_draft).depth > 0


class Planner:
    """Per-row acceptance of one batch and the step choices made from it (owned by its SpecStepper)."""

    def __init__(self, costs: CostTable, rows: int, max_depth: int, has_draft: bool, times: StepPolicy | None = None):
        self.costs, self.max_depth, self.has_draft = costs, max_depth, has_draft
        self.times = times or StepPolicy()
        self.lookup = [Acceptance() for _ in range(rows)]
        self.draft = [Acceptance() for _ in range(rows)]
        self.forced = [Acceptance(prior=FORCED_PRIOR) for _ in range(rows)]
        self.steps: dict[int, int] = {}  # depth chosen -> steps (0: dense)
        self.lookup_hits = self.lookup_tries = 0

    def admit(self, rows: list[int]) -> None:
        for b in rows:
            self.lookup[b], self.draft[b] = Acceptance(), Acceptance()
            self.forced[b] = Acceptance(prior=FORCED_PRIOR)

    def outlook(self, left: list[int] | None, backlog: int) -> Outlook | None:
        """left: the tokens each row may still make; backlog: the pairs the draft head would catch up on first."""
        if not left:
            return None
        pair_ms = self.times.pair_ms if self.times.pair_ms is not None else self.costs.pair_ms()
        return Outlook(sum(left) / len(left), backlog * pair_ms if self.has_draft else 0.0)

    def choose(self, alive: list[int], lookup_lens: list[int], rooms: list[int],
               forced_lens: list[int] | None = None, left: list[int] | None = None, backlog: int = 0) -> StepPlan:
        """The step's plan. rooms: the drafted tokens each row may use now; left, backlog: the outlook of a switch
        to drafting (Planner.outlook; without left, any try the guard would make is made)."""
        forced_lens = forced_lens or [0] * len(alive)
        n, over = len(alive), self.times.overhead(len(alive))
        # the rows' best acceptance over the chains they have (a lookup chain found, forced tokens, the draft head's)
        best = max(max(self.lookup[b].alpha if ln else 0.0, self.forced[b].alpha if fl else 0.0,
                       self.draft[b].alpha if self.has_draft else 0.0)
                   for b, ln, fl in zip(alive, lookup_lens, forced_lens))
        if not chains_could_pay(self.costs, n, best, self.max_depth, over):  # best_step would pick dense: skip its loop
            plan = StepPlan.dense(n, self.costs.verify_ms(n, 1))
        else:
            views = [RowView(room=room, lookup=ln, alpha_lookup=self.lookup[b].alpha,
                             alpha_draft=self.draft[b].alpha if self.has_draft else 0.0,
                             forced=fl, alpha_forced=self.forced[b].alpha)
                     for b, ln, room, fl in zip(alive, lookup_lens, rooms, forced_lens)]
            plan = best_step(self.costs, views, self.max_depth, self.has_draft, overhead=over)
            plan = self.times.check(plan, self.outlook(left, backlog))
        self.steps[plan.depth] = self.steps.get(plan.depth, 0) + 1
        return plan

    def dense_ahead(self, alive: list[int], left: list[int] | None = None, backlog: int = 0) -> StepPlan | None:
        """The dense plan of a step that is dense whatever the table says (StepPolicy.dense_ahead), else None."""
        n = len(alive)
        if not self.times.dense_ahead(n, self.outlook(left, backlog)):
            return None
        self.steps[0] = self.steps.get(0, 0) + 1
        return StepPlan.dense(n, self.costs.verify_ms(n, 1))

    def timed(self, plan: StepPlan, seconds: float, tokens: int, catch_up: float = 0.0,
              catch_up_pairs: int = 0) -> None:
        """The wall time the planned step took, drafting and commit included, and the tokens it committed;
        catch_up: seconds the draft head spent on long backlogs first (not in seconds), catch_up_pairs: on how many
        pairs."""
        n = len(plan.kinds)
        if plan.depth == 0:
            self.times.record("dense", n, plan.dense_ms, seconds * 1e3)
        else:  # against the table's own estimate, before the overhead was applied
            self.times.record("spec", n, plan.est_ms / self.times.overhead(n), seconds * 1e3)
        self.times.made("dense" if plan.depth == 0 else "spec", n, tokens, seconds * 1e3, plan.dense_ms,
                        catch_up * 1e3, catch_up_pairs)

    def observe(self, alive: list[int], plan: StepPlan, accepted: list[int], shadow: list[int | None]) -> None:
        """After a step: accepted[r] of row r's drafted tokens were accepted. shadow[r]: for a row that did
        not verify lookup's chain although lookup had one, whether its first token was the one committed
        (1/0; None: no such chain), free evidence that keeps lookup's estimate current during dense steps."""
        for r, b in enumerate(alive):
            kind, depth = plan.kinds[r], plan.depths[r]
            if kind == "lookup":
                self.lookup[b].observe(depth, accepted[r])
            elif shadow[r] is not None:
                self.lookup[b].observe(1, shadow[r])
            else:
                self.lookup[b].idle()
            if kind == "draft":
                self.draft[b].observe(depth, accepted[r])
            else:
                self.draft[b].idle()
            if kind == "forced":  # no idle drift: a grammar forces nothing most steps, and then this is not asked
                self.forced[b].observe(depth, accepted[r])
            if kind == "lookup" or shadow[r] is not None:
                self.lookup_tries += 1
                self.lookup_hits += int(accepted[r] > 0) if kind == "lookup" else shadow[r]

    def summary(self) -> dict:
        total = max(sum(self.steps.values()), 1)
        return {"plan_steps": {("dense" if d == 0 else f"depth_{d}"): n for d, n in sorted(self.steps.items())},
                "plan_dense_share": self.steps.get(0, 0) / total,
                "lookup_hit_rate": self.lookup_hits / max(self.lookup_tries, 1)}


# ---- the engine's plan -----------------------------------------------------------------------

@dataclass
class SpecPlan:
    """What the engine knows and decided about speculation on this machine: the cost table (measured
    lazily per batch-size bucket, cached on disk) and the limits of the planned shape."""
    dtype: str
    dtype_reason: str
    max_depth: int
    has_draft: bool
    costs: CostTable
    cache_root: str | None = None
    times: StepPolicy = field(default_factory=StepPolicy)  # learned while decoding, not cached

    def ensure(self, model, draft, batch: int) -> None:
        """Measure the batch sizes that stand for batch's and those below it (1, 4, 16, ...: powers of four, and
        batch's bucket; the sizes between are interpolated) that the table lacks (verify forwards up to the
        deepest chain + 1, a draft level with a draft head), under the machine's lock, and save."""
        def missing() -> list[int]:
            top = batch_bucket(batch)
            sizes = sorted({4 ** i for i in range(top.bit_length()) if 4 ** i <= top} | {top})
            return [b for b in sizes if self.costs.lacks(b, self.max_depth + 1, self.has_draft)]

        if not missing():
            return
        with measuring_lock(self.costs.key, self.cache_root):
            self.costs.merge(load_costs(self.costs.key, self.cache_root))  # what another process measured
            need = missing()
            if not need:
                return
            t0 = time.perf_counter()
            for b in need:
                measure_costs(self.costs, model, draft if self.has_draft else None, b, self.max_depth + 1)
            path = save_costs(self.costs, self.cache_root)
        log.info("measured verify and draft costs for batch sizes %s in %.1f s (%s)", need,
                 time.perf_counter() - t0, path)

    def describe(self, batch_sizes: list[int], alpha: float = Acceptance().prior) -> dict:
        """Per batch size: dense tokens/s, and the best speculative shape at acceptance alpha with its
        tokens/s, from the table (what the planner would do with rows it knows nothing about yet)."""
        out = {}
        for b in batch_sizes:
            rows = [RowView(room=self.max_depth, lookup=0, alpha_lookup=alpha,
                            alpha_draft=alpha if self.has_draft else 0.0)] * b
            hit = [RowView(room=self.max_depth, lookup=self.max_depth, alpha_lookup=alpha,
                           alpha_draft=alpha if self.has_draft else 0.0)] * b
            over = self.times.overhead(b)  # what drafted steps have really cost over the table, so far
            p, q = (best_step(self.costs, r, self.max_depth, self.has_draft, overhead=over) for r in (rows, hit))
            out[str(b)] = {
                "dense_tokens_per_s": round(b / p.dense_ms * 1e3, 1),
                "no_lookup_hit": _describe_step(p), "lookup_hit": _describe_step(q),
                "could_pay": could_pay(self.costs, b, self.max_depth, self.has_draft)}
        return out

    def to_json(self, batch_sizes: list[int] | None = None) -> dict:
        sizes = batch_sizes or sorted(self.costs.verify)
        return {"dtype": self.dtype, "dtype_reason": self.dtype_reason, "max_depth": self.max_depth,
                "draft_head": self.has_draft, "costs": self.costs.to_json(),
                "measured_over_table": self.times.to_json(),
                "at_prior_acceptance": Acceptance().prior, "by_batch": self.describe(sizes)}


def _describe_step(p: StepPlan) -> dict:
    if p.depth == 0:
        return {"step": "dense", "why": "no drafted shape beats a dense step's tokens/s"}
    kind = sorted(set(k for k in p.kinds if k))
    return {"step": f"{'+'.join(kind)} chains of {p.depth}", "expected_tokens_per_step": round(p.expected_tokens / len(p.kinds), 2),
            "est_gain_over_dense": round(p.rate_gain, 2)}


__all__ = ["Planner", "RowView", "SpecPlan", "best_step", "chains_could_pay", "could_pay"]
