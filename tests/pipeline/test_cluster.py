"""The batch job on a Ray cluster of three nodes started on this machine (ray.cluster_utils.Cluster: each
node its own raylet, CPUs and object store): a head with no CPUs (the driver, the schedule store) and two
workers with one CPU each, an engine actor on each. A worker node is removed mid-run: its actor comes back
on the other node, and every id is written once.

Ray of its own: this module does not use the suite's shared cluster (tests/conftest.py), and runs while
that one is down (its tests run last)."""
from __future__ import annotations

import json
import threading
import time

import pandas as pd
import pytest
import ray

from pipeline.batch import BatchConfig, run
from pipeline.local_ray import set_loopback
from pipeline.stage import StageConfig

ROWS = 48


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "the shared cluster should be down while this module runs"
    set_loopback()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 128 << 20})
    workers = [c.add_node(num_cpus=1, object_store_memory=128 << 20) for _ in range(2)]
    c.wait_for_nodes()
    c.connect()
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def test_job_on_two_worker_nodes_survives_losing_one(tmp_path, ee_model_dir, cluster):
    c, workers = cluster
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"def f{i}(x):\n    return"}) + "\n"
                           for i in range(ROWS)))
    out = tmp_path / "out"
    # specee: there is a schedule store (on the head: it asks for no CPU), engines report to it
    stage = StageConfig(model=str(ee_model_dir), mode="specee", dtype="float32", max_new_tokens=8, batch_size=4)
    cfg = BatchConfig(input=[str(src)], output=str(out), stage=stage, num_actors=2, cpus_per_actor=0.5,
                      rows_per_file=4, show_progress=False)

    removed = threading.Event()

    def remove_a_node_mid_run() -> None:
        deadline = time.time() + 300
        while len(list(out.glob("part-*.parquet"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        c.remove_node(workers[1])
        removed.set()

    killer = threading.Thread(target=remove_a_node_mid_run, daemon=True)
    killer.start()
    summary = run(cfg)
    killer.join(10)
    assert removed.is_set()
    df = pd.read_parquet(out)
    assert df["id"].is_unique and set(df["id"]) == {f"r{i}" for i in range(ROWS)}
    assert df["error"].isna().all(), df.loc[df["error"].notna(), "error"].head()
    nodes = set(df["worker"].str.extract(r"@([0-9a-f]{8}):")[0])  # <actor>@<node>:<pid>[/<child pid>]
    assert nodes == {w.node_id[:8] for w in workers}, nodes  # rows from engines on both worker nodes
    assert summary["rows"] == ROWS
