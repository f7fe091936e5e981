"""One job at a time in an output folder: `_specee_lock.json` names the job writing it.

The lock file holds the holder's host, pid, the process's start time and the run id, and the
holder keeps an flock on it while it runs (released by the kernel when the process dies, however
it dies). A second job finds the flock taken and stops with an error naming the holder. A lock file
left by a job that is gone (same host, its pid no longer running the process that took the lock) is
taken over with a warning, so a resume after a crash just works. A lock from another host is never
taken over: that host's job may still be running (its flock does not reach here on every shared
filesystem); the error says which file to delete once it is known to be gone.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

LOCK = "_specee_lock.json"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # some network and FUSE filesystems


class FolderLocked(RuntimeError):
    """Another job holds the output folder."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    process_started_at: float  # the process's start (unix seconds): tells a reused pid from the holder
    started_at: str  # when the job took the lock, local time
    run_id: str

    @classmethod
    def me(cls, run_id: str) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(), process_started_at=process_start(os.getpid()) or 0.0,
                   started_at=time.strftime("%Y-%m-%d %H:%M:%S"), run_id=run_id)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None

    def running(self) -> bool:
        """Whether this holder's process still runs (only knowable on its own host: elsewhere True)."""
        if self.host != socket.gethostname():
            return True
        started = process_start(self.pid)
        return started is not None and abs(started - self.process_started_at) < 1.0

    def __str__(self) -> str:
        return f"run {self.run_id} (pid {self.pid} on {self.host}, since {self.started_at})"


def process_start(pid: int) -> float | None:
    """The start time of process pid, None when there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


class OutputLock:
    """`with OutputLock(folder, run_id):` holds the folder for this job (FolderLocked when another has it)."""

    def __init__(self, folder: str | Path, run_id: str):
        self.path = Path(folder) / LOCK
        self.run_id = run_id
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = self._flock()
        try:
            previous = Holder.parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            if previous is not None:
                if previous.host != socket.gethostname():
                    raise FolderLocked(f"{self.path.parent} is locked by {previous}, another host: if that job is "
                                       f"gone, delete {self.path}")
                if previous.running():
                    raise FolderLocked(f"{self.path.parent} is locked by {previous}, which is still running: "
                                       f"wait for it, or stop it")
                log.warning("%s: taking over the lock of %s, whose process is gone", self.path.parent, previous)
            data = json.dumps(asdict(Holder.me(self.run_id)), indent=2).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def _flock(self) -> int:
        """An fd on the lock file holding its flock; FolderLocked when a live process holds it."""
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in NO_FLOCK:
                    log.warning("%s: the filesystem has no flock (%s): the lock file's content alone keeps other "
                                "jobs out", self.path, e)
                    return fd
                holder = Holder.parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise FolderLocked(f"{self.path.parent} is in use by {holder or 'another job'}: one job per "
                                   f"output folder") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the holder released and removed it while we waited: open the new one
        raise FolderLocked(f"could not take {self.path}: other jobs keep taking it")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while the flock is still held
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
