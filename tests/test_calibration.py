"""SpecEE's quality contract: calibrated exit thresholds, their bounds, the engine's tolerance option,
the live audit (in the stepper and in the schedule store)."""
from __future__ import annotations

import math
import random
import shutil

import pytest
import torch

from pipeline.schedule_store import ScheduleStore
from specee_core import SpecEEEngine
from specee_core.early_exit.calibration import CALIBRATION_FILE, Calibration, lower_bound, p_value, upper_bound
from specee_core.early_exit.scheduler import Schedule, retune
from tests.conftest import BUNDLED

PROMPTS = ["def add(a, b):\n", "import os\n\ndef main():\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n"]


def brute_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def test_bounds_are_exact_binomial_bounds():
    for k, n, delta in [(0, 100, 0.05), (3, 200, 0.01), (50, 100, 0.05), (9, 10, 0.1), (58, 3452, 0.05 / 29)]:
        ub, lb = upper_bound(k, n, delta), lower_bound(k, n, delta)
        assert lb <= k / n <= ub
        assert brute_cdf(k, n, ub) == pytest.approx(delta, rel=1e-6)  # Clopper-Pearson
        if k:
            assert 1 - brute_cdf(k - 1, n, lb) == pytest.approx(delta, rel=1e-6)
        assert p_value(k, n, 0.03) == pytest.approx(brute_cdf(k, n, 0.03), rel=1e-9, abs=1e-300)
    assert upper_bound(0, 0, 0.05) == 1.0 and lower_bound(0, 0, 0.05) == 0.0 and lower_bound(0, 9, 0.05) == 0.0
    # p-value and bound agree: the rate eps is rejected exactly when the bound is below it
    for k, n in [(0, 150), (1, 300), (5, 100)]:
        ub = upper_bound(k, n, 0.05)
        assert (p_value(k, n, ub + 1e-6) <= 0.05) and (p_value(k, n, ub - 1e-3) > 0.05)


def test_upper_bound_covers_the_true_rate():
    """Coverage by simulation: at a true rate of 2%, the 95% upper bound from 400 trials is above it
    in at least 95% of 2000 runs."""
    rng = random.Random(0)
    covered = sum(upper_bound(sum(rng.random() < 0.02 for _ in range(400)), 400, 0.05) >= 0.02 for _ in range(2000))
    assert covered / 2000 >= 0.95


def samples(grid: list[float], exits: list[int], disagree: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's tokens such that exits[j] of them score above grid[j] (descending) and disagree[j] of
    those disagree (both counts non-decreasing): (p_exit [S], agree [S])."""
    p, agree, prev_n, prev_k = [], [], 0, 0
    bounds = [1.0] + list(grid)
    for j, (n, k) in enumerate(zip(exits, disagree)):
        mid = (bounds[j] + bounds[j + 1]) / 2
        p += [mid] * (n - prev_n)
        agree += [False] * (k - prev_k) + [True] * (n - prev_n - (k - prev_k))
        prev_n, prev_k = n, k
    p += [0.0] * 100  # tokens that never exit
    agree += [True] * 100
    return torch.tensor(p), torch.tensor(agree)


def certify_all(layers, prompts: int = 1000, strict: bool = False) -> Calibration:
    """Made-up calibration data on which every layer passes: each layer has its own 20000 confident,
    agreeing tokens (no shallower layer takes them), so it exits at the lowest candidate threshold; with
    strict, also 20000 tokens at 0.9997 that disagree, which stop its sequence at 0.9999."""
    block = 40000 if strict else 20000
    n = block * len(layers)
    p, agree = {}, {}
    for i, l in enumerate(layers):
        p[l], agree[l] = torch.zeros(n), torch.ones(n, dtype=torch.bool)
        p[l][i * block : i * block + 20000] = 1.0
        if strict:
            p[l][i * block + 20000 : (i + 1) * block] = 0.9997
            agree[l][i * block + 20000 : (i + 1) * block] = False
    return Calibration.count(p, agree, prompts=prompts)


def synthetic_calibration() -> Calibration:
    """Layer 1: exits always agree, only on the first fifth of the tokens; layer 2: half of its exits
    disagree; layer 3: agrees only at high thresholds (the lower ones let bad exits through)."""
    n = 100000
    p = torch.linspace(0, 1, n)
    first = (torch.arange(n) < n // 5).float()  # sure, on the first fifth only
    good = torch.ones(n, dtype=torch.bool)
    coin = torch.arange(n) % 2 == 0
    high_only = p > 0.95
    return Calibration.count({1: first, 2: p, 3: p}, {1: good, 2: coin, 3: high_only}, prompts=10)


def test_thresholds_per_layer():
    cal = synthetic_calibration()
    th = cal.thresholds(0.02)
    assert th[1].threshold == 0.5 and th[1].disagree == 0  # the lowest candidate
    assert th[2].threshold is None  # never exits
    assert th[3].threshold is not None and th[3].threshold >= 0.95  # only where its exits agree
    assert th[3].bound <= 0.02
    # layer 3 is calibrated on the tokens layer 1 did not take
    assert th[3].exits == int(((torch.linspace(0, 1, 100000) > th[3].threshold)
                               & (torch.arange(100000) >= 20000)).sum())
    # a looser tolerance never gives a higher threshold; a tighter one never a lower
    assert cal.thresholds(0.05)[3].threshold <= th[3].threshold


def test_thresholds_with_too_few_exits_are_left_out_of_the_sequence():
    """A threshold whose exits are too few to pass at half the tolerance is skipped, not a failure
    that ends the sequence (the rule reads exit counts only)."""
    grid = (0.999, 0.99, 0.9)
    p, agree = samples(list(grid), [50, 3000, 6000], [5, 10, 30])
    cal = Calibration.count({1: p}, {1: agree}, prompts=5)
    assert cal.thresholds(0.02, grid=grid)[1].threshold == 0.9


def test_fixed_sequence_stops_at_the_first_failure():
    """Thresholds are tested from the most conservative down; one failing threshold ends the layer's
    sequence even when a lower one would pass on its own."""
    grid = (0.99, 0.9, 0.5)
    p, agree = samples(list(grid), [2000, 2100, 10000], [0, 60, 70])  # 0.5 alone: 0.7%, but 0.9 fails first
    cal = Calibration.count({1: p}, {1: agree}, prompts=5)
    assert cal.thresholds(0.02, grid=grid)[1].threshold == 0.99


def test_bonferroni_over_layers():
    """The same counts pass with one layer and fail among many: each layer's test runs at delta / layers."""
    p, agree = samples([0.9], [600], [0])  # enough exits to test at delta = 0.05, not at 0.05 / 200
    one = Calibration.count({1: p}, {1: agree}, prompts=5)
    many = Calibration.count({l: p for l in range(1, 201)}, {l: agree for l in range(1, 201)}, prompts=5)
    assert one.thresholds(0.02, grid=(0.9,))[1].threshold == 0.9
    assert many.thresholds(0.02, grid=(0.9,))[1].threshold is None


def test_calibration_file_roundtrip_and_errors(tmp_path):
    cal = synthetic_calibration()
    cal.save(tmp_path / "c.safetensors")
    back = Calibration.load(tmp_path / "c.safetensors")
    assert back.layers == cal.layers and back.tokens == cal.tokens and torch.equal(back.agree, cal.agree)
    assert back.thresholds(0.02) == cal.thresholds(0.02)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        Calibration.load(tmp_path / "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"{")
    with pytest.raises(ValueError, match="bad.safetensors"):
        Calibration.load(tmp_path / "bad.safetensors")


def test_vetoed_exits_are_left_out_of_the_calibration(tmp_path):
    """Tokens the lookup veto stops never exit: the thresholds are certified on the exits the engine can take
    (here the vetoed ones are the bad ones, so the layer passes at a lower threshold with the veto), and the
    file tells the engine which rule it was certified under."""
    grid = (0.99, 0.9, 0.5)
    p, agree = samples(list(grid), [2000, 2100, 10000], [0, 60, 70])  # without the veto: stops at 0.99
    veto = ~agree  # every disagreeing exit contradicts the lookup
    cal = Calibration.count({1: p}, {1: agree}, prompts=5, veto={1: veto}, lookup_veto=2)
    assert Calibration.count({1: p}, {1: agree}, prompts=5).thresholds(0.02, grid=grid)[1].threshold == 0.99
    th = cal.thresholds(0.02, grid=grid)[1]
    assert th.threshold == 0.5 and th.disagree == 0 and th.exits == int((~veto & (p > 0.5)).sum())
    cal.save(tmp_path / "c.safetensors")
    assert Calibration.load(tmp_path / "c.safetensors").lookup_veto == 2
    assert synthetic_calibration().lookup_veto is None
    with pytest.raises(ValueError, match="lookup_veto"):
        Calibration.count({1: p}, {1: agree}, prompts=5, veto={1: veto})


@pytest.fixture(scope="module")
def calibrated_dir(tmp_path_factory):
    """The bundled model with a calibration file that certifies every layer at threshold 0.5 on
    made-up counts (what a calibration could say; the audit then judges the predictors)."""
    path = tmp_path_factory.mktemp("calibrated")
    for f in BUNDLED.iterdir():
        (shutil.copytree if f.is_dir() else shutil.copy)(f, path / f.name)
    engine = SpecEEEngine.from_pretrained(path, dtype="float32")
    certify_all(sorted(engine.early_exit.predictors.layers)).save(path / CALIBRATION_FILE)
    return path


def test_tolerance_errors(ee_model_dir):
    with pytest.raises(ValueError, match=r"max_disagreement must be in \(0, 1\)"):
        SpecEEEngine.from_pretrained(BUNDLED, dtype="float32", max_disagreement=1.5)
    engine = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32")
    with pytest.raises(ValueError, match="max_disagreement must be in"):
        engine.generate(["a"], max_new_tokens=2, mode="specee", max_disagreement=0.0)
    with pytest.raises(ValueError, match="applies to mode='specee' only"):
        engine.generate(["a"], max_new_tokens=2, mode="dense", max_disagreement=0.02)
    # no calibration beside the predictors: the message says how to make one
    with pytest.raises(ValueError, match="python -m jobs.train_predictors --model .* --calib-prompts"):
        engine.generate(["a"], max_new_tokens=2, mode="specee", max_disagreement=0.02)


def test_calibrated_engine_uses_per_layer_thresholds(calibrated_dir):
    engine = SpecEEEngine.from_pretrained(calibrated_dir, dtype="float32")
    assert set(engine.early_exit.thresholds.values()) == {engine.early_exit.options.threshold}
    cal = engine.early_exit.with_options(max_disagreement=0.02)
    assert set(cal.thresholds) == set(engine.early_exit.predictors.layers)
    assert set(cal.thresholds.values()) == {0.5}
    res = engine.generate(PROMPTS, max_new_tokens=12, mode="specee", max_disagreement=0.02, ignore_eos=True)
    assert min(l for r in res for l in r.exit_layers) < engine.config.num_hidden_layers


def test_calibrated_engine_applies_the_calibrations_lookup_veto(calibrated_dir, tmp_path):
    """With a calibration certified under the lookup veto, no exit emits a token other than the one prompt
    lookup reads off the row's history (matches of >= 1 token here); without it some exit does (the test
    sees the veto act)."""
    from specee_core.draft.lookup import NgramIndex, lookup_tokens

    vetoed = tmp_path / "vetoed"
    shutil.copytree(calibrated_dir, vetoed)
    cal = Calibration.load(vetoed / CALIBRATION_FILE)
    Calibration.count({l: cal.p_exit[:, c] for c, l in enumerate(cal.layers)},
                      {l: cal.agree[:, c] for c, l in enumerate(cal.layers)}, prompts=cal.prompts,
                      veto={l: torch.zeros(cal.tokens, dtype=torch.bool) for l in cal.layers},
                      lookup_veto=1).save(vetoed / CALIBRATION_FILE)
    prompts = [p * 3 for p in PROMPTS]  # repeats: lookup finds matches

    def contradictions(model_dir) -> tuple[int, int]:
        engine = SpecEEEngine.from_pretrained(model_dir, dtype="float32")
        L = engine.config.num_hidden_layers
        exits = bad = 0
        for prompt, r in zip(prompts, engine.generate(prompts, max_new_tokens=24, mode="specee",
                                                       max_disagreement=0.02, ignore_eos=True)):
            hist, index = engine.encode_prompt(prompt), NgramIndex()
            for t, l in zip(r.token_ids, r.exit_layers):
                looked_up = int(lookup_tokens(torch.tensor([index.followers(0, hist)]), 1)[0])
                if l < L:
                    exits += 1
                    bad += looked_up >= 0 and t != looked_up
                hist = hist + [t]
        return exits, bad

    exits, bad = contradictions(calibrated_dir)
    assert exits > 0 and bad > 0
    exits, bad = contradictions(vetoed)
    assert exits > 0 and bad == 0


def teacher_forced_argmax(engine, prompt: str, tokens: list[int]) -> list[int]:
    """The full model's argmax before each generated token, given the tokens before it."""
    m = engine.model
    ids = torch.tensor([engine.encode_prompt(prompt) + tokens])
    logits = m.logits(m.forward(ids, torch.arange(ids.shape[1])[None], m.new_cache(1, ids.shape[1])))[0]
    n = len(tokens)
    return logits[-n - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("skip", ["batch", "row"])
def test_audit_counts_every_disagreement_and_changes_nothing(calibrated_dir, skip):
    """With every step audited, exited tokens still run to full depth: the output is the unaudited
    output token for token, and the audit's counts per exit layer equal the exits whose token differs
    from the full model's teacher-forced argmax on the same prefix."""
    engine = SpecEEEngine.from_pretrained(calibrated_dir, dtype="float32", threshold=0.5, skip=skip)
    L = engine.config.num_hidden_layers
    plain = engine.generate(PROMPTS, max_new_tokens=16, mode="specee", ignore_eos=True)
    audited = engine.with_options(audit_fraction=1.0).generate(PROMPTS, max_new_tokens=16, mode="specee",
                                                               ignore_eos=True)
    assert [r.token_ids for r in audited] == [r.token_ids for r in plain]
    assert plain[0].stats["audit_exits"] is None
    total_exits = total_disagree = 0
    for prompt, r in zip(PROMPTS, audited):
        full = teacher_forced_argmax(engine, prompt, r.token_ids)
        exits, disagree = [0] * L, [0] * L
        for t, f, l in zip(r.token_ids, full, r.exit_layers):
            if l < L:
                exits[l - 1] += 1
                disagree[l - 1] += t != f
        assert r.stats["audit_exits"] == exits
        assert r.stats["audit_disagree"] == disagree
        total_exits, total_disagree = total_exits + sum(exits), total_disagree + sum(disagree)
    assert total_exits > 10 and total_disagree > 0  # the test sees both kinds


def test_audit_fraction_spreads_steps(calibrated_dir):
    engine = SpecEEEngine.from_pretrained(calibrated_dir, dtype="float32", threshold=0.5, audit_fraction=0.25)
    r = engine.generate(PROMPTS[:1], max_new_tokens=33, mode="specee", ignore_eos=True)[0]
    exits = sum(l < engine.config.num_hidden_layers for l in r.exit_layers)
    assert 0 < sum(r.stats["audit_exits"]) < exits


def test_disabled_layers_never_exit(calibrated_dir):
    engine = SpecEEEngine.from_pretrained(calibrated_dir, dtype="float32", threshold=0.0)
    L = engine.config.num_hidden_layers
    s = engine.schedule
    engine.set_schedule(Schedule(num_layers=L, offline_layers=s.offline_layers, window=s.window, offsets=s.offsets,
                                 disabled_layers=list(range(1, L))))
    dense = engine.generate(PROMPTS, max_new_tokens=8, mode="dense")
    res = engine.generate(PROMPTS, max_new_tokens=8, mode="specee")
    assert [r.token_ids for r in res] == [r.token_ids for r in dense]
    assert all(l == L for r in res for l in r.exit_layers)


def test_store_closes_a_layer_the_audit_finds_bad():
    L = 8
    store = ScheduleStore({"num_layers": L, "offline_layers": [2, 3, 5]}, retune_every_tokens=10**9,
                          max_disagreement=0.02)
    exits, disagree = [0] * L, [0] * L
    exits[2], disagree[2] = 5, 0  # layer 3: fine
    exits[4], disagree[4] = 5, 1  # layer 5: 1 of 5 wrong, not yet significant
    store.report(0, rows=4, tokens=40, layer_tokens=200.0, histogram=None, audit=(exits, disagree))
    assert store.current.version == 0
    exits[4], disagree[4] = 20, 13  # 14 of 25 wrong: far above 2% at 95% confidence
    v = store.report(0, rows=4, tokens=40, layer_tokens=200.0, histogram=None, audit=(exits, disagree))
    assert v == 1 and store.current.disabled_layers == [5] and store.current.offline_layers == [2, 3]
    assert store.current.source == "audit"
    rep = store.state()["audit"]
    assert rep["closed"][5]["closed_in_version"] == 1 and rep["closed"][5]["lower_bound"] > 0.02
    assert rep["layers"][3]["upper_bound"] > 0 and rep["layers"][5]["disagreement"] == pytest.approx(14 / 25)
    per_version = store.state()["per_version"][0]
    assert per_version["audit_exits"] == 35 and per_version["audit_disagree"] == 14
    # later re-tunes never bring the closed layer back
    hist = [0] * L
    hist[4] = 100
    assert 5 not in retune(store.current, hist).offline_layers
    with pytest.raises(ValueError, match="audit counts of 3/3 layers"):
        store.report(1, 1, 1, 1.0, None, audit=([0] * 3, [0] * 3))


def test_store_without_tolerance_only_counts():
    store = ScheduleStore({"num_layers": 4, "offline_layers": [1, 2]})
    store.report(0, 1, 10, 20.0, None, audit=([10, 0, 0, 0], [10, 0, 0, 0]))
    assert store.current.version == 0 and store.state()["audit"]["disagreement"] == 1.0
    with pytest.raises(ValueError, match="max_disagreement must be in"):
        ScheduleStore({"num_layers": 4, "offline_layers": [1]}, max_disagreement=2.0)


def test_bundled_smollm2_calibration_file_is_valid():
    """The shipped calibration parses and names its split's size."""
    path = BUNDLED.parent / "smollm2-135m-instruct" / CALIBRATION_FILE
    cal = Calibration.load(path)
    assert cal.prompts >= 100 and cal.tokens >= 5000
    assert cal.meta["exclude_first"] >= 0 and cal.layers == list(range(1, 30))
    assert cal.lookup_veto == 2  # certified under the lookup veto: the engine applies it with these thresholds
