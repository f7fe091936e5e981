"""SpecEE mode mechanics on a tiny random model (quality is tested on the bundled model)."""
from __future__ import annotations

import pytest
import torch

from specee_core import SpecEEEngine
from specee_core.early_exit.scheduler import Schedule, retune, select_offline_layers

PROMPTS = ["def f(x):\n    return x", "import os\n", "class A:\n    pass\n\nclass B(A):", "for i in range(10):"]


@pytest.mark.parametrize("speculator,kv_mode,skip", [("draft", "propagate", "row"), ("draft", "gap", "batch"),
                                                     ("lookup", "propagate", "batch"), ("lookup", "gap", "row"),
                                                     ("draft", "recompute", "row"), ("lookup", "recompute", "batch")])
def test_exits_off_equals_dense(ee_model_dir, speculator, kv_mode, skip):
    engine = SpecEEEngine.from_pretrained(ee_model_dir, speculator=speculator, kv_mode=kv_mode, threshold=2.0, skip=skip, dtype="float32")
    dense = engine.generate(PROMPTS, max_new_tokens=12, mode="dense")
    batched = engine.generate(PROMPTS, max_new_tokens=12, mode="specee")
    single = [engine.generate([p], max_new_tokens=12, mode="specee")[0] for p in PROMPTS]
    for d, b, s in zip(dense, batched, single):
        assert b.token_ids == d.token_ids == s.token_ids
        assert b.exit_layers == [engine.config.num_hidden_layers] * len(b.token_ids)
        assert b.stats["predictor_calls"] > 0


@pytest.mark.parametrize("skip", ["row", "batch"])
@pytest.mark.parametrize("verify", ["local", "full"])
@pytest.mark.parametrize("kv_mode", ["propagate", "gap", "recompute"])
def test_always_exit_runs_fewer_layers(ee_model_dir, verify, kv_mode, skip):
    engine = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.0, verify=verify, kv_mode=kv_mode, skip=skip, dtype="float32")
    res = engine.generate(PROMPTS, max_new_tokens=10, mode="specee", ignore_eos=True)
    L = engine.config.num_hidden_layers
    assert all(r.exit_layers[0] == L for r in res)  # prefill's token: full depth, always
    layers = [l for r in res for l in r.exit_layers[1:]]
    assert len(layers) == 36
    if verify == "local":  # the first active layer always accepts
        assert max(layers) < L
    for r in res:
        assert sum(r.stats["exit_histogram"]) == len(r.token_ids)
        assert r.stats["avg_layers"] == pytest.approx(sum(r.exit_layers) / len(r.exit_layers))
    cache = engine._cache
    full = cache.lengths[0, :4]
    if kv_mode == "propagate":  # every layer keeps a full cache
        assert (cache.lengths[:, :4] == full).all()
    else:  # skipped layers stay behind
        assert (cache.lengths[-1, :4] < full).all()


@pytest.mark.parametrize("kv_mode", ["propagate", "recompute"])
def test_bf16_specee_paths(ee_model_dir, kv_mode):
    """The CPU bf16 path (oneDNN-packed weights, fp32 K/V): exits off equals dense token for token, and
    always-exit steps run with their KV writes (propagated rows, recompute chunks) into the fp32 cache."""
    engine = SpecEEEngine.from_pretrained(ee_model_dir, dtype="bfloat16", kv_mode=kv_mode, threshold=2.0)
    assert engine.model.kv_dtype == torch.float32
    dense = engine.generate(PROMPTS, max_new_tokens=10, mode="dense")
    off = engine.generate(PROMPTS, max_new_tokens=10, mode="specee")
    assert [r.token_ids for r in off] == [r.token_ids for r in dense]
    res = engine.with_options(threshold=0.0).generate(PROMPTS, max_new_tokens=10, mode="specee", ignore_eos=True)
    assert max(l for r in res for l in r.exit_layers[1:]) < engine.config.num_hidden_layers


def test_batch_skip_keeps_exited_rows_flowing(ee_model_dir):
    """skip='batch': a row that exited keeps running layers (exact KV) until every row has exited;
    skip='row' compacts. Same tokens and exit layers for a row that exits alone."""
    row = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.55, skip="row", kv_mode="gap", dtype="float32")
    bat = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.55, skip="batch", kv_mode="gap", dtype="float32")
    a = row.generate(PROMPTS[:1], max_new_tokens=10, mode="specee", ignore_eos=True)[0]
    b = bat.generate(PROMPTS[:1], max_new_tokens=10, mode="specee", ignore_eos=True)[0]
    assert a.token_ids == b.token_ids and a.exit_layers == b.exit_layers  # batch of one: identical
    res = bat.generate(PROMPTS, max_new_tokens=10, mode="specee", ignore_eos=True)
    cache = bat._cache
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
    with pytest.raises(ValueError, match="kv_mode must be one of"):
        SpecEEEngine.from_pretrained(ee_model_dir, kv_mode="copy", dtype="float32")
    with pytest.raises(TypeError, match="unknown engine options"):
        SpecEEEngine.from_pretrained(ee_model_dir, thresold=0.5, dtype="float32")


def test_candidate_scorer_equals_kernel_reference(ee_model_dir):
    from kernels import fused_predictor_reference
    from specee_core.early_exit.step import CandidateScorer

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

    from specee_core.early_exit.speculators import DraftHead, DraftSpeculator

    shutil.copytree(ee_model_dir, tmp_path, dirs_exist_ok=True)
    head = DraftHead.load(tmp_path / "draft", SpecEEEngine.from_pretrained(tmp_path, dtype="float32").config)
    subset = torch.arange(100, 400)
    head.save(tmp_path / "draft", vocab_subset=subset)
    engine = SpecEEEngine.from_pretrained(tmp_path, speculator="draft", threshold=0.0, dtype="float32")
    seen = []
    assert isinstance(engine.early_exit.speculator, DraftSpeculator)
    original = DraftSpeculator.propose  # steppers draft with forks of it: record at the class
    monkeypatch.setattr(DraftSpeculator, "propose", lambda self, *a: seen.append(original(self, *a)) or seen[-1])
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
