"""Chaos run: the batch job over 64 rows on SmolLM2 in SpecEE mode (so there is a schedule store) while a helper
thread kills engine actor processes at random moments, and the schedule store once. The job must end
by itself with every input id exactly once in the output, none duplicated, no row lost to the kills
(the processor: Ray Data's actor pool).

Processes are found by the title Ray gives its workers ("ray::<actor class>...") and killed with
SIGKILL: a crash, not a polite shutdown. The kills are spread over the run by the part files
written so far (one per engine batch of 8 rows), with a random delay, so that they land while rows are in flight
however fast the machine is."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from pipeline.batch import BatchConfig, run
from pipeline.stage import StageConfig
from tests.conftest import REPO

SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"  # with its draft head, predictors and schedule

ROWS = 64  # 8 part files of 8 rows: kills land at the 1st, 3rd and 5th, the store's at the 4th
PROMPTS = ["Write a Python function that reverses a string.", "What does os.path.join do?",
           "Name three built-in types.", "How do I open a file for reading?", "Explain list comprehensions."]

pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/conftest.py


def ray_processes(marker: str) -> list[psutil.Process]:
    """Live Ray worker processes whose title names marker (an actor class)."""
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            title = " ".join(p.info["cmdline"] or []) or p.info["name"] or ""
            if title.startswith("ray::") and marker in title and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class Chaos(threading.Thread):
    """Kills a random engine actor process when the output reaches each of `at_parts` part files
    (after a random delay), and the schedule store once at `store_at_parts`."""

    def __init__(self, out: Path, engine_marker: str, at_parts: list[int], store_at_parts: int, seed: int):
        super().__init__(daemon=True)
        self.out, self.engine_marker = out, engine_marker
        self.plan = sorted([(n, "engine") for n in at_parts] + [(store_at_parts, "store")])
        self.rng = random.Random(seed)
        self.killed: list[tuple[str, int, int]] = []  # (what, pid, parts written then)
        self.stop = threading.Event()

    def parts(self) -> int:
        return len(list(self.out.glob("part-*.parquet")))

    def run(self) -> None:
        for at, what in self.plan:
            while self.parts() < at:
                if self.stop.wait(0.05):
                    return
            time.sleep(self.rng.uniform(0.0, 0.5))
            victims = ray_processes(self.engine_marker if what == "engine" else "ScheduleStore")
            if victims:
                victim = self.rng.choice(victims)
                try:
                    os.kill(victim.pid, signal.SIGKILL)
                    self.killed.append((what, victim.pid, self.parts()))
                except ProcessLookupError:
                    pass


def test_chaos_every_id_exactly_once(tmp_path):
    rows = [{"id": f"c{i:03d}", "prompt": f"{PROMPTS[i % len(PROMPTS)]} ({i})"} for i in range(ROWS)]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    stage = StageConfig(model=str(SMOLLM2), mode="specee", dtype="float32", weights="q4", max_new_tokens=8,
                        batch_size=8, engine_options={"threshold": 0.5, "explore_every": 2})
    cfg = BatchConfig(input=[str(src)], output=str(out), stage=stage, num_actors=2, rows_per_file=8,
                      retune_every_tokens=256, show_progress=False)
    chaos = Chaos(out, "EngineRows", at_parts=[1, 3, 5], store_at_parts=4, seed=7)
    chaos.start()
    t0 = time.perf_counter()
    try:
        summary = run(cfg)
    finally:
        chaos.stop.set()
        chaos.join(timeout=5)
    took = time.perf_counter() - t0
    kinds = [k for k, _, _ in chaos.killed]
    assert kinds.count("engine") >= 2 and "store" in kinds, chaos.killed  # the chaos did happen
    df = pd.read_parquet(out)
    assert len(df) == ROWS and df["id"].is_unique and set(df["id"]) == {r["id"] for r in rows}
    assert df["error"].isna().all(), df.loc[df["error"].notna(), ["id", "error"]]
    assert summary["rows"] == ROWS and summary["errors"] == 0
    assert df["worker"].nunique() > 2  # restarted actors: new processes
    assert took < 600
