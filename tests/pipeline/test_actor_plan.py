"""pipeline.actor_plan: the layouts of a machine's cores, the measured choice and its cache, real worker processes,
and the batch job's use of it."""
from __future__ import annotations

import pytest

from pipeline.actor_plan import Workload, layouts, measure_layouts, plan_layout
from tests.conftest import BUNDLED


def test_layouts_use_every_core():
    assert layouts(1) == [(1, 1)]
    assert layouts(2) == [(1, 2), (2, 1)]
    assert layouts(12) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2)]  # at most 8 actors
    with pytest.raises(ValueError, match="cpus must be >= 1"):
        layouts(0)


def test_the_fastest_layout_is_chosen_once_and_cached(tmp_path):
    """The best measured layout wins; a second call reads the cache (measuring again would fail here); another
    workload (batch size) is measured anew; one core has one layout and is not measured."""
    rates = {(1, 2): [100.0, 150.0, 90.0], (2, 1): [130.0, 80.0, 131.0]}  # turns: the medians decide
    calls = []

    def fake(w, options):
        calls.append((w.batch, tuple(options)))
        return {f"{a}x{t}": rates[a, t] for a, t in options}

    w = Workload(str(BUNDLED), mode="dense", batch=4)
    plan = plan_layout(w, cpus=2, root=tmp_path, measure=fake)
    assert (plan["actors"], plan["threads"]) == (2, 1) and plan["tokens_per_s"] == {"1x2": 100.0, "2x1": 130.0}
    assert "2 actors x 1 threads on 2 cores" in plan["reason"] and len(calls) == 1

    def never(*args):
        raise AssertionError("measured again")

    assert plan_layout(w, cpus=2, root=tmp_path, measure=never) == plan
    rates[1, 2] = [200.0] * 3
    other = plan_layout(Workload(str(BUNDLED), mode="dense", batch=8), cpus=2, root=tmp_path, measure=fake)
    assert (other["actors"], other["threads"]) == (1, 2) and len(calls) == 2
    single = plan_layout(w, cpus=1, root=tmp_path, measure=never)
    assert (single["actors"], single["threads"]) == (1, 1)


def test_a_wide_lead_ends_the_turns_early_and_a_near_tie_takes_them_all():
    from pipeline.actor_plan import _decided

    assert _decided({"1x2": [100.0], "2x1": [140.0]}, 1)
    assert not _decided({"1x2": [100.0], "2x1": [120.0]}, 1) and _decided({"1x2": [100.0, 98], "2x1": [120.0, 118]}, 2)
    assert not _decided({"1x2": [100.0, 101.0], "2x1": [104.0, 103.0]}, 2) and not _decided({"1x2": [1.0] * 3,
                                                                                           "2x1": [9.0] * 3}, 3)


def test_layouts_take_turns_on_real_worker_processes():
    """One engine of two threads here and two worker processes of one thread each (loaded once) decode in turns:
    each layout's tokens per second on every turn (2x1: both workers' tokens over the slower one's seconds)."""
    runs = measure_layouts(Workload(str(BUNDLED), mode="dense", dtype="float32", batch=2, tokens=4),
                           [(1, 2), (2, 1)], rounds=3)
    turns = len(runs["1x2"])
    assert set(runs) == {"1x2", "2x1"} and len(runs["2x1"]) == turns and min(runs["1x2"] + runs["2x1"]) > 0
    assert 1 <= turns <= 3  # fewer than 3 only where the lead settled it (_decided, above)


def test_the_batch_job_takes_the_measured_layout(ray_cluster, monkeypatch, tmp_path):
    """num_actors None: on a one-machine CPU cluster the plan's actors, each with the cluster's CPUs shared and the
    plan's threads; a given num_actors, or cpus_per_actor, is kept."""
    from pipeline import actor_plan
    from pipeline.batch import BatchConfig, with_measured_layout
    from pipeline.stage import StageConfig
    import ray

    cpus = int(ray.cluster_resources()["CPU"])
    monkeypatch.setattr(actor_plan, "plan_layout", lambda w, cpus: {"actors": cpus, "threads": 1, "reason": "test"})
    cfg = BatchConfig(input=["x.jsonl"], output=str(tmp_path), stage=StageConfig(model=str(BUNDLED)), num_actors=None)
    got = with_measured_layout(cfg)
    assert (got.num_actors, got.cpus_per_actor, got.stage.torch_threads) == (cpus, 1.0, 1)
    fixed = BatchConfig(input=["x.jsonl"], output=str(tmp_path), stage=StageConfig(model=str(BUNDLED)), num_actors=3)
    assert with_measured_layout(fixed) is fixed
    shared = BatchConfig(input=["x.jsonl"], output=str(tmp_path), stage=StageConfig(model=str(BUNDLED)),
                         num_actors=None, cpus_per_actor=0.5)
    assert with_measured_layout(shared).num_actors == 2
