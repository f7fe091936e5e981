"""The measured plan (specee_core.spec.plan): the step choice on synthetic cost tables, acceptance that
collapses, dtype auto both ways, the cost cache, and mode="auto" equal to dense (greedy, fp32)."""
from __future__ import annotations

import json

import pytest
import torch

from specee_core import SamplingParams, SpecEEEngine
from specee_core.machine import choose_dtype
from specee_core.spec.costs import T_GRID, CostTable, monotone
from specee_core.spec.expected import FORCED_PRIOR, Acceptance, expected_tokens, tokens_var
from specee_core.spec.plan import Planner, RowView, best_step, chains_could_pay, could_pay
from specee_core.step.policy import PROBE_AHEAD, PROBE_EVERY, TRIAL_STEPS, Outlook, StepPlan, StepPolicy
from tests.conftest import BUNDLED, make_hf_model

CODE = ["import os\nimport sys\n\n\ndef main(argv=None):\n", "class Point:\n    def __init__(self, x, y):\n",
        "    def __repr__(self):\n        return", "for key, value in sorted(items.items()):\n",
        "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"]
SIZES = (1, 2, 4, 8, 16, 32)  # every bucket up to the engine's max batch: nothing is measured into these


def table(verify, draft_ms: float = 1.0) -> CostTable:
    """A synthetic table: verify(b, t) ms for every measured batch size and T."""
    return CostTable(key={"synthetic": True}, verify={b: [verify(b, t) for t in T_GRID] for b in SIZES},
                     draft={b: draft_ms for b in SIZES})


FLAT = table(lambda b, t: 10.0 + 0.02 * t, draft_ms=0.5)  # weight-bound: bf16 on AVX-512, GPUs
LINEAR = table(lambda b, t: 10.0 * t * b, draft_ms=1.0)  # compute-bound: fp32 on a 2-core AVX2 CPU
STEEP = table(lambda b, t: 10.0 * b if t == 1 else 14.0 * b + 0.5 * t * b, draft_ms=1.0)  # a verify step costs 1.5x dense


def fresh_rows(n: int, lookup: int = 0) -> list[RowView]:
    a = Acceptance().alpha
    return [RowView(room=4, lookup=lookup, alpha_lookup=a, alpha_draft=a)] * n


def test_flat_verify_cost_drafts_the_deepest_chains():
    for b in (1, 8, 16):
        p = best_step(FLAT, fresh_rows(b), max_depth=4, has_draft=True)
        assert p.depth == 4 and set(p.kinds) == {"draft"} and p.rate_gain > 1.5, (b, p)
        q = best_step(FLAT, fresh_rows(b, lookup=3), max_depth=4, has_draft=False)
        assert q.depth >= 3 and set(q.kinds) == {"lookup"}, (b, q)
    assert could_pay(FLAT, 16, 4, True)


def test_cost_linear_in_t_steps_dense_even_with_perfect_drafts():
    rows = [RowView(room=4, lookup=4, alpha_lookup=0.99, alpha_draft=0.99)] * 8
    p = best_step(LINEAR, rows, max_depth=4, has_draft=True)
    assert p.depth == 0 and p.est_ms == p.dense_ms == LINEAR.verify_ms(8, 1)
    assert not could_pay(LINEAR, 1, 4, True)


def test_chains_could_pay_bounds_best_step_from_above():
    """Where no chain could beat dense for rows whose every chain is accepted with at most the rows' best alpha,
    best_step picks dense: on random rows and tables (the planner then skips best_step's loop)."""
    gen = torch.Generator().manual_seed(0)
    skipped = 0
    def uniform() -> float:
        return float(torch.rand(1, generator=gen))

    def upto(k: int) -> int:
        return int(torch.randint(0, k, (1,), generator=gen))

    for _ in range(400):
        slope, n = uniform() * 12, 1 + upto(32)
        costs = table(lambda b, t: 10.0 * b ** 0.5 + slope * (t - 1) * b ** 0.5, draft_ms=uniform())
        rows = [RowView(room=upto(5), lookup=upto(5), alpha_lookup=uniform(), alpha_draft=uniform()) for _ in range(n)]
        best = max(max(r.alpha_lookup if r.lookup else 0.0, r.alpha_draft) for r in rows)
        if not chains_could_pay(costs, n, best, 4):
            skipped += 1
            assert best_step(costs, rows, 4, True).depth == 0
    assert 50 < skipped < 350, skipped  # both sides seen
    assert not chains_could_pay(LINEAR, 8, 0.99, 4) and chains_could_pay(FLAT, 8, Acceptance().alpha, 4)


def test_a_row_without_room_or_lookup_hit_verifies_its_root_alone():
    rows = [RowView(room=0, lookup=0, alpha_lookup=0.9, alpha_draft=0.9),
            RowView(room=4, lookup=4, alpha_lookup=0.9, alpha_draft=0.0)]
    p = best_step(FLAT, rows, max_depth=4, has_draft=True)
    assert p.kinds == ("", "lookup") and p.depths == (0, 4)


def test_a_rows_forced_tokens_are_verified_where_its_draft_would_lose_and_learned_like_drafts():
    """A row whose grammar forces 3 tokens verifies them (no draft forward) even where the table makes the
    draft head's chains not worth their cost; a row with nothing forced stays as it was; forced tokens that
    keep failing are tried no more."""
    a = Acceptance().alpha
    rows = [RowView(room=4, lookup=0, alpha_lookup=a, alpha_draft=0.3, forced=3, alpha_forced=FORCED_PRIOR),
            RowView(room=4, lookup=0, alpha_lookup=a, alpha_draft=0.3)]
    p = best_step(STEEP, rows, max_depth=4, has_draft=True)
    assert p.kinds[0] == "forced" and p.depths[0] == 3 and p.kinds[1] in ("", "draft"), p
    assert best_step(STEEP, rows[1:], max_depth=4, has_draft=True).depth == 0
    planner = Planner(STEEP, rows=1, max_depth=4, has_draft=True, times=StepPolicy(decay=1.0))  # no wall-time check
    for _ in range(5):
        plan = planner.choose([0], [0], [4], [3])
        assert plan.kinds == ("forced",)
        planner.observe([0], plan, [3], [None])
    for step in range(1, 20):
        plan = planner.choose([0], [0], [4], [3])
        if plan.kinds != ("forced",):
            break
        planner.observe([0], plan, [0], [None])
    assert step <= 5, f"still verifying forced tokens {step} steps after they stopped being accepted"


def test_acceptance_collapse_stops_drafting_within_a_few_steps_and_it_probes_again_later():
    planner = Planner(STEEP, rows=1, max_depth=4, has_draft=True, times=StepPolicy(decay=1.0))  # acceptance alone
    for _ in range(30):  # the draft head is right every time: it drafts, soon as deep as it may
        plan = planner.choose([0], [0], [4])
        assert plan.depth > 0 and plan.kinds == ("draft",)
        planner.observe([0], plan, [plan.depth], [None])
    assert plan.depth == 4
    for step in range(1, 20):  # then never
        plan = planner.choose([0], [0], [4])
        if plan.depth == 0:
            break
        planner.observe([0], plan, [0], [None])
    assert step <= 5, f"still drafting {step} steps after acceptance collapsed"
    probes = 0
    for _ in range(100):  # dense steps draw the estimate back toward the prior: now and then it tries again
        plan = planner.choose([0], [0], [4])
        probes += plan.depth > 0
        planner.observe([0], plan, [0], [None])
    assert 1 <= probes <= 5, probes


def run_steps(planner: Planner, steps: int, spec_ms, dense_ms: float = 10.0) -> list[int]:
    """Steps of one row whose drafts are always accepted, each taking the given wall time (spec_ms(depth) for
    a drafted step): the depths chosen. The table says drafting pays; these times say what it made."""
    depths = []
    for _ in range(steps):
        plan = planner.dense_ahead([0]) or planner.choose([0], [0], [4])  # as SpecStepper._planned_step asks
        made = plan.depth + 1
        planner.timed(plan, (spec_ms(plan.depth) if plan.depth else dense_ms) / 1e3, made)
        planner.observe([0], plan, [plan.depth], [None])
        depths.append(plan.depth)
    return depths


def test_drafted_steps_that_make_less_than_dense_steps_turn_dense_and_are_tried_again_at_doubling_intervals():
    """The table (flat: drafting is nearly free) is wrong here: a drafted step takes 60 ms for 5 tokens, a
    dense one 10 ms for 1. The first 4 steps are dense (the baseline); the first drafted step, a try, falls behind
    and drafting stops at once; it is tried again 51 steps on (at least PROBE_EVERY, doubling with each try, and far
    enough that the 10 ms each try lost is at most SWITCH_SHARE of the dense time between); once a try makes more
    than dense, drafting is back (but for a dense step in every PROBE_AHEAD x PROBE_EVERY, to keep dense's rate
    current)."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    first = run_steps(planner, 100, lambda d: 60.0)
    assert [i for i, d in enumerate(first) if d] == [4, 55], first
    again = run_steps(planner, 200, lambda d: 10.0)  # now a drafted step makes 5 tokens in a dense step's time
    assert again[-128:].count(4) == 126 and set(again[-128:]) == {0, 4}, again
    back = next(i for i, d in enumerate(again) if d)
    assert back <= 51 - (100 - 55), back  # the next try, 51 steps after the last


def test_a_lucky_try_does_not_bring_back_drafting_that_loses_on_average():
    """A drafted step right after dense ones is fast (5 tokens in 40 ms: the draft head had a short backlog, the
    acceptance a good stretch), the next ones slow (70 ms): on average drafting makes 0.08 tokens per ms against
    dense's 0.1. A try is judged on the mean of its first TRIAL_STEPS steps, so the lucky first one neither keeps
    drafting going nor resets the doubling interval. Judged on the try alone, drafting came back every 16 steps
    for 4 (a quarter of all steps, each losing)."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    depths, last = [], 0
    for _ in range(400):
        plan = planner.choose([0], [0], [4])
        ms = 10.0 if plan.depth == 0 else (40.0 if last == 0 else 70.0)
        planner.timed(plan, ms / 1e3, plan.depth + 1)
        planner.observe([0], plan, [plan.depth], [None])
        depths.append(plan.depth)
        last = plan.depth
    tail = depths[100:]
    assert sum(1 for d in tail if d) <= 8, tail  # tries at doubling intervals, 2 steps each


@pytest.mark.parametrize("spec_ms, back", [(47.6, False), (41.7, True)], ids=["5%-lead", "20%-lead"])
def test_drafting_comes_back_after_dense_stretches_only_with_a_lead_that_pays_for_switching(spec_ms, back):
    """Drafted steps first lose (60 ms for 5 tokens against dense's 10 ms for 1), then make 1.05x or 1.2x dense's
    rate. A try's TRIAL_STEPS steps must lead by TRIAL_MARGIN to bring drafting back: a 5% lead stays dense but
    for tries at doubling intervals (4 in 300 steps; switching costs the draft head's catching up); a 20% lead
    drafts again."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    run_steps(planner, 40, lambda d: 60.0)
    after = run_steps(planner, 300, lambda d: spec_ms)
    drafted = sum(1 for d in after if d)
    assert (drafted > 250) if back else (drafted <= 4 * TRIAL_STEPS), after


def test_steps_of_different_sizes_in_one_bucket_are_compared_per_table_dense_step():
    """Dense steps of 32 rows take the table's 42 ms; a drafted step of 17 rows (the same bucket) makes 1.2 tokens
    a row in 1.4x the table's dense step at 17 rows: it loses. Per row and ms it made 0.032 against dense's 0.024,
    which kept drafting before; per table dense step it made 0.86 against 1.0."""
    times = StepPolicy()
    times.made("dense", 32, 32, 42.0, 42.0)
    times.made("spec", 17, int(17 * 1.2), 27.0 * 1.4, 27.0)
    drafted = StepPlan(1, ("draft",) * 32, (1,) * 32, 48.0, 60.0, 42.0)
    assert times.check(drafted).depth == 0


@pytest.mark.parametrize("catch_up_ms, drafts", [(0.0, True), (160.0, False)], ids=["no-backlog", "long-backlog"])
def test_a_try_pays_for_the_draft_heads_catching_up(catch_up_ms, drafts):
    """After 4 dense steps (20 ms for 16 tokens), a try makes 1.3x dense's tokens in a dense step's time, but the
    draft head first caught up on 160 ms of backlog (the rows' prompts, their dense stretch): spread over the 16
    steps drafting would run at least, that is 10 ms a step, and the try falls behind; with no backlog it leads."""
    times = StepPolicy()
    for _ in range(TRIAL_STEPS):
        times.made("dense", 16, 16, 20.0, 20.0)
    drafted = StepPlan(1, ("draft",) * 16, (1,) * 16, 24.0, 20.0, 20.0)
    assert times.check(drafted).depth == 1  # the try
    times.made("spec", 16, int(16 * 1.3), 20.0, 20.0, catch_up_ms)
    assert (times.check(drafted).depth == 1) is drafts


def test_tries_are_spaced_by_what_catching_up_cost():
    """Each try of drafting at 32 rows costs the draft head 100 ms of catching up and loses; dense steps take 25 ms.
    Each next try waits until that cost is at most SWITCH_SHARE of the dense time between: 100 / (0.02 x 25) = 200
    steps; the first try's cost spaces the second too (it came 16 steps after the first before)."""
    times = StepPolicy()
    drafted = StepPlan(1, ("draft",) * 32, (1,) * 32, 48.0, 40.0, 25.0)
    tries = []
    for step in range(400):
        plan = times.check(drafted)
        if plan.depth:
            tries.append(step)
            times.made("spec", 32, 32, 40.0, 25.0, catch_up_ms=100.0)
        else:
            times.made("dense", 32, 32, 25.0, 25.0)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert all(g >= 200 for g in gaps) and len(tries) >= 2, tries


def test_tries_are_spaced_by_all_they_cost_not_only_catching_up():
    """8 rows, no backlog to catch up on, but each try's step makes 1.6 tokens a row in 20 ms where dense steps
    would take 16 (4 ms lost) and leaves the rows ~2 tokens apart (1.25 steps of 10 ms at the end): 16.5 ms a try.
    Spaced by catching up alone (nothing) tries came every 16, 32, 64 steps; now each next waits until that is at
    most SWITCH_SHARE of the dense time between: 16.5 / (0.02 x 10) = 83 steps."""
    times = StepPolicy()
    drafted = StepPlan(1, ("draft",) * 8, (1,) * 8, 12.8, 10.0, 10.0, tokens_var(0.6, 1))
    tries = []
    for step in range(400):
        if times.check(drafted).depth:
            tries.append(step)
            times.made("spec", 8, 13, 20.0, 10.0)
        else:
            times.made("dense", 8, 8, 10.0, 10.0)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert all(g >= 80 for g in gaps) and len(tries) >= 3, tries


def test_a_thin_lead_is_held_against_fresh_dense_steps():
    """Drafting makes 5 tokens in 45 ms, a dense step 1 in 10: an 11% lead, under PROBE_MARGIN, so one step in
    16 is dense, to keep dense's rate current. When dense steps get twice as fast (the machine's speed moved,
    or the contexts), the next such step sees it and dense takes over; dense's rate kept from before would
    have gone on drafting at half dense's speed."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    before = run_steps(planner, 64, lambda d: 45.0, dense_ms=10.0)
    assert 6 <= before.count(0) <= 7 and set(before) == {0, 4}, before  # 4 to start, then 1 in 16
    after = run_steps(planner, 64, lambda d: 45.0, dense_ms=5.0)
    assert after[17:].count(0) >= 44, after  # at most a few tries of drafting once dense is ahead


def test_drafting_well_ahead_of_a_measured_dense_step_is_not_stopped_again():
    """The first steps are dense, whatever the (cached) table says (it may be from another hour); drafting 4x ahead
    of it (5 tokens in 12 ms against dense's 1 in 10) is never stopped again but for one dense step in every
    PROBE_AHEAD x PROBE_EVERY, which keeps dense's rate current."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    every = PROBE_AHEAD * PROBE_EVERY
    probes = [TRIAL_STEPS + every * i for i in range(1, 4)]
    assert run_steps(planner, 200, lambda d: 12.0) == [0 if i < TRIAL_STEPS or i in probes else 4 for i in range(200)]


def test_a_dense_rate_from_slow_first_steps_is_measured_again_behind_a_large_lead():
    """A process's first dense steps at a size are slow (their shapes' first runs: 16 ms where later ones take 10),
    and drafted steps make 5 tokens in 42 ms: 1.9x the stale dense rate, 1.2x the true one. Before, no dense step
    ran again behind a lead over PROBE_MARGIN and drafting went on for good; the next probe (PROBE_AHEAD x
    PROBE_EVERY steps on) measures dense at 10 ms, and drafting, now short of PROBE_MARGIN, is held to a fresh dense
    step every PROBE_EVERY."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    run_steps(planner, TRIAL_STEPS, lambda d: 42.0, dense_ms=20.0)
    later = run_steps(planner, 200, lambda d: 42.0, dense_ms=10.0)
    assert [i for i, d in enumerate(later) if d == 0] == list(range(PROBE_AHEAD * PROBE_EVERY, 200, PROBE_EVERY)), later


def test_tokens_var_is_the_variance_of_a_chains_committed_tokens():
    """Against a sampled chain: each drafted token accepted with probability alpha while every one before was."""
    gen = torch.Generator().manual_seed(0)
    for alpha, depth in ((0.6, 1), (0.6, 4), (0.9, 3), (0.0, 2)):
        acc = torch.rand(200_000, depth, generator=gen) < alpha
        committed = 1 + acc.int().cumprod(1).sum(1).double()
        assert abs(committed.mean().item() - expected_tokens(alpha, depth)) < 0.01
        assert abs(committed.var().item() - tokens_var(alpha, depth)) < 0.02, (alpha, depth)
    p = best_step(FLAT, fresh_rows(4), max_depth=4, has_draft=True)
    assert p.token_var == pytest.approx(tokens_var(Acceptance().alpha, p.depth))


def drafting_times(n: int, lead: float, measured: float | None = None) -> tuple[StepPolicy, StepPlan]:
    """StepPolicy at n rows after the baseline, and a drafted plan the table puts `lead` ahead of dense (25 ms a
    step, 1.6 tokens a row per drafted step); measured: a try has led by 1.2x, then drafted steps by this."""
    times = StepPolicy()
    for _ in range(TRIAL_STEPS):
        times.made("dense", n, n, 25.0, 25.0)
    tokens = 1.6 * n
    plan = StepPlan(1, ("draft",) * n, (1,) * n, tokens, tokens / n * 25.0 / lead, 25.0, tokens_var(0.6, 1))
    if measured is not None:
        for i in range(TRIAL_STEPS + 30):
            if times.check(plan).depth:
                times.made("spec", n, tokens, 1.6 * 25.0 / (1.2 if i < TRIAL_STEPS else measured), 25.0)
            else:
                times.made("dense", n, n, 25.0, 25.0)
    return times, plan


@pytest.mark.parametrize("left, tries", [(64, False), (512, True)])
def test_a_try_is_made_only_where_the_rows_left_could_pay_for_switching(left, tries):
    """32 rows, the table's drafted plan 1.1x dense's rate, the draft head's catching up 90 ms: over 64 tokens a
    row (a one-shot call) the 2.3 ms a step saved (150 ms) cannot pay for the catching up and the tail, the ~5
    steps the rows furthest behind would run at the end (those tries lost 6% at 32 rows on the AMD EPYC); over
    512 they can. While a try could not pay, steps skip the plan (dense_ahead)."""
    times, plan = drafting_times(32, 1.1)
    outlook = Outlook(horizon=left, catch_up_ms=90.0)
    assert (times.check(plan, outlook).depth == 1) is tries
    assert times.dense_ahead(32, outlook) is not tries
    assert times.check(plan).depth == 1  # no outlook given (tests, callers that know none): the try is made


def test_one_row_has_no_tail_and_drafting_at_a_thin_lead_stops_where_the_rows_cannot_earn_the_tail_back():
    """A row alone leaves no tail: a try pays for catching up on its prompt within a few tokens. 8 rows drafting at
    a measured 1.05x lead (which the 8 rows' spread at the end costs back) keep drafting while they have 400
    tokens left, and stop with 40 (dense_ahead: steps skip the plan then)."""
    one, plan = drafting_times(1, 1.3)
    assert one.check(plan, Outlook(horizon=20, catch_up_ms=2.0)).depth == 1
    times, plan = drafting_times(8, 1.5, measured=1.05)
    assert times.check(plan, Outlook(horizon=400, catch_up_ms=0.0)).depth == 1
    assert not times.dense_ahead(8, Outlook(horizon=400, catch_up_ms=0.0))
    assert times.check(plan, Outlook(horizon=40, catch_up_ms=0.0)).depth == 0
    assert times.dense_ahead(8, Outlook(horizon=40, catch_up_ms=0.0))


def test_catching_up_is_estimated_from_the_pairs_queued_at_the_ms_a_pair_took():
    """Before any catching up was timed, a pair costs what a draft level costs a row at the largest batch measured;
    then what catching up took per pair, the fastest seen: a slower one (a shape's first run, a busy minute) does
    not raise the estimate, which would rule out the tries that could correct it."""
    planner = Planner(FLAT, rows=4, max_depth=4, has_draft=True)
    assert planner.outlook([10, 30], 100) == Outlook(horizon=20, catch_up_ms=100 * 0.5 / 32)
    planner.timed(best_step(FLAT, fresh_rows(4), 4, True), 0.03, 8, catch_up=0.2, catch_up_pairs=400)
    assert planner.outlook([10, 30], 100).catch_up_ms == pytest.approx(50.0)
    planner.timed(best_step(FLAT, fresh_rows(4), 4, True), 0.03, 8, catch_up=0.6, catch_up_pairs=400)
    assert planner.outlook([10, 30], 100).catch_up_ms == pytest.approx(50.0)
    assert Planner(FLAT, rows=4, max_depth=4, has_draft=False).outlook([5], 100).catch_up_ms == 0.0
    assert planner.outlook([], 0) is None


def test_while_dense_is_measured_ahead_steps_skip_the_plan_until_a_try_is_due():
    """Once dense steps make more than drafted ones, a step is dense with no plan (dense_ahead) until the try
    that check would grant: 50 such steps (the try lost 10 ms: the next is 51 steps on), then a planned (drafted)
    step."""
    planner = Planner(FLAT, rows=1, max_depth=4, has_draft=True)
    assert run_steps(planner, 5, lambda d: 60.0) == [0] * 4 + [4]  # dense measured, then a try that fell behind
    lean = 0
    while planner.dense_ahead([0]) is not None:
        lean += 1
    assert lean == 50 and planner.choose([0], [0], [4]).depth == 4
    assert planner.summary()["plan_steps"]["dense"] == TRIAL_STEPS + 50


def test_lookup_is_scored_during_dense_steps():
    planner = Planner(STEEP, rows=1, max_depth=4, has_draft=False)
    before = planner.lookup[0].alpha
    dense = best_step(LINEAR, fresh_rows(1, lookup=2), 4, False)
    for _ in range(5):
        planner.observe([0], dense, [0], [0])  # lookup's first token was wrong each time
    assert planner.lookup[0].alpha < before / 2 and planner.summary()["lookup_hit_rate"] == 0


def scan_matches(hist: list[int], max_ngram: int = 3):
    """Reference for NgramIndex: a scan of the whole history. The index after every earlier occurrence of
    hist's last n tokens (n = max_ngram..1, longest first; the latest occurrence first)."""
    for n in range(min(max_ngram, len(hist) - 1), 0, -1):
        for i in range(len(hist) - n - 1, -1, -1):
            if hist[i : i + n] == hist[-n:]:
                yield i + n


def test_the_ngram_index_answers_as_the_lookup_scan_does():
    from specee_core.draft.lookup import NgramIndex, lookup_tokens, lookup_veto

    gen = torch.Generator().manual_seed(0)
    index = NgramIndex()
    for row in range(3):
        hist = torch.randint(0, 6 + 4 * row, (200,), generator=gen).tolist()  # small vocabularies: many repeats
        size = 1
        while size < len(hist):  # grows by blocks of 1-5 tokens, as verify steps commit them
            h = hist[:size]
            start = next(scan_matches(h), None)
            assert index.continuation(row, h, 4) == ([] if start is None else h[start : start + 4]), (row, size)
            distinct = list(dict.fromkeys(h[i] for i in scan_matches(h)))[:4]
            assert index.candidates(row, h, 4) == distinct, (row, size)
            size += 1 + size % 5
    index.reset(0)
    assert index.continuation(0, [7, 8, 7], 2) == [8, 7] and index.continuation(0, [9], 2) == []
    index.reset(0)
    assert index.frequent(0, [9, 5, 5, 9, 5], 2) == [5, 9] and index.frequent(0, [9, 5, 5, 9, 5, 9], 1) == [9]
    # followers: per n, what followed the latest earlier occurrence of the last n tokens (scan per n)
    hist = torch.randint(0, 5, (120,), generator=gen).tolist()
    followers = NgramIndex()
    for size in range(1, len(hist)):
        expect = [-1] * 3
        for n in (1, 2, 3):
            tail = hist[size - n : size]
            starts = [i for i in range(size - n - 1, -1, -1) if size - 1 >= n and hist[i : i + n] == tail]
            expect[n - 1] = hist[starts[0] + n] if starts else -1
        assert followers.followers(0, hist[:size]) == expect, size
    assert lookup_tokens(torch.tensor([[5, 6, -1], [5, -1, -1], [-1, -1, -1]]), 2).tolist() == [6, -1, -1]
    assert lookup_tokens(torch.tensor([[5, 6, 7]]), 1).tolist() == [7]
    assert lookup_veto(torch.tensor([6, 3, 4]), torch.tensor([6, -1, 5])).tolist() == [False, False, True]


def test_expected_tokens_and_the_table_helpers():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(0.0, 4) == 1.0
    assert monotone([3.0, 1.0, 2.0, 5.0]) == pytest.approx([2.0, 2.0, 2.0, 5.0])
    t = CostTable(key={}, verify={1: [10.0, 12.0, 14.0], 4: [20.0, 30.0, 40.0]}, tokens=(1, 2, 3))
    assert t.verify_ms(1, 2) == 12.0 and t.verify_ms(2, 1) == pytest.approx(10 + 10 / 3)
    assert t.verify_ms(8, 1) == 40.0 and t.verify_ms(1, 5) == pytest.approx(18.0)  # extrapolated
    assert CostTable.from_json(json.loads(json.dumps(t.to_json()))).verify == t.verify


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_is_bf16_only_where_the_cpu_computes_it(monkeypatch, tmp_path, native):
    monkeypatch.setattr("specee_core.machine.cpu_has_native_bf16", lambda: native)
    dtype, why = choose_dtype("cpu")
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert why.startswith(str(dtype).removeprefix("torch.")) and (("no native" in why) != native)
    make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2)
    engine = SpecEEEngine.from_pretrained(tmp_path)  # dtype="auto" is the default
    assert engine.model.dtype == dtype and engine.dtype_reason == why


def test_a_bad_dtype_or_mode_names_the_choices(tmp_path):
    make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="expected one of auto, float32, bfloat16, float16"):
        SpecEEEngine.from_pretrained(tmp_path, dtype="fp8")
    engine = SpecEEEngine.from_pretrained(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match="mode must be one of auto, dense, specee, spec, got 'fast'"):
        engine.generate(["x"], max_new_tokens=2, mode="fast")
    with pytest.raises(ValueError, match="lossless"):
        engine.generate(["x"], max_new_tokens=2, spec={"width": 2})


def test_costs_are_measured_once_and_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    engine = SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")
    plan = engine.prepare_plan([3])
    assert sorted(plan.costs.verify) == [1, 4] and sorted(plan.costs.draft) == [1, 4]  # powers of 4, and 3's bucket
    assert all(len(v) == T_GRID.index(5) + 1 and v == sorted(v) and v[0] > 0 for v in plan.costs.verify.values())
    files = list((tmp_path / "cache" / "plans").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["dtype"] == "float32"

    def no_measuring(*a, **kw):
        raise AssertionError("measured again although the cache holds the table")

    monkeypatch.setattr("specee_core.spec.plan.measure_costs", no_measuring)  # (what SpecPlan.ensure calls)
    again = SpecEEEngine.from_pretrained(BUNDLED, dtype="float32").prepare_plan([4])
    assert again.costs.to_json() == plan.costs.to_json()
    described = again.to_json([1, 4])
    assert described["dtype"] == "float32" and set(described["by_batch"]) == {"1", "4"}


def test_a_cost_table_is_the_kernels_where_the_kernel_runs_the_layers(monkeypatch):
    """Where the CPU kernel runs the decode layers (low-bit weights; dense fp32 and bf16 matrices it fuses) the
    table's key holds the kernel's source hash, so a changed kernel is measured anew; without the kernel, none."""
    from kernels.cpu_ext import source_digest
    from specee_core.model import model as model_module, weight_plan
    from specee_core.model.config import ModelConfig
    from specee_core.spec.costs import cost_key

    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    for fmt in ("q4", None):
        m = weight_plan.random_model(config, fmt, torch.float32, torch.Generator().manual_seed(0))
        assert m.fused_layers and cost_key(m, torch.float32, m.device)["kernel"] == source_digest()
    monkeypatch.setattr(model_module, "cpu_kernel", lambda: None)
    m = weight_plan.random_model(config, None, torch.float32, torch.Generator().manual_seed(0))
    assert not m.fused_layers and "kernel" not in cost_key(m, torch.float32, m.device)


@pytest.fixture(scope="module")
def tiny():
    return SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")


def dense_measured_ahead() -> StepPolicy:
    """Step times by which dense steps make far more than drafted ones at every batch size, and no try of
    drafting is due for 256 steps: every step is a plain dense step of the speculative stepper."""
    times = StepPolicy()
    for b in SIZES:
        times.rate["spec", b], times.rate["dense", b] = 1e-6, 1.0
        times.try_every[b] = 256
    return times


@pytest.mark.parametrize("costs, times, drafts", [(FLAT, None, True), (LINEAR, None, False),
                                                  (FLAT, dense_measured_ahead, "lean"), (None, None, None)],
                         ids=["flat-table", "linear-table", "dense-measured-ahead", "measured-here"])
def test_auto_is_the_default_and_equals_dense_in_fp32(tiny, costs, times, drafts):
    """Whatever the plan chooses (forced to draft by a flat table, forced dense by a linear one, dense because
    dense steps were measured ahead, or this machine's own measurement), the default mode gives dense's tokens,
    batched and one by one."""
    plan = tiny.spec_plan()
    measured, kept = plan.costs, plan.times
    if costs is not None:  # real steps would not take the synthetic table's times: no learning from them
        plan.costs, plan.times = costs, (times or (lambda: StepPolicy(decay=1.0)))()
    try:
        dense = tiny.generate(CODE, max_new_tokens=32, ignore_eos=True, mode="dense")
        auto = tiny.generate(CODE, max_new_tokens=32, ignore_eos=True)
        single = [tiny.generate([p], max_new_tokens=32, ignore_eos=True)[0] for p in CODE[:2]]
    finally:
        plan.costs, plan.times = measured, kept
    assert [r.token_ids for r in auto] == [r.token_ids for r in dense]
    assert [r.token_ids for r in single] == [r.token_ids for r in dense[:2]]
    assert all(r.stats["mode"] == "auto" for r in auto)
    if drafts is True:
        steps = auto[0].stats["plan_steps"]
        assert steps.get("depth_4", 0) > steps.get("dense", 0) and auto[0].stats["mean_tokens_per_step"] > 1.5
    elif drafts == "lean":  # the speculative stepper's plain dense steps (no lookups, no plan)
        steps = auto[0].stats
        assert set(steps["plan_steps"]) == {"dense"} and steps["spec_steps"] == 31  # the first token: the prefill's
    elif drafts is False:  # not even one row could gain: a plain dense stepper, no draft head prefill
        assert "plan_steps" not in auto[0].stats and "spec_steps" not in auto[0].stats


def test_auto_keeps_the_distribution_when_sampling(tiny):
    """Sampled auto steps draft from the draft head with each row's own random numbers and keep a drafted token
    where it is the row's draw (exact: the chi-square tests in test_spec_decode cover the rule): a row seeded as a
    dense row gives dense's tokens, and rows of other seeds are as far from dense sampling's as two dense runs
    with different seeds are from each other (a greedy or biased acceptance would sit near total variation 1)."""
    plan = tiny.spec_plan()
    measured, times = plan.costs, plan.times
    plan.costs, plan.times = FLAT, StepPolicy(decay=1.0)

    def seeded(first: int) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=first + i) for i in range(250)]

    try:
        dense = tiny.generate([CODE[0]] * 250, mode="dense", sampling_params=seeded(0))
        again = tiny.generate([CODE[0]] * 250, mode="dense", sampling_params=seeded(1000))
        auto = tiny.generate([CODE[0]] * 250, sampling_params=seeded(2000))
        same = tiny.generate([CODE[0]] * 40, sampling_params=seeded(0)[:40])
    finally:
        plan.costs, plan.times = measured, times
    assert any(k.startswith("depth") for k in auto[0].stats["plan_steps"])
    assert sum(r.stats["mean_accepted"] for r in auto) > 20  # drafts were accepted: the sampled path ran
    assert [r.token_ids for r in same] == [r.token_ids for r in dense[:40]]

    def tv(x, y, pos: int) -> float:
        a, b = (torch.bincount(torch.tensor([r.token_ids[pos] for r in z]), minlength=tiny.config.vocab_size).float()
                for z in (x, y))
        return float(0.5 * (a / a.sum() - b / b.sum()).abs().sum())

    for pos in (1, 2, 3):  # positions decided by verify steps
        assert tv(auto, dense, pos) < tv(again, dense, pos) + 0.1, pos
