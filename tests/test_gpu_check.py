"""tools.gpu_check runs where a GPU is lent, once per session and against a clock: here its whole path runs on the
CPU with the bundled model (tiny settings), so a broken script shows in CI, not in the GPU's minutes."""
from __future__ import annotations

import json

from tools import gpu_check
from tests.conftest import BUNDLED


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "report.json"
    report = gpu_check.main(["--device", "cpu", "--model", str(BUNDLED), "--tokens", "4", "--speed-tokens", "3",
                             "--batches", "2", "--rounds", "1", "--out", str(out)])
    checks = report["checks"]
    # the lossless ones must hold anywhere (the fused Triton predictor needs CUDA tensors, or the interpreter where
    # another test set it up; how soon q4's greedy path parts from fp32's depends on the model: the bundled one's
    # margins are small)
    lossless = [k for k in checks if "equals" in k]
    assert len(lossless) == 8 and all(checks[k]["ok"] for k in lossless), {k: checks[k] for k in lossless}
    assert {"specee_triton_predictor_decides_like_torch", "specee_zpdqh_triton_predictor_decides_like_torch",
            "q8_greedy_against_fp32", "q4_greedy_against_fp32"} <= set(checks)  # recorded, whatever they found
    assert checks["dense_equals_transformers_fp32"]["first_divergence"] == [None] * 8
    for batch in ("batch_2",):  # a batch of 2: ragged rows; batch 1's path is one row of it
        speed = report["speed"][batch]
        assert "errors" not in speed
        assert {"hf/fp32", "fp32/dense", "fp32/spec_tree", "q4/dense", "default/auto"} <= set(speed)
        assert all(v["tokens_per_s"] > 0 for v in speed.values())
    assert json.loads(out.read_text())["speed"] == report["speed"]
    png = tmp_path / "speed.png"
    gpu_check.main(["--plot", str(out), "--out", str(png)])
    assert png.stat().st_size > 10_000
