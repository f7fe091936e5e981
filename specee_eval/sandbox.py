"""Runs untrusted Python (a model's completion with its tests) in a separate, locked-down process.

Never in the caller's process: each program gets a fresh temporary directory and a new process
session running specee_eval/_jail.py under `python -s -S -B -P` (no site-packages, no user site,
an environment of our own). The jail (its docstring has the details) locks itself down in layers,
then runs the program:

- uid: never root. Root becomes a uid of the program's own (random, high, no account's; where this
  Python lies under a directory others may not enter, a mount namespace of the jail's own makes it
  reachable without changing a host file). Host files keep their owners' permissions against it,
  and its private work folder (0700) is its own. A caller that is not root keeps its uid;
- namespaces: new user (its uid mapped to itself, never to host root), network (no interface but
  a downed loopback; netlink sees only that), mount (a size-capped tmpfs for the program's files)
  and PID (every process it starts dies with it);
- processes: RLIMIT_NPROC counting the program's processes alone (its own uid, or its own user
  namespace), with RLIMIT_AS per process: the whole program holds at most Limits.processes
  processes and processes x memory_mb of memory; a fork bomb ends in a status, the host unaffected;
- landlock: reads only the directory, the Python installation and the shared libraries; writes
  only the directory; no TCP; signals and abstract Unix sockets scoped to the sandbox;
- seccomp: no socket of any family (Unix, netlink, inet, ...) and no io_uring, whatever the
  program calls, the standard library's C code included;
- an audit hook (a second line in Python: no subprocess, fork, ctypes, sockets, signals, file
  changes outside). The caller kills the whole process group at the wall-clock limit.
Whatever the program does (hang, crash, eat memory, flood stdout, exit early, fork, write outside,
open a socket), the outcome is a status, never an exception in the caller.

Threat model: containment rests on the kernel layers, each holding where another is missing (the
hook answers first, in Python; seccomp also stops the C code the hook never sees): a Unix-socket
connect meets the hook and seccomp, and past both the uid (a socket others may not write is closed
to it; one that any user may write stays open past those two); a netlink socket meets the hook and
seccomp, and past both the network namespace (its own loopback only); a fork bomb meets the hook,
then the process limit, then the PID namespace and the clock.

It fails closed: the layers are detected once per process (detect_layers, an empty program run in
the jail) and every run requires the layers detected. When one is missing, check_layers and
run_python raise SandboxUnavailable naming it, before any program runs, unless the caller passes
allow_weak=True (jobs.evaluate: --allow-weak-sandbox): then the programs run without it and a
warning names what is missing. A required layer that fails later (the jail refuses to run the
program) raises too.

The verdict comes over a pipe, never from a file the program can write: the jail's first line
reports the layers that hold (before the program starts), and "passed <nonce>" after the program
returned; the nonce arrives on stdin (not in the environment) and lives only in the jail's locals.
An early exit(0) or os._exit(0) is a failure. The verdict guards against programs that stop early
or crash, not against one written to forge it (the jail's frames are reachable through
sys._getframe, which the standard library needs), the same as HumanEval's own harness.

    outcome = run_python("assert 1 + 1 == 2")
    outcome.status   # "passed" | "failed" | "timeout" | "killed"
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from specee_eval._jail import HELD

log = logging.getLogger(__name__)

JAIL = Path(__file__).with_name("_jail.py")
TAIL_BYTES = 2000  # of stdout/stderr kept in the outcome
# the layers every run requires (guard: name in errors), in the order the jail sets them up
LAYERS = {"uid": "an unprivileged uid", "namespaces": "user namespaces", "processes": "a process limit of its own",
          "landlock": "Landlock", "seccomp": "seccomp"}
LEAVE_OUT = ("processes", "seccomp", "audit_hook")  # what Limits.leave_out may name


class SandboxUnavailable(RuntimeError):
    """A sandbox layer could not be set up and running without it was not allowed."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock, the process group is killed after it
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    output_kb: int = 256  # largest file the program may write, stdout and stderr included (RLIMIT_FSIZE)
    open_files: int = 64
    disk_kb: int = 65536  # the program's tmpfs
    files: int = 1000  # inodes in it
    processes: int = 8  # RLIMIT_NPROC: processes and threads of the whole program, the jail's two included
    leave_out: tuple[str, ...] = ()  # of LEAVE_OUT, layers not set up: only for tests of what the others hold

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 64 or self.output_kb < 1 or self.open_files < 16 or self.processes < 3:
            raise ValueError(f"sandbox limits out of range: {self}")
        if not set(self.leave_out) <= set(LEAVE_OUT):
            raise ValueError(f"sandbox: leave_out={sorted(self.leave_out)}, expected a subset of {LEAVE_OUT}")

    def for_jail(self, require: list[str]) -> str:
        """The jail's LIMITS_JSON; `require`: the layers without which it must not run the program."""
        return json.dumps({"memory_mb": self.memory_mb, "cpu_s": math.ceil(self.timeout_s) + 1,
                           "file_bytes": self.output_kb << 10, "open_files": self.open_files,
                           "disk_kb": self.disk_kb, "files": self.files, "processes": self.processes,
                           "leave_out": sorted(self.leave_out), "require": require})


@dataclass
class Outcome:
    status: str  # "passed" | "failed" (raised, exited early, or the jail refused something) | "timeout" | "killed"
    detail: str  # why, in a line: the exception's last line, the signal, or "timeout after 10s"
    seconds: float
    returncode: int | None
    guards: dict  # what the jail applied: uid, processes, rlimits, namespaces, landlock ABI and readable trees, seccomp, audit_hook
    stderr: str = ""  # its tail

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(path.stat().st_size - TAIL_BYTES, 0))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1].strip()[:300] if lines else ""


PYTHON_FLAGS = ["-s", "-S", "-B"] + (["-P"] if sys.version_info >= (3, 11) else [])
STATUS_CAP = 1 << 16


def _read_status(fd: int) -> list[str]:
    """What the jail wrote on the status pipe (at most STATUS_CAP bytes), as lines."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < STATUS_CAP and (chunk := os.read(fd, STATUS_CAP)):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode("utf-8", "replace").splitlines()


def missing_layers(guards: dict) -> dict[str, str]:
    """Of LAYERS, those the jail's guards say did not hold, each with the reason it gave."""
    return {layer: str(guards.get(layer, "not reported")) for layer in LAYERS
            if not isinstance(guards.get(layer), HELD[layer])}


def refusal(missing: dict[str, str]) -> str:
    """The error for missing layers: what is missing, why, and how to run without it."""
    what = "; ".join(f"{LAYERS[layer]} unavailable ({why})" for layer, why in missing.items())
    return (f"sandbox: {what}; pass --allow-weak-sandbox (allow_weak=True in specee_eval.sandbox) "
            f"to run without {'them' if len(missing) > 1 else 'it'}")


@dataclass(frozen=True)
class Layers:
    guards: dict  # what the jail reported for an empty program, no layer required
    missing: dict[str, str]  # layer (a key of LAYERS) -> why it could not be set up; {} when all hold


@functools.cache
def detect_layers() -> Layers:
    """Which of LAYERS this host sets up, found once per process by running an empty program with
    none required. Raises SandboxUnavailable when the jail cannot run at all."""
    o = _run("pass", Limits(timeout_s=30), require=())
    if not o.guards or not o.passed:
        raise SandboxUnavailable(f"sandbox: the jail could not run an empty program: {o.status}, {o.detail}")
    return Layers(o.guards, missing_layers(o.guards))


@functools.cache
def _warn_weak(missing: tuple[tuple[str, str], ...]) -> None:
    log.warning("SANDBOX WEAKENED (allow_weak): programs run WITHOUT %s",
                "; ".join(f"{LAYERS[layer]} ({why})" for layer, why in missing))


def check_layers(allow_weak: bool = False) -> Layers:
    """detect_layers, failing closed: SandboxUnavailable naming each missing layer, unless
    allow_weak (then a warning names them, once per process)."""
    layers = detect_layers()
    if layers.missing and not allow_weak:
        raise SandboxUnavailable(refusal(layers.missing))
    if layers.missing:
        _warn_weak(tuple(layers.missing.items()))
    return layers


def run_python(code: str, limits: Limits = Limits(), allow_weak: bool = False) -> Outcome:
    """Run `code` as a program in the sandbox; passed when it ran to its end. Raises
    SandboxUnavailable when a layer is missing (check_layers) or fails for this run."""
    layers = check_layers(allow_weak)
    return _run(code, limits, require=[layer for layer in LAYERS
                                       if layer not in layers.missing and layer not in limits.leave_out])


def _run(code: str, limits: Limits, require: list[str] | tuple[str, ...]) -> Outcome:
    """One program in the jail, which refuses to run it unless every layer in `require` holds."""
    with tempfile.TemporaryDirectory(prefix="specee-sandbox-", ignore_cleanup_errors=True) as tmp:
        os.chmod(tmp, 0o711)  # the program's uid must reach work/, not list tmp
        work = Path(tmp) / "work"  # the program's directory (the jail makes it the uid's own); stdout/stderr live beside it
        work.mkdir(mode=0o700)
        (work / "program.py").write_text(code)
        nonce = secrets.token_hex(16)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0"}
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        r, w = os.pipe()
        t0 = time.perf_counter()
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen([sys.executable, *PYTHON_FLAGS, str(JAIL), str(work), limits.for_jail(list(require)), str(w)],
                                        cwd=work, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True, pass_fds=(w,))
                os.close(w)
                w = -1
                try:
                    proc.stdin.write(f"{nonce}\n".encode())
                    proc.stdin.close()
                except OSError:  # it died before reading
                    pass
                try:
                    rc = proc.wait(timeout=limits.timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    rc, timed_out = None, True
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # and anything left in its group
                    except ProcessLookupError:
                        pass
                    proc.wait()
            lines = _read_status(r)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        seconds = time.perf_counter() - t0
        stderr = _tail(err_path)
    try:
        guards = json.loads(lines[0]) if lines else {}
    except ValueError:
        guards = {}
    if guards.get("refused"):
        raise SandboxUnavailable(refusal({layer: str(guards.get(layer)) for layer in guards["refused"]}))
    finished = f"passed {nonce}" in lines
    if timed_out:
        return Outcome("timeout", f"timeout after {limits.timeout_s:g}s", seconds, None, guards, stderr)
    if rc is not None and rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        status = "timeout" if sig == "SIGXCPU" else "killed"
        return Outcome(status, f"killed by {sig}", seconds, rc, guards, stderr)
    if rc == 0 and finished:
        return Outcome("passed", "", seconds, rc, guards, stderr)
    detail = _last_line(stderr) or (f"exited with {rc} before the end of the program" if rc == 0
                                    else f"exit status {rc}")
    return Outcome("failed", detail, seconds, rc, guards, stderr)


def run_many(codes: list[str], limits: Limits = Limits(), workers: int = 2, progress: bool = False,
             allow_weak: bool = False) -> list[Outcome]:
    """run_python over many programs, `workers` at a time; identical programs run once. The layers
    are checked before the first program starts."""
    check_layers(allow_weak)
    unique = list(dict.fromkeys(codes))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(unique), desc="sandbox", unit="program")

    def one(code: str) -> Outcome:
        o = run_python(code, limits, allow_weak)
        if bar is not None:
            bar.update(1)
        return o

    with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
        done = dict(zip(unique, pool.map(one, unique)))
    if bar is not None:
        bar.close()
    return [done[c] for c in codes]
