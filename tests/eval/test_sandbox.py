"""The sandbox against canonical, wrong and hostile programs: every HumanEval problem's canonical
solution passes, and nothing a program does escapes its directory, the network or its limits."""
from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path

import pytest

from specee_eval import humaneval
from specee_eval.sandbox import Limits, run_many, run_python

FAST = Limits(timeout_s=3.0, memory_mb=512)


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems()


def test_every_canonical_solution_passes(problems):
    assert len(problems) == 164
    outs = run_many([humaneval.program(p, p.canonical_solution) for p in problems], Limits(timeout_s=20), workers=2)
    failed = [(p.task_id, o.status, o.detail) for p, o in zip(problems, outs) if not o.passed]
    assert not failed


def test_wrong_solutions_fail(problems):
    p = problems[0]  # has_close_elements
    wrong = "    return False\n"  # a body that continues the prompt
    redefined = f"def {p.entry_point}(numbers, threshold):\n    return True\n"
    outs = run_many([humaneval.program(p, wrong), humaneval.program(p, redefined), humaneval.program(p, "    return (\n")],
                    FAST)
    assert [o.status for o in outs] == ["failed", "failed", "failed"]
    assert outs[0].detail.startswith("AssertionError")
    assert "SyntaxError" in outs[2].detail


def test_hanging_program_is_killed_at_the_wall_clock_limit():
    for code in ("while True:\n    pass\n", "import time\ntime.sleep(60)\n"):
        o = run_python(code, Limits(timeout_s=1.5))
        assert o.status == "timeout" and 1.4 < o.seconds < 6, o


def test_memory_eater_fails_within_the_limit():
    o = run_python("x = bytearray(2 << 30)\n", FAST)
    assert o.status == "failed" and "MemoryError" in o.detail


def test_output_flood_is_cut():
    o = run_python("while True:\n    print('x' * 1000)\n", Limits(timeout_s=5, output_kb=64))
    assert not o.passed and o.seconds < 5


def test_early_exit_is_not_a_pass():
    for code in ("import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
        assert run_python(code, FAST).status == "failed"


def test_writes_stay_in_the_sandbox_directory(tmp_path):
    inside = run_python("open('notes.txt', 'w').write('ok')\nassert open('notes.txt').read() == 'ok'\n", FAST)
    assert inside.passed
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    attempts = [f"open({str(target)!r}, 'w').write('x')\n",
                f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')\n",
                f"import os\nos.chdir('/')\nopen({str(target)[1:]!r}, 'a').write('x')\n",
                f"import pathlib\npathlib.Path({str(target)!r}).mkdir()\n",
                f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n"]
    for code in attempts:
        o = run_python(code, FAST)
        assert o.status == "failed" and "PermissionError" in o.detail, (code, o)
    assert not target.exists() and tmp_path.is_dir()


def test_no_processes_signals_or_native_calls():
    marker = Path("/tmp") / f"specee-sandbox-{uuid.uuid4().hex}"
    for code in (f"import os\nos.system('touch {marker}')\n", "import subprocess\nsubprocess.run(['true'])\n",
                 "import os\nos.fork()\n", f"import os\nos.kill({os.getpid()}, 9)\n",
                 "import ctypes\nctypes.CDLL(None)\n"):
        o = run_python(code, FAST)
        assert o.status == "failed" and "PermissionError" in o.detail, (code, o)
    assert not marker.exists()


@pytest.fixture
def listener():
    """A TCP server on loopback that records whether anything connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(3)
    seen = []

    def accept():
        try:
            seen.append(srv.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1], seen
    srv.close()
    t.join(timeout=5)


def test_no_network(listener):
    port, seen = listener
    o = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", FAST)
    assert o.status == "failed" and not seen


def test_kernel_layers_hold_without_the_audit_hook(tmp_path, listener):
    """Landlock and the network namespace on their own (the audit hook switched off)."""
    port, seen = listener
    target = tmp_path / "escape"
    L = Limits(timeout_s=3, audit_hook=False)
    g = run_python("pass", L).guards
    if not g.get("landlock") or not isinstance(g.get("namespaces"), list):
        pytest.skip(f"no Landlock or namespaces on this kernel: {g}")
    assert run_python(f"open({str(target)!r}, 'w')\n", L).detail.startswith("PermissionError")
    assert not run_python(f"import os\nassert os.system('touch {target}') == 0\n", L).passed
    net = run_python(f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n", L)
    assert not net.passed and not seen and not target.exists()
    assert "net" in g["namespaces"] and g["landlock"] >= 1 and g["audit_hook"] is False


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
    o = run_python(code, FAST)
    if not isinstance(o.guards.get("namespaces"), list):
        pytest.skip(f"no PID namespace here: {o.guards.get('namespaces')}")
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
    o = run_python("for i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * (256 << 10))\n", FAST)
    if not o.guards.get("tmpfs"):
        pytest.skip("no tmpfs for the sandbox here")
    assert o.status == "failed" and "No space left" in o.detail


def test_the_verdict_cannot_be_read_or_written_from_outside_the_jails_frames(tmp_path):
    leak = run_python("import os, sys\nenv = open('/proc/self/environ', 'rb').read()\n"
                      "assert b'NONCE' not in env and 'NONCE' not in dir(sys.modules['__main__'])\n", FAST)
    assert leak.passed
    forge = "import os\nfor fd in range(3, 12):\n    try:\n        os.write(fd, b'passed 0\\n')\n    except OSError:\n        pass\nos._exit(0)\n"
    assert run_python(forge, FAST).status == "failed"


def test_no_metadata_changes_outside(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("x")
    before = victim.stat()
    for code in (f"import os\nfd = os.open({str(victim)!r}, os.O_RDONLY)\nos.fchmod(fd, 0o777)\n",
                 f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nos.chmod('victim', 0o777, dir_fd=d)\n",
                 f"import os\nfd = os.open({str(victim)!r}, os.O_RDONLY)\nos.utime(fd, (0, 0))\n",
                 f"import os\nos.setxattr({str(victim)!r}, 'user.x', b'1')\n"):
        assert run_python(code, FAST).status == "failed", code
    after = victim.stat()
    assert (after.st_mode, after.st_mtime) == (before.st_mode, before.st_mtime)
