"""SpecEE mode mechanics on a tiny random model (quality is tested on the bundled model)."""
from __future__ import annotations

import pytest
import torch

from specee_core import SpecEEEngine
from specee_core.step.sampling import SamplingParams
from specee_core.early_exit.scheduler import Schedule, retune, select_offline_layers

PROMPTS = ["def f(x):\n    return x", "import os\n", "class A:\n    pass\n\nclass B(A):", "for i in range(10):"]


@pytest.mark.parametrize("speculator,skip", [("draft", "row"), ("draft", "batch"), ("lookup", "row"),
                                             ("lookup", "batch")])
def test_exits_off_equals_dense(ee_model_dir, speculator, skip):
    engine = SpecEEEngine.from_pretrained(ee_model_dir, speculator=speculator, threshold=2.0, skip=skip, dtype="float32")
    dense = engine.generate(PROMPTS, max_new_tokens=12, mode="dense")
    batched = engine.generate(PROMPTS, max_new_tokens=12, mode="specee")
    single = [engine.generate([p], max_new_tokens=12, mode="specee")[0] for p in PROMPTS]
    for d, b, s in zip(dense, batched, single):
        assert b.token_ids == d.token_ids == s.token_ids
        assert b.exit_layers == [engine.config.num_hidden_layers] * len(b.token_ids)
        assert b.stats["predictor_calls"] > 0


def specee_keeping_cache(engine, prompts, **params):
    """generate(mode="specee") through the engine core, also returning the KV cache its rows ran in."""
    caches = []

    def factory(*args):  # (engine, batch, cache, prefill_hidden, lens)
        caches.append(args[2])
        return engine.early_exit.new_stepper(*args)

    res = engine.run([engine.encode_prompt(p) for p in prompts], SamplingParams(**params), factory, mode="specee")
    [cache] = caches
    return res, cache


@pytest.mark.parametrize("skip", ["row", "batch"])
@pytest.mark.parametrize("verify", ["local", "full"])
def test_always_exit_runs_fewer_layers(ee_model_dir, verify, skip):
    engine = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.0, verify=verify, skip=skip, dtype="float32")
    res, cache = specee_keeping_cache(engine, PROMPTS, max_new_tokens=10, ignore_eos=True)
    L = engine.config.num_hidden_layers
    assert all(r.exit_layers[0] == L for r in res)  # prefill's token: full depth, always
    layers = [l for r in res for l in r.exit_layers[1:]]
    assert len(layers) == 36
    if verify == "local":  # the first active layer always accepts
        assert max(layers) < L
    for r in res:
        assert sum(r.stats["exit_histogram"]) == len(r.token_ids)
        assert r.stats["avg_layers"] == pytest.approx(sum(r.exit_layers) / len(r.exit_layers))
    full = cache.lengths[0, :4]
    assert (cache.lengths[-1, :4] < full).all()  # the last exit's skipped layers wait for a next token


def test_bf16_specee_paths(ee_model_dir):
    """The CPU bf16 path (oneDNN-packed weights, fp32 K/V): exits off equals dense token for token, and
    always-exit steps run with their KV writes (the skipped layers' chunks) into the fp32 cache."""
    engine = SpecEEEngine.from_pretrained(ee_model_dir, dtype="bfloat16", threshold=2.0)
    assert engine.model.kv_dtype == torch.float32
    dense = engine.generate(PROMPTS, max_new_tokens=10, mode="dense")
    off = engine.generate(PROMPTS, max_new_tokens=10, mode="specee")
    assert [r.token_ids for r in off] == [r.token_ids for r in dense]
    res = engine.with_options(threshold=0.0).generate(PROMPTS, max_new_tokens=10, mode="specee", ignore_eos=True)
    assert max(l for r in res for l in r.exit_layers[1:]) < engine.config.num_hidden_layers


def test_batch_skip_keeps_exited_rows_flowing(ee_model_dir):
    """skip='batch': a row that exited keeps running layers (exact KV) until every row has exited;
    skip='row' compacts. Same tokens and exit layers for a row that exits alone."""
    row = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.55, skip="row", dtype="float32")
    bat = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.55, skip="batch", dtype="float32")
    a = row.generate(PROMPTS[:1], max_new_tokens=10, mode="specee", ignore_eos=True)[0]
    b = bat.generate(PROMPTS[:1], max_new_tokens=10, mode="specee", ignore_eos=True)[0]
    assert a.token_ids == b.token_ids and a.exit_layers == b.exit_layers  # batch of one: identical
    res, cache = specee_keeping_cache(bat, PROMPTS, max_new_tokens=10, ignore_eos=True)
    # a layer's KV is missing for a position only when every alive row skipped it
    behind = cache.lengths[:, :4] < cache.lengths[0, :4]
    assert (behind.all(1) | ~behind.any(1)).all(), cache.lengths[:, :4]
    assert all(len(r.token_ids) == 10 for r in res)


def test_sampling_with_exits_is_seeded(ee_model_dir):
    engine = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.3, dtype="float32")
    a = engine.generate(PROMPTS, max_new_tokens=8, mode="specee", temperature=0.9, seed=3)
    b = engine.generate(PROMPTS, max_new_tokens=8, mode="specee", temperature=0.9, seed=3)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_explore_steps_fill_the_retune_histogram(ee_model_dir):
    engine = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.0, explore_every=2, dtype="float32")
    r = engine.generate(PROMPTS[:1], max_new_tokens=10, mode="specee", ignore_eos=True)[0]
    assert sum(r.stats["explore_histogram"]) == 5 == sum(r.stats["retune_histogram"])
    assert r.stats["explore_histogram"][0] == 5  # every predictor runs: the first layer accepts


def test_schedule_update_rule():
    assert select_offline_layers([5, 0, 9, 1, 7, 100], 3) == [1, 3, 5]
    s = Schedule(num_layers=6, offline_layers=[1, 2, 3])
    s2 = retune(s, [0, 0, 4, 9, 7, 50])
    assert s2.offline_layers == [3, 4, 5] and s2.version == 1
    assert retune(s, [0, 0, 0, 0, 0, 50]) is s  # nothing exited: keep
    with pytest.raises(ValueError, match="out of range"):
        Schedule(num_layers=6, offline_layers=[6])


def test_bad_options_are_rejected(ee_model_dir):
    with pytest.raises(ValueError, match="skip must be one of"):
        SpecEEEngine.from_pretrained(ee_model_dir, skip="copy", dtype="float32")
    with pytest.raises(TypeError, match="unknown engine options"):
        SpecEEEngine.from_pretrained(ee_model_dir, thresold=0.5, dtype="float32")


def test_candidate_scorer_equals_kernel_reference(ee_model_dir):
    from kernels import fused_predictor_reference
    from specee_core.early_exit.walk import CandidateScorer

    engine = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32")
    m, pred = engine.model, engine.early_exit.predictors.layers[1]
    g = torch.Generator().manual_seed(0)
    cand = torch.randint(0, 8192, (5, 4), generator=g)
    h = torch.randn(5, 64, generator=g)
    prev = torch.rand(5, 4, generator=g).softmax(-1)
    sel = torch.tensor([0, 2, 3, 4, 1])
    ours = CandidateScorer(m, cand, "torch")(h[sel], sel, prev[sel], pred)
    ref = fused_predictor_reference(m.final_norm(h[sel]), cand[sel], m.w.lm_head, prev[sel], pred.w1, pred.b1, pred.w2, pred.b2)
    for a, b in zip(ours[:2], ref[:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert torch.equal(ours[2], ref[2])


def test_draft_vocab_subset_limits_candidates(tmp_path, ee_model_dir, monkeypatch):
    import shutil

    from specee_core.draft.head import DraftHead
    from specee_core.draft.proposer import Proposer

    shutil.copytree(ee_model_dir, tmp_path, dirs_exist_ok=True)
    head = DraftHead.load(tmp_path / "draft", SpecEEEngine.from_pretrained(tmp_path, dtype="float32").config)
    subset = torch.arange(100, 400)
    head.save(tmp_path / "draft", vocab_subset=subset)
    engine = SpecEEEngine.from_pretrained(tmp_path, speculator="draft", threshold=0.0, dtype="float32")
    seen = []
    assert engine.early_exit.source == "draft"
    original = Proposer.candidates  # each lane has its own proposer: record at the class
    monkeypatch.setattr(Proposer, "candidates",
                        lambda self, *a: seen.append(original(self, *a)[0]) or (seen[-1], None))
    engine.generate(PROMPTS[:2], max_new_tokens=6, mode="specee")
    cands = torch.cat(seen)
    assert ((cands >= 100) & (cands < 400)).all() and cands.shape[1] == 4


TRITON_ENGINE_CASE = """
import json, sys
from specee_core import SpecEEEngine
prompts = json.loads(sys.argv[2])
out = {}
for backend in ("triton", "torch"):
    for skip in ("row", "batch"):
        e = SpecEEEngine.from_pretrained(sys.argv[1], device=sys.argv[3], predictor_backend=backend, threshold=0.0,
                                         skip=skip, dtype="float32")
        res = e.generate(prompts, max_new_tokens=6, mode="specee", ignore_eos=True)
        out[backend + "-" + skip] = [[r.token_ids, r.exit_layers] for r in res]
print(json.dumps(out))
"""


def test_triton_backend_decides_like_the_torch_path(ee_model_dir):
    """predictor_backend="triton" (the fused kernel inside the decode step; without CUDA in Triton's
    interpreter, in a fresh process since triton fixes its mode at import) exits where the torch path does."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = dict(os.environ)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    args = [str(ee_model_dir), json.dumps(PROMPTS[:3]), device]
    proc = subprocess.run([sys.executable, "-c", TRITON_ENGINE_CASE, *args], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    L = json.loads((ee_model_dir / "config.json").read_text())["num_hidden_layers"]
    for skip in ("row", "batch"):
        assert out[f"triton-{skip}"] == out[f"torch-{skip}"]
        assert max(l for _, layers in out[f"triton-{skip}"] for l in layers[1:]) < L  # exits happened


def _draft_confidence_bank(k: int, layers: list[int], tau: float, exit_token: str = "local"):
    """Predictors of feature set "zpdq" that read only the draft's top probability q0: p_exit > 0.5
    exactly when q0 > tau (one hidden unit, w1 on the fourth feature block)."""
    from specee_core.early_exit.predictors import HIDDEN, LayerPredictor, PredictorBank

    w1 = torch.zeros(HIDDEN, 4 * k)
    w1[0, 3 * k] = 1.0
    w2 = torch.zeros(1, HIDDEN)
    w2[0, 0] = 100.0
    b2 = torch.tensor([-100.0 * tau])
    return PredictorBank(k, {l: LayerPredictor(w1.clone(), torch.zeros(HIDDEN), w2.clone(), b2.clone()) for l in layers},
                         features="zpdq", exit_token=exit_token)


def test_draft_confidence_predictors_read_the_drafts_probabilities(tmp_path, ee_model_dir, monkeypatch):
    """A "zpdq" bank gets the draft's probabilities of the very candidates it scores, row by row: with
    predictors that fire iff the draft's top probability passes 0.5, and a draft made sure on every third
    step (row 0 from step 0, row 1 from step 1), each row exits at the first predictor layer exactly on
    its sure steps and runs every layer on the others. A draft sure on every step (row 2): the step after
    an exit fed the draft an exit layer's feature, so that row exits every other step."""
    import shutil

    from specee_core.draft.proposer import Proposer

    shutil.copytree(ee_model_dir, tmp_path, dirs_exist_ok=True)
    _draft_confidence_bank(4, [1, 2, 3], 0.5).save(tmp_path / "predictors.safetensors")
    L, calls = 4, []
    original = Proposer.candidates

    def alternating(self, rows, *a):
        ids, q = original(self, rows, *a)
        step = len(calls)
        calls.append(list(rows))
        sure = torch.tensor([b == 2 or (step - b) % 3 == 0 for b in rows])
        return ids, torch.where(sure[:, None], torch.tensor([0.9, 0.05, 0.03, 0.02]), torch.tensor([0.3, 0.3, 0.2, 0.2]))

    monkeypatch.setattr(Proposer, "candidates", alternating)
    engine = SpecEEEngine.from_pretrained(tmp_path, speculator="draft", threshold=0.5, explore_every=1,
                                          dtype="float32")
    assert engine.early_exit.predictors.reads_draft_prob
    res = engine.generate(PROMPTS[:3], max_new_tokens=9, mode="specee", ignore_eos=True)
    assert all(c == [0, 1, 2] for c in calls) and len(calls) == 8
    for b, r in enumerate(res[:2]):
        assert r.exit_layers[1:] == [1 if (step - b) % 3 == 0 else L for step in range(8)]
    assert res[2].exit_layers[1:] == [1, L] * 4
    # prompt lookup has no probabilities to give these predictors: a clear error, not zeros
    with pytest.raises(ValueError, match="read the draft head's confidence"):
        SpecEEEngine.from_pretrained(tmp_path, speculator="lookup", dtype="float32")


def test_old_predictor_files_load_as_the_papers_features(ee_model_dir):
    from specee_core.early_exit.predictors import PredictorBank

    bank = PredictorBank.load(ee_model_dir / "predictors.safetensors")
    assert bank.features == "zpd" and bank.width == 12 and not bank.reads_draft_prob
    assert bank.exit_token == "local"


@pytest.mark.parametrize("exit_token", ["draft", "local"])
def test_an_exit_emits_the_token_its_predictors_learnt_to_trust(tmp_path, ee_model_dir, monkeypatch, exit_token):
    """Predictors saved with exit_token "draft" make every exit emit the draft head's top candidate of
    that step; "local" ones the layer's argmax among the candidates. The draft's ranking is reversed here
    (its "top" candidate is its fourth), so the layer's argmax differs from it on some exits and the
    first case can fail."""
    import shutil

    from specee_core.draft.proposer import Proposer

    shutil.copytree(ee_model_dir, tmp_path, dirs_exist_ok=True)
    _draft_confidence_bank(4, [1, 2, 3], 0.5, exit_token).save(tmp_path / "predictors.safetensors")
    calls = []
    original = Proposer.candidates

    def sure(self, rows, *a):
        ids = original(self, rows, *a)[0].flip(-1)
        calls.append(ids.cpu())
        return ids, torch.tensor([[0.9, 0.05, 0.03, 0.02]]).expand(len(rows), -1)

    monkeypatch.setattr(Proposer, "candidates", sure)
    engine = SpecEEEngine.from_pretrained(tmp_path, speculator="draft", threshold=0.5, gate="off", dtype="float32")
    assert engine.early_exit.predictors.exit_token == exit_token
    res = engine.generate(PROMPTS[:3], max_new_tokens=9, mode="specee", ignore_eos=True)
    exited = [(int(r.token_ids[s + 1]), int(calls[s][b, 0])) for b, r in enumerate(res)
              for s in range(len(calls)) if r.exit_layers[s + 1] < 4]
    assert len(exited) >= 6  # every other step of each row exits (no chained exits)
    same = [tok == top for tok, top in exited]
    assert all(same) if exit_token == "draft" else not all(same), exited


def test_draft_record_follows_the_proposals_and_the_tokens_fed():
    from specee_core.early_exit.predictors import DraftRecord

    rec = DraftRecord(2)
    assert rec.features([0, 1], 4).tolist() == [[0, 0, 0, 0]] * 2  # first step: no record
    for toks, cand in (([9, 9], [[5], [7]]), ([5, 3], [[6], [3]]), ([6, 3], [[1], [2]]), ([2, 4], [[8], [8]])):
        rec.observe([0, 1], toks)
        rec.proposed([0, 1], torch.tensor(cand))
    # row 0: 5->5 hit, 6->6 hit, 1->2 miss; row 1: 7->3 miss, 3->3 hit, 2->4 miss
    torch.testing.assert_close(rec.features([0, 1], 4), torch.tensor([[0, 1, 2 / 3, 0], [0, 1, 1 / 3, 0]]))
    rec.clear([1])
    torch.testing.assert_close(rec.features([1, 0], 3), torch.tensor([[0, 0, 0], [0, 1, 2 / 3]]))
    with pytest.raises(ValueError, match="k >= 3"):
        rec.features([0], 2)


def test_collected_record_is_the_drafts_hits_on_the_rows_tokens(ee_model_dir):
    """The record the collection stores per step is, for each row, whether the draft's top candidate at
    each earlier step was the token the full model then chose (last, the one before, the rate over four)."""
    from specee_core.early_exit.collect import collect_exit_data

    engine = SpecEEEngine.from_pretrained(ee_model_dir, speculator="draft", dtype="float32")
    data = collect_exit_data(engine, PROMPTS[:3], engine.early_exit.source, engine.early_exit.predictors.k,
                             max_new_tokens=9)
    assert len(data.record) == len(data.cand) == 8
    for s, rec in enumerate(data.record):
        for r in range(rec.shape[0]):
            hits = [bool(data.cand[j][r, 0] == data.final[j][r]) for j in range(s)][-4:]
            want = [hits[-1] if hits else 0, hits[-2] if len(hits) > 1 else 0, sum(hits) / len(hits) if hits else 0, 0]
            assert rec[r].tolist() == pytest.approx([float(w) for w in want]), (s, r)
    assert any(float(r[:, 0].sum()) > 0 for r in data.record)  # some hits happened


def _record_bank(k: int, layers: list[int]):
    """Predictors of feature set "zpdqh" that fire exactly when the row's last proposal was a hit (the
    record's first entry, one hidden unit on the fifth feature block): tools.gpu_check's."""
    from tools.gpu_check import hit_bank

    return hit_bank(k, layers)


def test_record_predictors_exit_right_after_the_drafts_hits(tmp_path, ee_model_dir, monkeypatch):
    """A "zpdqh" bank gets each row's record: predictors that fire iff the row's previous proposal was a
    hit make a row exit at the first predictor layer exactly on the steps after a hit (not right after an
    exit: no chained exits), with the draft's top candidate as its token."""
    import shutil

    from specee_core.draft.proposer import Proposer

    shutil.copytree(ee_model_dir, tmp_path, dirs_exist_ok=True)
    _record_bank(4, [1, 2, 3]).save(tmp_path / "predictors.safetensors")
    calls = []
    original = Proposer.candidates

    def recorded(self, rows, *a):
        ids, q = original(self, rows, *a)
        calls.append(ids.cpu())
        return ids, q

    monkeypatch.setattr(Proposer, "candidates", recorded)
    engine = SpecEEEngine.from_pretrained(tmp_path, speculator="draft", threshold=0.5, gate="off", dtype="float32")
    assert engine.early_exit.predictors.reads_record
    res = engine.generate(PROMPTS[:3], max_new_tokens=12, mode="specee", ignore_eos=True)
    exits = 0
    for b, r in enumerate(res):
        for s in range(len(calls)):
            hit_before = s > 0 and int(calls[s - 1][b, 0]) == r.token_ids[s]
            chained = s > 0 and r.exit_layers[s] < 4
            exited = r.exit_layers[s + 1] < 4
            assert exited == (hit_before and not chained), (b, s, r.exit_layers)
            if exited:
                exits += 1
                assert r.token_ids[s + 1] == int(calls[s][b, 0])
    assert exits >= 3 and exits < sum(len(r.token_ids) - 1 for r in res)


def test_exit_choice_and_the_banks_exit_token_round_trip(tmp_path):
    from specee_core.early_exit.predictors import exit_choice

    cand = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    z = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 1.0, 2.0]])
    assert exit_choice(z, cand, "local").tolist() == [6, 9] and exit_choice(z, cand, "draft").tolist() == [5, 9]
    zl = torch.stack([z, z.flip(-1)], 1)  # [N, L-1 = 2, K]
    assert exit_choice(zl, cand, "local").tolist() == [[6, 7], [9, 12]]
    assert exit_choice(zl, cand, "draft").tolist() == [[5, 5], [9, 9]]
    with pytest.raises(ValueError, match="exit_token must be one of"):
        exit_choice(z, cand, "final")
    _draft_confidence_bank(4, [1, 2], 0.5, "draft").save(tmp_path / "p.safetensors")
    from specee_core.early_exit.predictors import PredictorBank

    assert PredictorBank.load(tmp_path / "p.safetensors").exit_token == "draft"


class Key:
    """What a StepPolicy keeps SpecEE's timed costs under (in the engine: the EarlyExit of a set of options)."""


def test_pay_off_gate_times_costs_once_then_decides_from_the_exits():
    from specee_core.step.policy import PayOffCosts, PayOffGate, StepPolicy

    def run(gate: PayOffGate, skipped: float, steps: int, spec_s: float = 1.2, dense_s: float = 1.0) -> str:
        kinds = []
        for _ in range(steps):
            if gate.dense_next():
                kinds.append("d")
                gate.record_dense(dense_s, 0.8 * dense_s)
            else:
                kinds.append("s")
                gate.record_specee(skipped, spec_s)
        return "".join(kinds)

    policy, key = StepPolicy(), Key()
    # the first gate times the costs: a window, the dense probe; SpecEE 20% dearer, nothing skipped: it
    # does not pay, and dense stretches of 4, 8, 16 (capped) follow between windows
    lose = run(PayOffGate(policy, key, num_layers=10, window=3, probe=2, backoff=4, max_backoff=16), 0.0, 60)
    assert lose.startswith("sss" + "dd" + "dddd" + "sss" + "d" * 8 + "sss" + "d" * 16 + "sss" + "d" * 16)
    costs = policy.pay_off[key]
    assert costs.layer_share == pytest.approx(0.8) and costs.overhead == pytest.approx(0.2)
    # later gates reuse the costs (no probe) and decide from the exits: 3 of 10 layers x 0.8 > 0.2 pays
    assert run(PayOffGate(policy, key, num_layers=10, window=3, backoff=4), 3.0, 20) == "s" * 20
    assert run(PayOffGate(policy, key, num_layers=10, window=3, backoff=4), 2.0, 10) == "sss" + "dddd" + "sss"
    # the first window's exits made its steps cheaper: the timed overhead adds their savings back
    policy2, key2 = StepPolicy(), Key()
    run(PayOffGate(policy2, key2, num_layers=10, window=2, probe=1, backoff=1), 5.0, 3, spec_s=0.8)
    assert policy2.pay_off[key2].overhead == pytest.approx(0.8 / 1.0 - 1 + 0.5 * 0.8)
    assert PayOffCosts(0.1, 0.5).pays(3.0, 10) and not PayOffCosts(0.2, 0.5).pays(3.0, 10)
    # untimed (audited) steps count their exits but time nothing: no costs, no probe, SpecEE goes on
    g = PayOffGate(StepPolicy(), Key(), num_layers=10, window=2, probe=1, backoff=1)
    for _ in range(5):
        g.record_specee(1.0, None)
    assert g.mode == "specee" and g.dense_steps == 0 and g.costs is None
    g = PayOffGate(StepPolicy(), Key(), num_layers=10, window=2, probe=1, backoff=3)  # ... but a window that skipped nothing
    for _ in range(2):
        g.record_specee(0.0, None)
    assert g.mode == "dense"
    with pytest.raises(ValueError, match="window, probe and backoff"):
        PayOffGate(StepPolicy(), Key(), num_layers=10, window=0)


def test_gated_dense_steps_keep_tokens_and_the_draft_in_step(ee_model_dir, monkeypatch):
    """With exits that never fire and costs saying SpecEE's extra work is half a step, the gate runs
    dense stretches between SpecEE windows (deterministically: the costs are given) and the tokens stay
    dense's; the draft head takes the dense steps' pairs in with its next proposal, so every proposal
    after a dense stretch equals the one an ungated run makes at the same position."""
    from specee_core.step.policy import PayOffCosts
    from specee_core.draft.proposer import Proposer

    engine = SpecEEEngine.from_pretrained(ee_model_dir, speculator="draft", threshold=2.0, gate="measured",
                                          dtype="float32")
    gated_ee, ungated_ee = engine.early_exit, engine.early_exit.with_options(gate="off")
    assert gated_ee.gated and not ungated_ee.gated
    engine.policy.pay_off[gated_ee] = PayOffCosts(overhead=0.5, layer_share=1.0)
    proposals = []  # (draft cache lengths after the proposal, candidates)
    real = Proposer.candidates

    def recorded(self, rows, *a):
        ids, q = real(self, rows, *a)
        proposals.append((tuple(self.cache.lengths[0, rows].tolist()), ids.tolist()))
        return ids, q

    monkeypatch.setattr(Proposer, "candidates", recorded)
    n = 60  # 59 decode steps: SpecEE 16, dense 16, SpecEE 16, dense 11
    dense = engine.generate(PROMPTS[:2], max_new_tokens=n, mode="dense", ignore_eos=True)
    engine.early_exit = ungated_ee
    off = engine.generate(PROMPTS[:2], max_new_tokens=n, mode="specee", ignore_eos=True)
    assert all(r.stats["gated_dense_steps"] is None for r in off)
    everywhere = dict(proposals)
    assert len(everywhere) == n - 1
    proposals.clear()
    engine.early_exit = gated_ee
    gated = engine.generate(PROMPTS[:2], max_new_tokens=n, mode="specee", ignore_eos=True)
    for d, g in zip(dense, gated):
        assert g.token_ids == d.token_ids
        assert g.stats["gated_dense_steps"] == 27
    assert len(proposals) == 32
    for lengths, cand in proposals:  # the cache holds every position so far, and drafts what it drafts ungated
        assert cand == everywhere[lengths]


def test_pay_off_gate_starts_dense_where_the_calibration_says_exits_cannot_pay():
    from specee_core.step.policy import PayOffCosts, PayOffGate, StepPolicy

    policy, key = StepPolicy(), Key()
    policy.pay_off[key] = PayOffCosts(overhead=0.2, layer_share=0.8)
    assert PayOffGate(policy, key, num_layers=10, prior_skip=1.0).dense_next()  # 1 of 10 layers x 0.8 < 0.2
    assert not PayOffGate(policy, key, num_layers=10, prior_skip=3.0).dense_next()  # 3 of 10 x 0.8 > 0.2
    assert not PayOffGate(policy, key, num_layers=10, prior_skip=None).dense_next()  # no calibration: SpecEE first
    g = PayOffGate(StepPolicy(), Key(), num_layers=10, window=2, backoff=2, max_backoff=8, prior_skip=0.0)  # nothing exits
    kinds = []  # no costs needed: 8 dense steps, then a window that checks its own exits
    for _ in range(12):
        kinds.append("d" if g.dense_next() else "s")
        g.record_dense(1.0, 0.8) if kinds[-1] == "d" else g.record_specee(0.0, None)
    assert "".join(kinds) == "d" * 8 + "ss" + "dd"


def test_expected_skip_follows_the_calibration(tmp_path, ee_model_dir):
    """The gate's prior: on the calibration tokens, each exits at its shallowest firing layer."""
    import shutil

    from specee_core.early_exit.calibration import CALIBRATION_FILE, Calibration

    shutil.copytree(ee_model_dir, tmp_path, dirs_exist_ok=True)
    p = {1: torch.tensor([0.99, 0.1, 0.1, 0.1]), 2: torch.tensor([0.1, 0.99, 0.1, 0.1]),
         3: torch.tensor([0.99, 0.99, 0.99, 0.1])}
    Calibration.count(p, {l: torch.ones(4, dtype=torch.bool) for l in p}, prompts=1).save(tmp_path / CALIBRATION_FILE)
    engine = SpecEEEngine.from_pretrained(tmp_path, threshold=0.5, dtype="float32")
    assert engine.early_exit.expected_skip() == pytest.approx((3 + 2 + 1 + 0) / 4)  # layers 1, 2, 3, none of 4
    assert engine.with_options(threshold=2.0).early_exit.expected_skip() == 0.0
