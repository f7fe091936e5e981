"""The output folder's lock: one job per folder with flock and without it (an exclusive create), a dead job's
lock taken over by exactly one job, a holder on another host or machine never judged by a local pid."""
from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import output_lock
from pipeline.output_lock import LOCK, FolderLocked, Holder, OutputLock, machine_id


def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")  # what flock answers on an NFS mount without locking


def dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def leave_lock(folder: Path, **changes) -> bytes:
    """A lock file as a job (this process, unless changes say otherwise) writes it; its content."""
    fields = {**Holder.me("crashed").__dict__, **changes}
    data = json.dumps({k: v for k, v in fields.items() if v is not ...}).encode()
    (folder / LOCK).write_bytes(data)
    return data


def test_the_lock_keeps_a_second_job_out_and_a_dead_jobs_lock_is_taken_over(tmp_path, caplog, monkeypatch):
    with OutputLock(tmp_path, "run-1"):
        holder = Holder.parse((tmp_path / LOCK).read_text())
        assert (holder.pid, holder.host, holder.machine, holder.run_id) == (os.getpid(), socket.gethostname(),
                                                                            machine_id(), "run-1")
        with pytest.raises(FolderLocked, match=r"in use by run run-1 \(pid \d+ on"):
            OutputLock(tmp_path, "run-2").acquire()
    assert not (tmp_path / LOCK).exists()  # released

    leave_lock(tmp_path, pid=dead_pid())  # a crashed job on this host: its process is gone
    with OutputLock(tmp_path, "run-3"):
        assert Holder.parse((tmp_path / LOCK).read_text()).run_id == "run-3"
    assert "took over the lock of run crashed" in caplog.text
    leave_lock(tmp_path, process_started_at=1.0)  # this pid, but a newer process: the holder's pid was reused
    OutputLock(tmp_path, "run-4").__enter__().release()
    leave_lock(tmp_path, host="elsewhere")
    with pytest.raises(FolderLocked, match=f"another host: if that job is gone, delete {tmp_path / LOCK}"):
        OutputLock(tmp_path, "run-5").acquire()
    leave_lock(tmp_path)  # a live process on this host that holds no flock: not taken over
    with pytest.raises(FolderLocked, match="still running"):
        OutputLock(tmp_path, "run-6").acquire()
    (tmp_path / LOCK).unlink()

    monkeypatch.setattr(output_lock.fcntl, "flock", no_flock)
    with OutputLock(tmp_path, "run-7"):
        assert "has no flock" in caplog.text
        with pytest.raises(FolderLocked, match="run run-7 .* still running"):  # the content still keeps others out
            OutputLock(tmp_path, "run-8").acquire()
    assert not (tmp_path / LOCK).exists()


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_a_holder_that_shares_the_host_name_but_not_the_machine_is_never_judged_by_its_pid(tmp_path, monkeypatch,
                                                                                          flock):
    if not flock:
        monkeypatch.setattr(output_lock.fcntl, "flock", no_flock)
    pid = dead_pid()  # no such process here; on the holder's machine it may be the running job
    leave_lock(tmp_path, pid=pid, machine="another boot pidns 4026531836")  # a container also called this host
    with pytest.raises(FolderLocked, match=f"another machine or container with the same host name: if that job is "
                                           f"gone, delete {tmp_path / LOCK}"):
        OutputLock(tmp_path, "run-1").acquire()
    old = leave_lock(tmp_path, pid=pid, machine=...)  # an older SpecEE's file: parsed, but its machine unknown
    assert Holder.parse(old).machine is None
    with pytest.raises(FolderLocked, match="older SpecEE that does not record its machine"):
        OutputLock(tmp_path, "run-2").acquire()
    assert (tmp_path / LOCK).read_bytes() == old  # left as it was


def test_without_flock_a_lock_that_names_no_holder_or_a_stuck_takeover_is_not_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(output_lock.fcntl, "flock", no_flock)
    monkeypatch.setattr(output_lock, "RETRY_S", 0.0)
    (tmp_path / LOCK).write_text("")  # created by a job that has not written itself in yet
    with pytest.raises(FolderLocked, match=f"{tmp_path / LOCK} names no holder"):
        OutputLock(tmp_path, "run-1").acquire()
    stale = leave_lock(tmp_path, pid=dead_pid())
    guard = tmp_path / f"{LOCK}.{output_lock.hashlib.sha256(stale).hexdigest()[:16]}.takeover"
    guard.touch()  # another job is taking over this dead job's lock (or crashed while doing so)
    with pytest.raises(FolderLocked, match=f"did not finish .* delete {guard}"):
        OutputLock(tmp_path, "run-2").acquire()
    assert (tmp_path / LOCK).read_bytes() == stale
    guard.unlink()
    with OutputLock(tmp_path, "run-3"):
        assert Holder.parse((tmp_path / LOCK).read_bytes()).run_id == "run-3"
    assert sorted(tmp_path.iterdir()) == []  # no guard or temporary file left


def contend(root: str, rounds: int, flock: bool, barrier, results) -> None:
    """One of the racing jobs (a process of its own): each round, try the round's folder at the same moment as
    the others, report whether it won, and let go only once every job has tried."""
    if not flock:
        output_lock.fcntl.flock = no_flock  # this process's filesystem has none
    for r in range(rounds):
        lock = OutputLock(Path(root) / f"round-{r}", f"job-{os.getpid()}")
        barrier.wait(timeout=60)
        try:
            lock.acquire()
        except FolderLocked:
            pass
        results.put((r, os.getpid(), lock.fd is not None))
        barrier.wait(timeout=60)
        lock.release()


@pytest.mark.slow
@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_jobs_starting_together_never_both_hold_the_folder(tmp_path, flock):
    jobs, rounds = 4, 30
    stale = [r % 2 == 1 for r in range(rounds)]  # odd rounds: every job races to take over a dead job's lock
    pid = dead_pid()
    for r in range(rounds):
        (tmp_path / f"round-{r}").mkdir()
        if stale[r]:
            leave_lock(tmp_path / f"round-{r}", pid=pid, run_id=f"crashed-{r}")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(jobs), ctx.Queue()
    procs = [ctx.Process(target=contend, args=(str(tmp_path), rounds, flock, barrier, results)) for _ in range(jobs)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in range(jobs * rounds)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    winners = {r: sum(won for rr, _, won in reports if rr == r) for r in range(rounds)}
    assert winners == {r: 1 for r in range(rounds)}
    for r in range(rounds):  # each winner found its own content and released it: nothing left behind
        assert sorted((tmp_path / f"round-{r}").iterdir()) == [], r
