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
import math
import time
from dataclasses import dataclass, field

from specee_core.machine import measuring_lock
from specee_core.spec.costs import CostTable, batch_bucket, load_costs, measure_costs, save_costs
from specee_core.spec.expected import FORCED_PRIOR, Acceptance, expected_tokens_upto, tokens_var

log = logging.getLogger(__name__)

PROBE_EVERY = 16  # StepTimes.check: steps between a measured check of dense (or of drafting, once behind)
PROBE_MARGIN = 1.25  # drafting's lead over dense's measured rate under which dense is measured anew ...
PROBE_AHEAD = 4  # ... every PROBE_EVERY steps; above it, every PROBE_AHEAD x PROBE_EVERY
TRY_EVERY_MAX = 256
STEP_MARGIN = 1.1  # best_step: the lead over dense's estimated rate a drafted shape must show
TRIAL_STEPS = 4  # StepTimes: drafted steps a try of drafting (while dense was ahead) is judged on, as their mean
# ... and the lead over dense they must show to bring drafting back: a tie does not pay for switching (the draft
# head first catches up on every row's dense stretch, several dense steps' worth at many rows)
TRIAL_MARGIN = 1.1
SWITCH_SHARE = 0.02  # tries of drafting are spaced so what they cost is at most this share of dense's time


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


@dataclass(frozen=True)
class StepPlan:
    """One decode step: depth 0 is a dense step. Per row: "lookup" (its lookup chain), "draft" (the
    draft head's chain), "forced" (the tokens its structured output forces) or "" (the root alone), and
    the depth it drafts."""
    depth: int
    kinds: tuple[str, ...]
    depths: tuple[int, ...]
    expected_tokens: float  # over the batch
    est_ms: float
    dense_ms: float
    token_var: float = 0.0  # the variance of the tokens one row commits in such a step (mean over the rows)

    @classmethod
    def dense(cls, n: int, dense_ms: float) -> StepPlan:
        """A dense step of n rows (the table's dense_ms)."""
        return cls(0, ("",) * n, (0,) * n, float(n), dense_ms, dense_ms)

    @property
    def rate_gain(self) -> float:
        """Expected tokens/s of this step over a dense step's."""
        n = len(self.kinds)
        return (self.expected_tokens / self.est_ms) / (n / self.dense_ms) if self.est_ms > 0 else 1.0


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


@dataclass(frozen=True)
class Outlook:
    """What switching a batch to drafting could still earn and what it costs first: horizon, the tokens its rows
    have left on average (the dense steps drafting could shorten); catch_up_ms, the draft head's catching up on
    the rows' backlog (their prompts and dense stretch: the pairs queued, at the fewest ms per pair timed so far)."""
    horizon: float
    catch_up_ms: float


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


class StepTimes:
    """What steps really take against the cost table's estimate, per kind ("dense", "spec") and batch-size
    bucket: exponentially weighted ratios. Drafted steps carry bookkeeping the table does not time
    (drafting's host work, acceptance, KV compaction), which grows with the batch; their ratio over the
    dense steps' is the overhead best_step charges. Shared by every batch of an engine's plan."""

    def __init__(self, decay: float = 0.8, idle_decay: float = 0.98):  # decay 1: never learns (tests)
        self.decay, self.idle_decay = decay, idle_decay
        self.ratio: dict[tuple[str, int], float] = {}
        # the check on the table's choices: tokens per row per table dense step that each kind of step really made
        self.rate: dict[tuple[str, int], float] = {}
        self.since_probe: dict[int, int] = {}  # steps since a dense step was measured
        self.since_try: dict[int, int] = {}  # steps since drafting was last tried while dense was ahead
        self.try_every: dict[int, int] = {}  # the interval of those tries: doubles while dense stays ahead
        self.trying: set[int] = set()  # buckets whose next drafted step is such a try
        self.trial: dict[int, int] = {}  # drafted steps since a try, while their mean rate is being taken
        self.held: set[int] = set()  # buckets whose last try fell short of TRIAL_MARGIN: dense until the next try
        self.dense_steps: dict[int, int] = {}  # dense steps timed per bucket (the first TRIAL_STEPS: the baseline)
        self.dense_ms: dict[int, float] = {}  # a dense step's wall time per bucket (the last)
        self.switch_ms: dict[int, float] = {}  # what the last try cost per bucket (catching up, its steps, its tail)
        self.probing: set[int] = set()  # buckets whose next dense step re-measures dense behind a thin lead
        # per bucket, from the last drafted plan the table chose: (its lead over dense's rate, the table's dense step
        # ms, the tokens a row commits per drafted step, their variance): what _pays and _tail_ms weigh
        self.prospect: dict[int, tuple[float, float, float, float]] = {}
        # ms per pair the draft head caught up on: the fastest catching up timed (noise only adds time, and a slow
        # first one, a shape's first run, kept as the estimate would rule out tries that are never made to correct it)
        self.pair_ms: float | None = None

    def record(self, kind: str, b: int, est_ms: float, ms: float) -> None:
        """One step's wall time against its estimate. A sample counts at most 3x the estimate (a step that
        first feeds a long backlog of pending pairs to the draft head is not what the next one costs); a
        dense step also moves the drafted steps' ratio back toward the dense one, so one slow drafted
        step cannot rule drafting out for good."""
        bucket = batch_bucket(b)
        r = min(ms / max(est_ms, 1e-6), 3.0)
        key = (kind, bucket)
        self.ratio[key] = self.ratio.get(key, 1.0) * self.decay + r * (1 - self.decay)
        if kind == "dense" and ("spec", bucket) in self.ratio:
            i = self.idle_decay
            self.ratio["spec", bucket] = self.ratio["spec", bucket] * i + self.ratio[key] * (1 - i)

    def made(self, kind: str, b: int, tokens: int, ms: float, dense_ms: float, catch_up_ms: float = 0.0,
             catch_up_pairs: int = 0) -> None:
        """The tokens one step of b rows committed per row over its wall time, in units of the table's dense step
        at b rows (dense_ms): a bucket holds several batch sizes (17 to 32 rows), and a step of 17 rows makes
        more per row and ms than one of 32; counted raw, a drafted step measured while rows were joining beat
        dense steps measured at 32 and kept drafting that lost 10%. A try (a drafted step while dense steps made
        more) and a probe (a dense step behind drafting's thin lead) count alone: one step of fresh evidence
        against the other kind's current rate, not a rate kept from minutes before. A try's steps also carry
        the draft head's catching up on the rows' backlog (their prompts, their dense stretch), spread over the
        PROBE_EVERY steps drafting runs at least if the try succeeds: the cost of switching, which a try must pay
        (a few dense steps' worth at many rows, each time). catch_up_pairs: the pairs it caught up on
        (what the next switch's catching up is estimated from). What a try cost all told (switch_ms: its catching
        up, the time its steps took over what dense steps would have taken for their tokens, and the tail its rows'
        spread leaves) spaces the next (check)."""
        bucket = batch_bucket(b)
        if catch_up_pairs > 0:
            per = catch_up_ms / catch_up_pairs
            self.pair_ms = per if self.pair_ms is None else min(self.pair_ms, per)
        if kind == "dense":
            self.dense_ms[bucket] = ms
        if kind == "spec" and bucket in self.trying:
            self.switch_ms[bucket] = catch_up_ms + self._tail_ms(b, TRIAL_STEPS)
        if kind == "spec" and (bucket in self.trying or bucket in self.trial):
            dense_rate = self.rate.get(("dense", bucket))
            if dense_rate:
                self.switch_ms[bucket] += max(0.0, ms - tokens / b * dense_ms / dense_rate)
            ms += catch_up_ms / PROBE_EVERY
        r = tokens / b * dense_ms / max(ms, 1e-6)
        key = (kind, bucket)
        if kind == "dense":
            self.since_probe[bucket] = 0
            self.dense_steps[bucket] = self.dense_steps.get(bucket, 0) + 1
        fresh = self.trying if kind == "spec" else self.probing
        if key not in self.rate or bucket in fresh:
            self.rate[key] = r
        elif kind == "spec" and bucket in self.trial:  # a try's steps: their plain mean, not the try's step alone
            self.trial[bucket] += 1
            self.rate[key] += (r - self.rate[key]) / self.trial[bucket]
        elif kind == "dense" and self.dense_steps[bucket] <= TRIAL_STEPS:  # the baseline: its steps' plain mean
            self.rate[key] += (r - self.rate[key]) / self.dense_steps[bucket]
        else:
            self.rate[key] = self.rate[key] * self.decay + r * (1 - self.decay)
        if kind == "spec" and bucket in self.trying:
            self.trial[bucket] = 1
        fresh.discard(bucket)

    def check(self, plan: StepPlan, outlook: Outlook | None = None) -> StepPlan:
        """The table's choice held against what steps really made here: the first TRIAL_STEPS steps at a batch
        size are dense, the baseline (one step's rate, a lane's first, was 15% off), the next drafted ones a try (a
        cached table may be from a slower or faster hour); a drafted step becomes a dense step while dense steps
        have made more tokens than drafted ones at this batch size, or since a try fell short of TRIAL_MARGIN
        (drafting is tried again after PROBE_EVERY steps, then at doubling intervals); while drafting makes less
        than 1.25x dense's measured rate, one step in PROBE_EVERY is dense, to measure it anew. What this guards:
        a table measured on a bad minute, or host work a table cannot see (on a GPU, launches), that would make
        auto slower than dense. A try is made only where it could pay for switching (_pays, given the outlook)."""
        if self.decay >= 1.0 or plan.depth == 0:
            return plan
        n = len(plan.kinds)
        k = batch_bucket(n)
        self.prospect[k] = (plan.rate_gain, plan.dense_ms, plan.expected_tokens / n, plan.token_var)
        spec, dense = self.rate.get(("spec", k)), self.rate.get(("dense", k))
        as_dense = StepPlan.dense(n, plan.dense_ms)
        if dense is None or self.dense_steps.get(k, 0) < TRIAL_STEPS:
            return as_dense  # the first steps at a batch size are dense, whatever the (cached) table says: the baseline
        if spec is None:  # then drafting, as a try: the table's choice is held to what its first steps make
            if not self._pays(n, outlook):
                return as_dense
            self.trying.add(k)
            return plan
        in_trial = k in self.trial
        if in_trial and self.trial[k] >= TRIAL_STEPS:
            # a try is judged on its TRIAL_STEPS steps' mean, not on one step (one lucky step would bring back
            # drafting that loses on average): drafting is back for good (tries at PROBE_EVERY again) only with a
            # lead of TRIAL_MARGIN
            del self.trial[k]
            in_trial = False
            if spec >= TRIAL_MARGIN * dense:
                self.held.discard(k)
            else:
                self.held.add(k)
        if self._drafting(k, spec, dense):
            if not in_trial:
                if not self._pays(n, outlook, spec / dense):  # drafting on to the end must pay, at its measured lead
                    self._dense_instead(k, spec, dense)
                    return as_dense
                self.try_every[k] = PROBE_EVERY
            # a lead under PROBE_MARGIN is held against a fresh dense step every PROBE_EVERY steps: dense's rate
            # goes stale while only drafted steps run (a machine's speed moves; contexts grow), and a stale one
            # keeps drafting that now loses. A probe costs at most the thin lead, once in PROBE_EVERY. A larger
            # lead is held against one every PROBE_AHEAD x PROBE_EVERY steps: a dense rate taken from a process's
            # first steps at a size (their shapes' first runs) can make drafting look ahead for good while it
            # loses end to end.
            self.since_probe[k] = self.since_probe.get(k, 0) + 1
            every = PROBE_EVERY if spec < PROBE_MARGIN * dense else PROBE_AHEAD * PROBE_EVERY
            if self.since_probe[k] >= every:
                self.probing.add(k)
                return as_dense
            return plan
        self._dense_instead(k, spec, dense)
        if self.since_try[k] >= self._try_gap(k) and self._pays(n, outlook):
            self.since_try[k] = 0
            self.try_every[k] = min(2 * self.try_every.get(k, PROBE_EVERY), TRY_EVERY_MAX)  # the next, should this fail
            self.trying.add(k)
            return plan
        return as_dense

    def _try_gap(self, k: int) -> int:
        """Steps from a try of drafting at bucket k that fell short to the next: try_every (PROBE_EVERY, doubling with
        each try), and far enough that what the last try cost (catching the draft head up, its steps' deficit, its
        tail) is at most SWITCH_SHARE of the dense steps between; at most TRY_EVERY_MAX. Where catching up costs several
        dense steps, doubling alone would try again and again within one call; the first try's cost spaces the
        second too."""
        spaced = self.switch_ms.get(k, 0.0) / (SWITCH_SHARE * max(self.dense_ms.get(k, 1.0), 1e-3))
        return min(max(self.try_every.get(k, PROBE_EVERY), math.ceil(spaced)), TRY_EVERY_MAX)

    def dense_ahead(self, n: int, outlook: Outlook | None = None) -> bool:
        """Whether a step of n rows is dense whatever the table would choose (past the baseline, drafting may not
        run, and no try of drafting is due or could pay), counted as check counts such a step. The stepper then
        runs a plain dense step: no lookups, no plan (at 32 rows that host work cost 4% of a step)."""
        k = batch_bucket(n)
        spec, dense = self.rate.get(("spec", k)), self.rate.get(("dense", k))
        if self.decay >= 1.0 or dense is None or self.dense_steps.get(k, 0) < TRIAL_STEPS:
            return False
        if spec is None:  # no try yet: planned until the table's choice is seen not to pay for switching
            return k in self.prospect and not self._pays(n, outlook)
        if self._drafting(k, spec, dense):
            if k in self.trial or self._pays(n, outlook, spec / dense):
                return False
        elif self.since_try.get(k, 0) + 1 >= self._try_gap(k) and self._pays(n, outlook):
            return False  # a try is due: the step is planned
        self._dense_instead(k, spec, dense)
        return True

    def _pays(self, n: int, outlook: Outlook | None, lead: float | None = None) -> bool:
        """Whether drafting n rows from now on could pay for itself: at `lead` over dense (by default the table's,
        for the last drafted plan at this size: what a try tests), the tokens the rows have left would save more
        time than the draft head's catching up and the tail that drafting leaves. Rows drafted to the end finish
        unevenly (a step commits 1 to depth + 1 tokens a row), and the last steps run for the rows furthest behind:
        at n rows the last is about sqrt(2 ln n) standard deviations of a row's tokens behind (those steps are
        costed as dense steps of n rows). A short call at many rows cannot earn those steps and the catching up back
        at a thin lead, and drafting that leads dense's steps by a few percent can lose end to end. Where rows keep
        coming, the rows' horizon is what the
        ones running now have left: the tail is then counted though new rows would fill it."""
        k = batch_bucket(n)
        if outlook is None or k not in self.prospect:
            return True
        table_lead, dense_ms, per_step, _ = self.prospect[k]
        saved = (1 - 1 / max(table_lead if lead is None else lead, 1.0)) * dense_ms  # per dense step's tokens
        return saved * outlook.horizon >= outlook.catch_up_ms + self._tail_ms(n, outlook.horizon / max(per_step, 1.0))

    def _tail_ms(self, n: int, steps: float) -> float:
        """What the rows furthest behind cost at the end after n rows drafted `steps` steps as the last drafted
        plan at this size would (its tokens a row per step, their variance): about sqrt(2 ln n) standard
        deviations of a row's tokens, in steps, each costed as a dense step of n rows."""
        got = self.prospect.get(batch_bucket(n))
        if got is None or n <= 1:
            return 0.0
        _, dense_ms, per_step, var = got
        per_step = max(per_step, 1.0)
        return math.sqrt(2 * math.log(n) * steps * var) / per_step * dense_ms

    def _drafting(self, k: int, spec: float, dense: float) -> bool:
        """Whether drafted steps may run at bucket k: a try's steps under way while they keep up with dense, or
        drafting ahead of dense and not held back by a try that fell short."""
        return spec >= dense and (k in self.trial or k not in self.held)

    def _dense_instead(self, k: int, spec: float, dense: float) -> None:
        """A step at bucket k that runs dense because drafting may not: counted toward the next try."""
        if spec < dense:
            self.held.add(k)  # a try that fell behind (the interval it doubled stands), or drafting that did
        self.trial.pop(k, None)
        self.since_try[k] = self.since_try.get(k, 0) + 1

    def overhead(self, b: int) -> float:
        k = batch_bucket(b)
        return self.ratio.get(("spec", k), 1.0) / self.ratio.get(("dense", k), 1.0)

    def to_json(self) -> dict:
        # copies: the engine thread may add keys while /healthz reads
        return {**{f"{kind}@{b}": round(r, 3) for (kind, b), r in sorted(dict(self.ratio).items())},
                **{f"{kind}_rate@{b}": round(r, 4) for (kind, b), r in sorted(dict(self.rate).items())}}


class Planner:
    """Per-row acceptance of one batch and the step choices made from it (owned by its SpecStepper)."""

    def __init__(self, costs: CostTable, rows: int, max_depth: int, has_draft: bool, times: StepTimes | None = None):
        self.costs, self.max_depth, self.has_draft = costs, max_depth, has_draft
        self.times = times or StepTimes()
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
        """The dense plan of a step that is dense whatever the table says (StepTimes.dense_ahead), else None."""
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
    times: StepTimes = field(default_factory=StepTimes)  # learned while decoding, not cached

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


__all__ = ["Outlook", "Planner", "RowView", "SpecPlan", "StepPlan", "best_step", "chains_could_pay", "could_pay"]
