"""tools.bench_batched's plot, from the JSON a run wrote (no engine, no llama.cpp)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image

from tools.bench_batched import plot_batched

RUN = Path(__file__).resolve().parents[1] / "docs" / "bench_batched_builds_avx512_amd_fc721da.json"


def test_the_plot_has_a_ratio_panel_only_where_the_run_had_auto_and_dense(tmp_path):
    result = json.loads(RUN.read_text())
    both = matplotlib.image.imread(plot_batched(result, tmp_path / "both.png"))
    # the same run with the dense variant left out: tokens/s alone
    for key in ("tokens_per_s_median", "tokens_per_s_runs"):
        result[key] = {k: v for k, v in result[key].items() if "/dense_" not in k}
    alone = matplotlib.image.imread(plot_batched(result, tmp_path / "alone.png"))
    assert both.shape[1] == 1210 and alone.shape[1] == 660 and both.shape[0] == alone.shape[0] == 462
