"""The step policy: whether a decode step runs dense or does something that may beat it (a drafted shape in mode
auto, early exit in mode specee), from costs measured on the machine at hand.

One `StepPolicy` per engine holds what its steps really cost: per batch-size bucket, the wall time of dense and of
drafted steps against the cost table's estimates and the tokens each kind made (what mode auto's planner weighs
and checks, `check` / `dense_ahead`), and, per set of early-exit options, SpecEE's costs over a dense step
(`PayOffCosts`, timed once by the first `PayOffGate`). Two rules read it:

- drafting (`StepPolicy.check`, lossless): a drafted step runs where the measured rates say it makes more tokens per
  ms than dense steps, with tries and probes so that a stale measurement cannot keep the wrong kind for good;
- early exit (`PayOffGate`, lossy): whole windows of SpecEE steps run where the layers their exits skip pay for
  the draft head and predictors at the timed costs. Once those are timed, it decides from the exits alone, so a
  lossy batch's outputs do not depend on how fast a step happened to run.

Dense steps are exact under both rules: the policy never changes what a lossless mode outputs.
"""
from __future__ import annotations

import math
import statistics
import weakref
from dataclasses import dataclass

PROBE_EVERY = 16  # StepPolicy.check: steps between a measured check of dense (or of drafting, once behind)
PROBE_MARGIN = 1.25  # drafting's lead over dense's measured rate under which dense is measured anew ...
PROBE_AHEAD = 4  # ... every PROBE_EVERY steps; above it, every PROBE_AHEAD x PROBE_EVERY
TRY_EVERY_MAX = 256
TRIAL_STEPS = 4  # StepPolicy: drafted steps a try of drafting (while dense was ahead) is judged on, as their mean
# ... and the lead over dense they must show to bring drafting back: a tie does not pay for switching (the draft
# head first catches up on every row's dense stretch, several dense steps' worth at many rows)
TRIAL_MARGIN = 1.1
SWITCH_SHARE = 0.02  # tries of drafting are spaced so what they cost is at most this share of dense's time


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


@dataclass(frozen=True)
class Outlook:
    """What switching a batch to drafting could still earn and what it costs first: horizon, the tokens its rows
    have left on average (the dense steps drafting could shorten); catch_up_ms, the draft head's catching up on
    the rows' backlog (their prompts and dense stretch: the pairs queued, at the fewest ms per pair timed so far)."""
    horizon: float
    catch_up_ms: float


def batch_bucket(b: int) -> int:
    """The measured batch size that stands for b: the next power of two."""
    return 1 << max(0, (b - 1).bit_length())


@dataclass(frozen=True)
class PayOffCosts:
    """What SpecEE's steps cost here, timed once per engine and options: a SpecEE step's extra work (draft
    head, predictors) as a share of a dense step, and the share of a dense step spent in decoder layers."""
    overhead: float
    layer_share: float

    def pays(self, skipped_per_step: float, num_layers: int) -> bool:
        """Whether skipping this many layers per step saves more than the extra work costs."""
        return skipped_per_step / num_layers * self.layer_share > self.overhead


class PayOffGate:
    """Whether SpecEE steps pay for their draft head and predictors on the machine at hand (a third level
    of scheduling, over whole steps); one per batch.

    SpecEE steps run in windows of `window` steps. After a window, the layers its exits skipped per
    step are weighed against PayOffCosts: if they do not pay, `backoff` dense steps follow (every layer,
    no draft, no predictors), doubling up to `max_backoff` while SpecEE keeps losing; a window that pays
    resets the backoff; a window whose exits skipped nothing never pays. The costs are timed once per
    engine and early-exit options (the engine's StepPolicy keeps them under `key`): the first window's SpecEE
    steps against `probe` dense steps after it. From then on the
    gate decides from the exits alone, so a batch's output does not depend on timing. Dense steps are
    exact: the gate never adds disagreement. Audited steps (exited rows run every layer on purpose)
    count the layers their exits would have skipped, and are not timed.

    `prior_skip`: the layers per step the exits at these thresholds skip on the calibration tokens
    (None: unknown). Where they would not pay for the costs (and where they are 0: nothing to pay
    with, costs or not), the batch starts with `max_backoff` dense steps, then checks its own exits in
    a window: a short generation whose exits cannot pay runs as fast as dense."""

    def __init__(self, policy: StepPolicy, key, num_layers: int, window: int = 16, probe: int = 4, backoff: int = 16,
                 max_backoff: int = 256, prior_skip: float | None = None):
        if min(window, probe, backoff) < 1 or max_backoff < backoff:
            raise ValueError("window, probe and backoff must be >= 1 and max_backoff >= backoff")
        self.policy, self.key, self.num_layers = policy, key, num_layers  # policy.pay_off[key]: once timed
        self.window, self.probe, self.backoff, self.max_backoff = window, probe, backoff, max_backoff
        self.mode, self._left, self._next_backoff = "specee", window, backoff
        self.dense_steps = self.specee_steps = 0
        self._skipped = 0.0  # layers skipped by the window's exits
        self._spec: list[float] = []  # the window's step times (timing the costs)
        self._dense: list[tuple[float, float]] = []  # probe steps: (seconds, seconds in layers)
        self._probing = False
        costs = self.costs
        if prior_skip is not None and (prior_skip <= 0 or (costs is not None and not costs.pays(prior_skip, num_layers))):
            self._go("dense", max_backoff)
            self._next_backoff = max_backoff

    @property
    def costs(self) -> PayOffCosts | None:
        return self.policy.pay_off.get(self.key)

    def dense_next(self) -> bool:
        return self.mode == "dense"

    def record_specee(self, skipped: float, seconds: float | None) -> None:
        """A SpecEE step whose exits skipped `skipped` layers took `seconds` (None: not timed)."""
        self.specee_steps += 1
        self._skipped += skipped
        if seconds is not None and self.costs is None:
            self._spec.append(seconds)
        self._left -= 1
        if self._left > 0:
            return
        if self.costs is None and self._spec:
            self._probing = True
            self._go("dense", self.probe)
        else:
            self._decide()

    def record_dense(self, seconds: float, layer_seconds: float) -> None:
        self.dense_steps += 1
        if self._probing:
            self._dense.append((seconds, layer_seconds))
        self._left -= 1
        if self._left > 0:
            return
        if self._probing:
            self._probing = False
            self._time_costs()
            self._decide()
        else:
            self._go("specee", self.window)

    def _time_costs(self) -> None:
        if self.costs is not None:  # another batch timed them meanwhile
            return
        dense = statistics.median(t for t, _ in self._dense)
        layer_share = min(1.0, statistics.median(lt / t for t, lt in self._dense))
        spec = statistics.median(self._spec)
        skipped = self._skipped / max(self.window, 1)  # this window's exits made its steps cheaper: add it back
        overhead = spec / dense - 1 + skipped / self.num_layers * layer_share
        self.policy.pay_off[self.key] = PayOffCosts(overhead=overhead, layer_share=layer_share)

    def _decide(self) -> None:
        skipped, steps = self._skipped, self.window
        self._skipped = 0.0
        costs = self.costs
        if skipped > 0 and (costs is None or costs.pays(skipped / steps, self.num_layers)):
            self._next_backoff = self.backoff
            self._go("specee", self.window)
        else:
            self._go("dense", self._next_backoff)
            self._next_backoff = min(2 * self._next_backoff, self.max_backoff)

    def _go(self, mode: str, steps: int) -> None:
        self.mode, self._left = mode, steps

class StepPolicy:
    """An engine's measured step costs and the drafting rule (the module's docstring). What steps really take
    against the cost table's estimate, per kind ("dense", "spec") and batch-size bucket: exponentially weighted
    ratios. Drafted steps carry bookkeeping the table does not time (drafting's host work, acceptance, KV
    compaction), which grows with the batch; their ratio over the dense steps' is the overhead best_step charges.
    Shared by every batch of the engine; `pay_off` holds SpecEE's timed costs per early-exit configuration (its
    PayOffGates' key: the EarlyExit object, held weakly)."""

    def __init__(self, decay: float = 0.8, idle_decay: float = 0.98):  # decay 1: never learns (tests)
        self.decay, self.idle_decay = decay, idle_decay
        self.pay_off: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # key -> PayOffCosts (PayOffGate)
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


