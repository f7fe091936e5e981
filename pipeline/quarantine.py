"""Rows whose batch killed or hung its engine process, run where a death costs nothing else.

An engine actor's batch whose process crashed runs again in the actor (pipeline.processor.EngineRows): most
deaths are the machine's (a lost or killed worker), and a rerun costs only the batch. A batch that died
twice, or hung once (past the per-batch timeout its process stops itself), runs again in a Quarantine: a
child process of the actor, with an engine of its own (the actor's settings), that may die without taking
the actor, its Ray Data task or any other row with it. The batch is first run whole there (not after a
hang: that would cost another timeout), then, if that dies too, one row at a time; a row that kills or
hangs a fresh child `row_attempts` times in a row becomes an error row, whatever the number of such rows in
the batch. The child is reused while it lives, so rows that succeed cost no new process; every death costs
one (an engine load); it is stopped when the batch is done.

The child is forked from a forkserver (never from the actor itself: it has threads) that has imported
the engine's modules once, so a new child costs an engine load, not a Python start; it talks to the
actor over a pipe: a table of rows in, a ROW_SCHEMA table out. It loads the engine without Ray (no schedule
store: in mode specee its rows run with the schedule the actor had at start and report no statistics)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import time
from dataclasses import replace

import pyarrow as pa

from pipeline.stage import GenerateRows, StageConfig

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 900.0  # a child that has not loaded its engine by then is stopped (a death)


class Died(Exception):
    """The quarantine's child process died, or overran its time, running a batch."""


class Quarantine:
    """A child process with its own engine, started when first needed and again after each death."""

    def __init__(self, stage: StageConfig, run_id: str, timeout_s: float | None, worker: str):
        """worker: the actor's worker name; the child's rows name it, with the child's pid after a '/'."""
        import torch

        # the child uses the threads the actor has (Ray gave the actor its CPUs; the child asks Ray for none), and
        # runs one batch at a time
        self.stage = replace(stage, torch_threads=stage.torch_threads or torch.get_num_threads(),
                             max_concurrent_batches=1)
        self.run_id, self.timeout_s, self.worker = run_id, timeout_s, worker
        self._proc = self._conn = None
        self.started = 0  # child processes started so far

    def run(self, batch: pa.Table) -> pa.Table:
        """The child's output rows for batch; Died when the child dies or overruns timeout_s."""
        if self._proc is None:
            self._start()
        self._conn.send(batch)
        return self._answer(self.timeout_s, f"running {batch.num_rows} row(s)")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
            self._proc = self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["pipeline.stage"])
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(self.stage, self.run_id, self.worker, child),
                                 daemon=True, name="specee-quarantine")
        self._proc.start()
        child.close()
        self._conn = parent
        self.started += 1
        self._answer(LOAD_TIMEOUT_S, "loading its engine")

    def _answer(self, timeout_s: float | None, doing: str):
        t0 = time.perf_counter()
        try:
            ready = self._conn.poll(timeout_s)  # True on an answer and on the child's death (EOF)
            message = self._conn.recv() if ready else None
        except (EOFError, ConnectionError):
            message = None
            ready = True
        if message is None:
            self._proc.join(1 if ready else 0)
            code = self._proc.exitcode
            self.close()
            if not ready:
                raise Died(f"the engine process did not finish {doing} within {timeout_s:g} s (the per-batch "
                           f"timeout) and was stopped")
            raise Died(f"the engine process died {doing} (exit code {code}, after "
                       f"{time.perf_counter() - t0:.1f} s)")
        kind, value = message
        if kind == "error":  # the engine raised outside any row: not the rows' fault, not a death either
            self.close()
            raise RuntimeError(f"quarantined engine: {value}")
        return value


def _child_main(stage: StageConfig, run_id: str, worker: str, conn) -> None:
    """The child process: one engine; a table in, its rows out, until the pipe closes."""
    logging.basicConfig(level=logging.WARNING)
    try:
        rows = GenerateRows(stage, run_id)
        rows.worker = f"{worker}/{os.getpid()}"  # the actor's (its node, its id), then this process
    except Exception as e:  # noqa: BLE001 -- reported to the actor, which fails the batch with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            batch = conn.recv()
        except (EOFError, ConnectionError):
            return
        try:
            out = rows(batch)
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return
        conn.send(("rows", out))
