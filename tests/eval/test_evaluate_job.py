"""jobs.evaluate end to end on the bundled model (fp32, a few problems): the JSON, the Pareto plot,
the table; lossless modes agree with dense completely, exits switched off equal dense; without a
sandbox layer it stops at its start unless --allow-weak-sandbox."""
from __future__ import annotations

import json

import pytest

from jobs import evaluate
from specee_eval.sandbox import detect_layers
from tests.conftest import BUNDLED
from tests.eval.deny_syscalls import SUPPORTED, run_without

WEAK = bool(detect_layers().missing)  # passed only on a host that lacks user namespaces or Landlock


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    cfg = evaluate.EvalConfig(model=BUNDLED, modes="dense,spec,specee", thresholds="2.0,0.0", limit=3, batch_size=2,
                              max_new_tokens=24, dtype="float32", timeout_s=5, out=d / "eval.json",
                              plot=d / "eval.png", allow_weak_sandbox=WEAK)
    res = evaluate.run(cfg)
    return res, d


def test_lossless_modes_and_switched_off_exits_equal_dense(result):
    res, _ = result
    rows = {(r["mode"], r["threshold"]): r for r in res["modes"]}
    assert set(rows) == {("dense", None), ("spec", None), ("specee", 2.0), ("specee", 0.0)}
    for key in (("spec", None), ("specee", 2.0)):
        a = rows[key]["agreement"]
        assert a["identical"] == 1.0 and a["token_agreement"] == 1.0 and a["same_outcome"] == 1.0
        assert rows[key]["pass_at_1"] == rows[("dense", None)]["pass_at_1"]
    assert rows[("specee", 2.0)]["layer_fraction"] == 1.0
    assert rows[("specee", 0.0)]["layer_fraction"] < 1.0  # the first scheduled predictor always fires
    assert rows[("spec", None)]["tokens_per_step"] >= 1.0
    ppl = res["perplexity"]["modes"]
    assert ppl["specee@2"]["perplexity"] == pytest.approx(ppl["dense"]["perplexity"], rel=1e-4)
    assert ppl["specee@0"]["perplexity"] > ppl["dense"]["perplexity"]


def test_outputs_name_the_commit_and_hold_every_problem(result):
    res, d = result
    saved = json.loads((d / "eval.json").read_text())
    assert saved["git_commit"] and saved["problems"] == 3 and saved["chat"] is False
    assert saved["sandbox"]["guards"]["audit_hook"] is True
    assert saved["sandbox"]["missing_layers"] == detect_layers().missing
    assert all(len(v) == 3 and all(p["status"] in ("passed", "failed", "timeout", "killed") for p in v)
               for v in saved["per_problem"].values())
    assert (d / "eval.png").stat().st_size > 10_000
    table = evaluate.markdown(saved)
    assert len(table.splitlines()) == 2 + 4 and "specee @ 0" in table


def test_replot_from_the_json(result, tmp_path, capsys):
    _, d = result
    evaluate.main(["--replot", str(d / "eval.json"), "--plot", str(tmp_path / "again.png")])
    assert (tmp_path / "again.png").is_file() and "| dense |" in capsys.readouterr().out


def test_bad_modes_are_named():
    with pytest.raises(ValueError, match="unknown modes"):
        evaluate.EvalConfig(modes="dense,fast")


def test_low_bit_modes_run_on_their_own_engines_and_report_agreement(tmp_path):
    """dense_q8 / dense_q4: dense on weights quantized at load, scored against fp32 dense."""
    cfg = evaluate.EvalConfig(model=BUNDLED, modes="dense,dense_q8,dense_q4", limit=2, batch_size=2, max_new_tokens=16,
                              dtype="float32", timeout_s=5, perplexity=False,
                              allow_weak_sandbox=WEAK)
    engine = evaluate.SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")
    modes = evaluate.build_modes(cfg, engine)
    assert [m.engine.model.weight_format for m in modes] == ["fp32", "q8", "q4"]
    res = evaluate.run(cfg)
    rows = {r["mode"]: r for r in res["modes"]}
    assert set(rows) == {"dense", "dense_q8", "dense_q4"}
    assert all(0.0 <= rows[m]["agreement"]["token_agreement"] <= 1.0 for m in ("dense_q8", "dense_q4"))


@pytest.mark.skipif(not SUPPORTED, reason="deny_syscalls knows no syscall numbers for this machine")
def test_without_user_namespaces_the_job_stops_at_its_start_unless_allowed(tmp_path):
    """The kernel refuses unshare: the job fails before loading the model (a model path that does
    not exist is never reached) naming the layer; --allow-weak-sandbox runs it and records what is missing."""
    out = tmp_path / "weak.json"
    r = run_without("namespaces", f"""
from jobs import evaluate
from specee_eval.sandbox import SandboxUnavailable
try:
    evaluate.main(["--model", "/nonexistent/model", "--modes", "dense", "--limit", "1"])
except SandboxUnavailable as e:
    print("REFUSED", e)
evaluate.main(["--model", {str(BUNDLED)!r}, "--modes", "dense", "--limit", "1", "--max-new-tokens", "8",
               "--dtype", "float32", "--no-perplexity", "--allow-weak-sandbox", "--out", {str(out)!r}])
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("REFUSED sandbox: user namespaces unavailable (unshare("), r.stdout
    assert "--allow-weak-sandbox" in r.stdout.splitlines()[0]
    assert "SANDBOX WEAKENED" in r.stderr
    saved = json.loads(out.read_text())
    assert list(saved["sandbox"]["missing_layers"]) == ["namespaces"] and saved["sandbox"]["guards"]["landlock"] >= 1
    assert saved["per_problem"]["dense"][0]["status"] in ("passed", "failed")
