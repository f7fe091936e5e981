"""One job at a time in an output folder: `_specee_lock.json` names the job writing it.

The lock file holds the holder's host, its machine (the kernel's boot id and the pid namespace: containers
often share a host name such as "localhost"), pid, the process's start time and the run id. The holder
keeps an flock on it while it runs (released by the kernel when the process dies, however it dies). A second
job finds the flock taken and stops with an error naming the holder.

Where the filesystem has no flock (some network and FUSE filesystems), the file is created with O_EXCL, so of
jobs starting together exactly one creates it; the others read it and stop.

A lock file left by a job that is gone (same host and machine, its pid no longer running the process that took
the lock) is taken over with a warning, so a resume after a crash just works. Without flock the takeover is
itself exclusive: only the job that creates `_specee_lock.json.<digest>.takeover` (O_EXCL; the digest names
the stale content) may replace the stale file, and only while it still holds that content. A lock from another
host or machine, or one that does not say which machine wrote it (an older SpecEE), is never taken over: that
job may still be running (its flock does not reach here on every shared filesystem, and its pid means nothing
here); the error says which file to delete once it is known to be gone.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

LOCK = "_specee_lock.json"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # some network and FUSE filesystems
ATTEMPTS = 20  # tries to take the lock while others create, release or take it over at the same moment
RETRY_S = 0.05  # the pause between them grows by this much each time (about 10 s in all)


class FolderLocked(RuntimeError):
    """Another job holds the output folder."""


def machine_id() -> str:
    """This kernel's boot and this process's pid namespace: what a pid is relative to. Two containers or
    machines that share a host name differ in it, so neither judges the other's pid."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the boot time tells machines apart (not containers, which Linux has)
        boot = f"booted {psutil.boot_time():.0f}"
    try:
        namespace = f"pidns {os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        namespace = "pidns ?"
    return f"{boot} {namespace}"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    process_started_at: float  # the process's start (unix seconds): tells a reused pid from the holder
    started_at: str  # when the job took the lock, local time
    run_id: str
    machine: str | None = None  # machine_id(); None in the files of older versions, which lacked it

    @classmethod
    def me(cls, run_id: str) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(), process_started_at=process_start(os.getpid()) or 0.0,
                   started_at=time.strftime("%Y-%m-%d %H:%M:%S"), run_id=run_id, machine=machine_id())

    @classmethod
    def parse(cls, text: str | bytes) -> Holder | None:
        """The holder a lock file names; None when it names none (empty, being written, or not ours)."""
        try:
            h = cls(**json.loads(text))
        except (ValueError, TypeError):
            return None
        typed = (isinstance(h.host, str) and type(h.pid) is int and h.pid > 0 and isinstance(h.run_id, str)
                 and isinstance(h.process_started_at, int | float) and isinstance(h.machine, str | None))
        return h if typed else None

    def here(self) -> bool:
        """Whether this holder ran on this host and machine, where its pid can be checked."""
        return self.host == socket.gethostname() and self.machine == machine_id()

    def gone(self) -> bool:
        """Whether this holder's process is known to have ended (only knowable here: elsewhere False)."""
        if not self.here():
            return False
        started = process_start(self.pid)
        return started is None or abs(started - self.process_started_at) >= 1.0

    def __str__(self) -> str:
        return f"run {self.run_id} (pid {self.pid} on {self.host}, since {self.started_at})"


def process_start(pid: int) -> float | None:
    """The start time of process pid, None when there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def read_bytes(path: Path) -> bytes | None:
    """The file's content, None when there is no file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class OutputLock:
    """`with OutputLock(folder, run_id):` holds the folder for this job (FolderLocked when another has it)."""

    def __init__(self, folder: str | Path, run_id: str):
        self.path = Path(folder) / LOCK
        self.run_id = run_id
        self.fd: int | None = None
        self.flocked = False  # False: the filesystem has no flock, and the file's existence is the lock
        self.data = b""  # what we wrote into it

    def acquire(self) -> None:
        """Take the folder for this job; FolderLocked naming the holder when another job has it, or may."""
        self.data = json.dumps(asdict(Holder.me(self.run_id)), indent=2).encode()
        stuck = ""  # why the last try did not succeed, for the error when none does
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(RETRY_S * attempt)
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, os.O_RDWR), False
                except FileNotFoundError:  # released in between
                    continue
            try:
                self.flocked = self._flock(fd)
                if self.flocked:
                    if not self._same_file(fd):  # the holder released and removed it while we waited
                        os.close(fd)
                        continue
                    self._claim_flocked(fd)
                    self.fd = fd
                    return
                if created:  # no flock, and O_EXCL made it ours: no other job can have created it too
                    self._write(fd)
                    self.fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            fd, stuck = self._take_over_unflocked()
            if fd is not None:
                self.fd = fd
                return
        raise FolderLocked(stuck or f"could not take {self.path}: other jobs keep taking it")

    def _flock(self, fd: int) -> bool:
        """Take fd's flock: True; False when the filesystem has none; FolderLocked when a live process holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in NO_FLOCK:
                log.warning("%s: the filesystem has no flock (%s): an exclusive create of the lock file keeps other "
                            "jobs out", self.path, e)
                return False
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = Holder.parse(os.pread(fd, 1 << 16, 0))
            raise FolderLocked(f"{self.path.parent} is in use by {holder or 'another job'}: one job per "
                               f"output folder") from None

    def _same_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _claim_flocked(self, fd: int) -> None:
        """Under our flock: refuse a holder that may still run without one, else write ourselves in."""
        previous = Holder.parse(os.pread(fd, 1 << 16, 0))
        if previous is not None:
            self._refuse_unless_gone(previous)
        os.ftruncate(fd, 0)
        self._write(fd)
        if previous is not None:
            log.warning("%s: took over the lock of %s, whose process is gone", self.path.parent, previous)

    def _take_over_unflocked(self) -> tuple[int | None, str]:
        """Without flock, the lock file exists: (an fd on our lock file, "") when its holder is gone and we
        replaced it; (None, why not) when it is being written, released or taken over by another job just now.
        FolderLocked when its holder runs, or may."""
        seen = read_bytes(self.path)
        if seen is None:
            return None, ""
        previous = Holder.parse(seen)
        if previous is None:  # just created by a job that has not written itself in yet, or left so by a crash
            return None, (f"{self.path} names no holder: a job may be starting, or one crashed while taking it; "
                          f"if no job writes {self.path.parent}, delete it")
        self._refuse_unless_gone(previous)
        guard = self.path.with_name(f"{LOCK}.{hashlib.sha256(seen).hexdigest()[:16]}.takeover")
        try:
            os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:  # another job is taking over this same stale lock
            return None, (f"{self.path.parent}: a takeover of the lock of {previous} did not finish (the job taking "
                          f"it may have crashed); if no job writes the folder, delete {guard} and {self.path}")
        try:
            if read_bytes(self.path) != seen:  # taken over or released before we held the guard: look again
                return None, ""
            # Only a guard holder replaces the file, and the guard is named after its content: no other job
            # changes it between the check above and the replace below (its holder is gone).
            fresh = self.path.with_name(f"{LOCK}.{uuid.uuid4().hex}.tmp")
            fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                self._write(fd)
                os.replace(fresh, self.path)
            except BaseException:
                os.close(fd)
                fresh.unlink(missing_ok=True)
                raise
            log.warning("%s: took over the lock of %s, whose process is gone", self.path.parent, previous)
            return fd, ""
        finally:
            guard.unlink(missing_ok=True)

    def _refuse_unless_gone(self, previous: Holder) -> None:
        if previous.host != socket.gethostname():
            raise FolderLocked(f"{self.path.parent} is locked by {previous}, another host: if that job is gone, "
                               f"delete {self.path}")
        if previous.machine is None:
            raise FolderLocked(f"{self.path.parent} is locked by {previous}, written by an older SpecEE that does not "
                               f"record its machine: if that job is gone, delete {self.path}")
        if previous.machine != machine_id():
            raise FolderLocked(f"{self.path.parent} is locked by {previous}, another machine or container with the "
                               f"same host name: if that job is gone, delete {self.path}")
        if not previous.gone():
            raise FolderLocked(f"{self.path.parent} is locked by {previous}, which is still running: wait for it, "
                               f"or stop it")

    def _write(self, fd: int) -> None:
        os.pwrite(fd, self.data, 0)
        os.fsync(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if self.flocked or read_bytes(self.path) == self.data:
                self.path.unlink(missing_ok=True)  # with flock: while it is still held
            else:
                log.warning("%s no longer names this job (%s): left as it is", self.path, self.run_id)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
