"""The sandbox against canonical, wrong and hostile programs: every HumanEval problem's canonical
solution passes, and nothing a program does escapes its directory, the network or its limits. It
fails closed: a layer taken away for real (tests/eval/deny_syscalls.py) stops it with an error
naming the layer, unless allow_weak."""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from specee_eval import humaneval
from specee_eval.sandbox import Limits, detect_layers, run_many, run_python
from tests.eval.deny_syscalls import SUPPORTED, run_without
from tests.eval.test_sandbox_attacks import connected

FAST = Limits(timeout_s=3.0, memory_mb=512)
MISSING = detect_layers().missing  # this host's: {} where user namespaces and Landlock both hold
WEAK = bool(MISSING)  # so the tests run weakened only on a host that lacks a layer, and say so by passing it


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems()


def test_every_canonical_solution_passes(problems):
    assert len(problems) == 164
    outs = run_many([humaneval.program(p, p.canonical_solution) for p in problems], Limits(timeout_s=20), workers=2, allow_weak=WEAK)
    failed = [(p.task_id, o.status, o.detail) for p, o in zip(problems, outs) if not o.passed]
    assert not failed


def test_wrong_solutions_fail(problems):
    p = problems[0]  # has_close_elements
    wrong = "    return False\n"  # a body that continues the prompt
    redefined = f"def {p.entry_point}(numbers, threshold):\n    return True\n"
    outs = run_many([humaneval.program(p, wrong), humaneval.program(p, redefined), humaneval.program(p, "    return (\n")],
                    FAST, allow_weak=WEAK)
    assert [o.status for o in outs] == ["failed", "failed", "failed"]
    assert outs[0].detail.startswith("AssertionError")
    assert "SyntaxError" in outs[2].detail


def test_hanging_program_is_killed_at_the_wall_clock_limit():
    for code in ("while True:\n    pass\n", "import time\ntime.sleep(60)\n"):
        o = run_python(code, Limits(timeout_s=1.5), allow_weak=WEAK)
        assert o.status == "timeout" and 1.4 < o.seconds < 6, o


def test_memory_eater_fails_within_the_limit():
    o = run_python("x = bytearray(2 << 30)\n", FAST, allow_weak=WEAK)
    assert o.status == "failed" and "MemoryError" in o.detail


def test_output_flood_is_cut():
    o = run_python("while True:\n    print('x' * 1000)\n", Limits(timeout_s=5, output_kb=64), allow_weak=WEAK)
    assert not o.passed and o.seconds < 5


def test_early_exit_is_not_a_pass():
    for code in ("import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
        assert run_python(code, FAST, allow_weak=WEAK).status == "failed"


def test_the_program_runs_as_a_uid_of_its_own_in_a_private_folder():
    """Never root: under a root caller, a uid drawn for the program (two programs, two uids), owning
    its folder (0700) alone; under another caller, that caller's uid."""
    if "uid" in MISSING:
        pytest.skip(f"no unprivileged uid here: {MISSING['uid']}")
    code = ("import os\nst = os.stat('.')\nassert os.getuid() not in (0, 65534), os.getuid()\n"
            "assert (st.st_uid, st.st_mode & 0o777) == (os.getuid(), 0o700), (st.st_uid, oct(st.st_mode))\n")
    a, b = (run_python(code, FAST, allow_weak=WEAK) for _ in range(2))
    assert a.passed and b.passed, (a, b)
    if os.geteuid() == 0:
        assert 0 != a.guards["uid"] != b.guards["uid"] != 0
    else:
        assert a.guards["uid"] == os.geteuid()


def test_writes_stay_in_the_sandbox_directory(tmp_path):
    inside = run_python("open('notes.txt', 'w').write('ok')\nassert open('notes.txt').read() == 'ok'\n", FAST, allow_weak=WEAK)
    assert inside.passed
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    attempts = [f"open({str(target)!r}, 'w').write('x')\n",
                f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')\n",
                f"import os\nos.chdir('/')\nopen({str(target)[1:]!r}, 'a').write('x')\n",
                f"import pathlib\npathlib.Path({str(target)!r}).mkdir()\n",
                f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n"]
    for code in attempts:
        o = run_python(code, FAST, allow_weak=WEAK)
        assert o.status == "failed" and "PermissionError" in o.detail, (code, o)
    assert not target.exists() and tmp_path.is_dir()


def test_no_processes_signals_or_native_calls():
    marker = Path("/tmp") / f"specee-sandbox-{uuid.uuid4().hex}"
    for code in (f"import os\nos.system('touch {marker}')\n", "import subprocess\nsubprocess.run(['true'])\n",
                 "import os\nos.fork()\n", f"import os\nos.kill({os.getpid()}, 9)\n",
                 "import ctypes\nctypes.CDLL(None)\n"):
        o = run_python(code, FAST, allow_weak=WEAK)
        assert o.status == "failed" and "PermissionError" in o.detail, (code, o)
    assert not marker.exists()


@pytest.fixture
def listener():
    """A TCP server on loopback; connected(srv) tells whether anything connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    yield srv.getsockname()[1], srv
    srv.close()


def test_no_network(listener):
    port, srv = listener
    o = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", FAST, allow_weak=WEAK)
    assert o.status == "failed" and not connected(srv)


def test_kernel_layers_hold_without_the_audit_hook(tmp_path, listener):
    """Landlock and the network namespace on their own (the audit hook switched off)."""
    port, srv = listener
    target = tmp_path / "escape"
    L = Limits(timeout_s=3, leave_out=("audit_hook",))
    if MISSING:
        pytest.skip(f"this host lacks {MISSING}")
    g = run_python("pass", L, allow_weak=WEAK).guards
    assert run_python(f"open({str(target)!r}, 'w')\n", L, allow_weak=WEAK).detail.startswith("PermissionError")
    assert not run_python(f"import os\nassert os.system('touch {target}') == 0\n", L, allow_weak=WEAK).passed
    net = run_python(f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n", L, allow_weak=WEAK)
    assert not net.passed and not connected(srv) and not target.exists()
    assert "net" in g["namespaces"] and g["landlock"] >= 1 and "socket" in g["seccomp"] and g["audit_hook"] is False


def test_processes_die_with_the_program():
    """A child forked past the audit hook (no audit event on _posixsubprocess.fork_exec) in a new
    session outlives neither the program (PID namespace) nor the timeout."""
    tag = uuid.uuid4().hex
    code = f"""import os, time, _posixsubprocess
def pre():
    time.sleep(30)  # {tag}
    os._exit(0)
r, w = os.pipe()
_posixsubprocess.fork_exec([b"/bin/true"], [b"/bin/true"], False, (w,), None, None, -1, -1, -1, -1, -1, -1,
                           r, w, False, True, -1, None, None, -1, -1, pre, False)
time.sleep(0.3)
"""
    if "namespaces" in MISSING:
        pytest.skip(f"no PID namespace here: {MISSING['namespaces']}")
    o = run_python(code, FAST, allow_weak=WEAK)
    import time

    time.sleep(0.3)
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, "_jail.py")]
    assert not alive


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_disk_and_inodes_are_capped():
    o = run_python("for i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * (256 << 10))\n", FAST, allow_weak=WEAK)
    if not o.guards.get("tmpfs"):
        pytest.skip("no tmpfs for the sandbox here")
    assert o.status == "failed" and "No space left" in o.detail


def test_the_verdict_cannot_be_read_or_written_from_outside_the_jails_frames(tmp_path):
    leak = run_python("import os, sys\nenv = open('/proc/self/environ', 'rb').read()\n"
                      "assert b'NONCE' not in env and 'NONCE' not in dir(sys.modules['__main__'])\n", FAST, allow_weak=WEAK)
    assert leak.passed
    forge = "import os\nfor fd in range(3, 12):\n    try:\n        os.write(fd, b'passed 0\\n')\n    except OSError:\n        pass\nos._exit(0)\n"
    assert run_python(forge, FAST, allow_weak=WEAK).status == "failed"


def test_no_metadata_changes_outside(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("x")
    before = victim.stat()
    for code in (f"import os\nfd = os.open({str(victim)!r}, os.O_RDONLY)\nos.fchmod(fd, 0o777)\n",
                 f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nos.chmod('victim', 0o777, dir_fd=d)\n",
                 f"import os\nfd = os.open({str(victim)!r}, os.O_RDONLY)\nos.utime(fd, (0, 0))\n",
                 f"import os\nos.setxattr({str(victim)!r}, 'user.x', b'1')\n"):
        assert run_python(code, FAST, allow_weak=WEAK).status == "failed", code
    after = victim.stat()
    assert (after.st_mode, after.st_mtime) == (before.st_mode, before.st_mtime)


def test_reads_outside_the_directory_and_python_are_denied(tmp_path):
    """Landlock: /etc, another temporary directory, the caller's files cannot be read or listed, by
    the kernel alone too (the audit hook does not look at reads); the program's own files, the
    standard library and its shared libraries (hashlib's libcrypto) can."""
    if "landlock" in MISSING:
        pytest.skip(f"Landlock unavailable on this host: {MISSING['landlock']}")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the program")
    here = Path(__file__).resolve()
    denied = ["open('/etc/passwd').read()\n", f"open({str(secret)!r}).read()\n",
              f"import os\nos.listdir({str(tmp_path)!r})\n", "import os\nos.listdir('/etc')\n",
              f"open({str(here)!r}).read()\n"]
    for hook in (True, False):
        L = Limits(timeout_s=3, memory_mb=512, leave_out=() if hook else ("audit_hook",))
        for code in denied:
            o = run_python(code, L, allow_weak=WEAK)
            assert o.status == "failed" and o.detail.startswith("PermissionError"), (hook, code, o)
        ok = run_python("import hashlib, os, random\nopen('mine.txt', 'w').write('x')\nassert open('mine.txt').read() == 'x'\n"
                        "assert open(os.__file__).read() and hashlib.md5(b'a').hexdigest()\nos.listdir('.')\n", L,
                        allow_weak=WEAK)
        assert ok.passed, ok
    assert ok.guards["landlock"] >= 1
    assert not any(r in ("/", "/etc", "/tmp") or str(tmp_path).startswith(r + "/") for r in ok.guards["readable"])


needs_seccomp = pytest.mark.skipif(not SUPPORTED, reason="deny_syscalls knows no syscall numbers for this machine")


@needs_seccomp
@pytest.mark.parametrize("layer, missing, named", [
    ("namespaces", ["namespaces"] if os.geteuid() == 0 else ["namespaces", "processes"], "user namespaces unavailable (unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS|CLONE_NEWPID) failed: EPERM)"),
    ("landlock", ["landlock"], "Landlock unavailable (landlock_create_ruleset failed: ENOSYS)"),
    ("uid", ["processes", "uid"], "an unprivileged uid unavailable (changing to uid "),  # root is not held to RLIMIT_NPROC
    ("seccomp", ["seccomp"], "seccomp unavailable (seccomp(SECCOMP_SET_MODE_FILTER) failed: ENOSYS)")])
def test_a_missing_layer_stops_the_sandbox_and_is_named(layer, missing, named):
    """The kernel refuses the layer's syscalls: detection reports that layer (and what rests on it)
    missing, and check_layers, run_python and run_many refuse before any program runs."""
    if layer == "uid" and os.geteuid() != 0:
        pytest.skip("the sandbox changes its uid only when started as root")
    r = run_without(layer, """
from specee_eval import sandbox
print(sorted(sandbox.detect_layers().missing))
for call in (sandbox.check_layers, lambda: sandbox.run_python("pass"), lambda: sandbox.run_many(["pass"])):
    try:
        call()
        print("RAN")
    except sandbox.SandboxUnavailable as e:
        print(e)
""")
    out = r.stdout.splitlines()
    assert r.returncode == 0 and out[0] == repr(missing), r
    assert "RAN" not in out and len(out) == 4, r
    for line in out[1:]:
        assert line.startswith("sandbox: " + named) and "--allow-weak-sandbox" in line, line


@needs_seccomp
def test_allow_weak_runs_without_the_missing_layer_and_says_so():
    """No user namespaces: with allow_weak the program runs, the guards and a warning name what is
    missing, and Landlock (still there) is still required and still denies reads. Its folder (no
    tmpfs over it now) is still its own uid's alone."""
    r = run_without("namespaces", """
import os
from specee_eval import sandbox
ok = sandbox.run_python("import os\\nst = os.stat('.')\\nassert (st.st_uid, st.st_mode & 0o777) == (os.getuid(), 0o700)",
                        allow_weak=True)
read = sandbox.run_python("open('/etc/passwd').read()", allow_weak=True)
own_processes = ok.guards["processes"] == 8 or os.geteuid() != 0  # a shared uid is counted alone only in a namespace
print(ok.status, isinstance(ok.guards["namespaces"], str), ok.guards["landlock"] >= 1, own_processes)
print(read.status, read.detail.split(":")[0])
""")
    assert r.returncode == 0 and r.stdout.splitlines() == ["passed True True True", "failed PermissionError"], r
    warnings = [l for l in r.stderr.splitlines() if "SANDBOX WEAKENED" in l]
    assert len(warnings) == 1 and "WITHOUT user namespaces (unshare(" in warnings[0], r.stderr


@needs_seccomp
def test_a_layer_lost_after_detection_is_refused_by_the_jail():
    """Detection saw every layer; then the kernel stops granting user namespaces (a limit reached,
    a policy change): the jail refuses to run the program rather than run it without them."""
    if MISSING:
        pytest.skip(f"this host lacks {MISSING}")
    r = run_without("", """
from specee_eval import sandbox
assert sandbox.detect_layers().missing == {}
deny("namespaces")
try:
    sandbox.run_python("pass")
    print("RAN")
except sandbox.SandboxUnavailable as e:
    print(e)
""")
    assert r.returncode == 0 and r.stdout.startswith("sandbox: user namespaces unavailable (unshare("), r
