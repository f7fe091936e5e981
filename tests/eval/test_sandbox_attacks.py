"""A fork bomb, a Unix-socket connect and a netlink socket against the sandbox, whole and with its
layers taken away in turn (Limits.leave_out): each is refused or contained by the next layer that
holds, and the host is unaffected. The layer each case rests on is named in its parameters."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections import Counter

import pytest

from specee_eval.sandbox import Limits, detect_layers, run_python

MISSING = detect_layers().missing
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this host lacks {MISSING}")

HOOK, SECCOMP, PROCESSES = "audit_hook", "seccomp", "processes"
BOMB = "import os\nwhile True:\n    os.fork()\n"


def fan_out(n: int) -> str:
    """A program that forks n children which sleep, and writes on stderr how many it made."""
    return (f"import os, sys, time\nn = 0\ntry:\n    while n < {n}:\n        if os.fork() == 0:\n"
            f"            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
            f"finally:\n    sys.stderr.write(f'forked {{n}}\\n')\n")


def forked(stderr: str) -> int:
    return int(next(l for l in stderr.splitlines() if l.startswith("forked ")).split()[1])


def processes_by_uid() -> Counter:
    """The host's processes per uid, as the host's /proc shows them."""
    counts = Counter()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                counts[os.stat(f"/proc/{p}").st_uid] += 1
            except OSError:  # it exited
                pass
    return counts


def test_a_fork_bomb_is_refused_by_the_audit_hook():
    o = run_python(BOMB, Limits(timeout_s=3))
    assert o.status == "failed" and o.detail == "PermissionError: sandbox: os.fork is not allowed", o


def test_without_the_hook_a_fork_bomb_is_held_by_the_process_limit_and_the_host_is_unaffected():
    """The bomb runs into RLIMIT_NPROC, which counts the program's uid alone: the host sees at most
    `processes` of them at any moment, keeps starting processes of its own meanwhile, and none is
    left when the outcome (a status) comes back."""
    limits = Limits(timeout_s=5, processes=8, leave_out=(HOOK,))
    outcome = []
    bomb = threading.Thread(target=lambda: outcome.append(run_python(BOMB, limits)))
    peak, host_ran = Counter(), 0
    bomb.start()
    while bomb.is_alive():
        peak |= processes_by_uid()
        host_ran += subprocess.run(["true"]).returncode == 0
    o = outcome[0]
    uid = o.guards["uid"]
    assert o.status == "failed" and o.detail.startswith("BlockingIOError"), o
    assert o.guards["processes"] == 8 and o.seconds < 5
    assert isinstance(uid, int) and uid != 0 and 0 < peak[uid] <= 8, (uid, peak[uid])
    assert host_ran >= 1 and processes_by_uid()[uid] == 0


@pytest.mark.parametrize("leave_out, most", [((HOOK,), 6), ((HOOK, SECCOMP), 6)], ids=["hook", "hook-seccomp"])
def test_the_process_limit_counts_the_whole_program(leave_out, most):
    """40 forks asked, `processes` - 2 granted (the jail's two processes count): whatever other
    processes the host runs, and never unbounded as under host root."""
    o = run_python(fan_out(40), Limits(timeout_s=5, processes=8, leave_out=leave_out))
    assert o.status == "failed" and o.detail.startswith("BlockingIOError"), o
    assert forked(o.stderr) == most


def test_without_the_process_limit_every_process_still_dies_with_the_program():
    """Hook and process limit left out: the PID namespace still ends every process the program
    started when it ends (a bounded fan-out here: a real bomb would only meet the clock)."""
    o = run_python(fan_out(20), Limits(timeout_s=5, processes=8, leave_out=(HOOK, PROCESSES)))
    assert o.passed and forked(o.stderr) == 20, o
    assert processes_by_uid()[o.guards["uid"]] == 0


def connected(srv: socket.socket) -> bool:
    """Whether anything connected to a listening socket: a connection waits in its queue, closed or not."""
    srv.setblocking(False)
    try:
        srv.accept()[0].close()
        return True
    except BlockingIOError:
        return False


@pytest.fixture
def unix_listener():
    """A Unix socket as daemons keep theirs (/run/systemd/private): a directory anyone may enter, the
    socket root's alone (0600)."""
    folder = tempfile.mkdtemp(prefix="specee-unix-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "daemon.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(1)
    yield path, srv
    srv.close()
    shutil.rmtree(folder)


@pytest.mark.parametrize("leave_out, refused_by", [
    ((), "sandbox: socket.__new__ is not allowed"),  # the hook
    ((HOOK,), "socket"),  # seccomp: socket() itself fails
    ((HOOK, SECCOMP), "connect"),  # the uid: the socket is not its to write
], ids=["hook", "seccomp", "uid"])
def test_a_unix_socket_connect_is_refused(unix_listener, leave_out, refused_by):
    path, srv = unix_listener
    code = (f"import socket, sys\ns = socket.socket(socket.AF_UNIX)\nsys.stderr.write('socket made\\n')\n"
            f"s.connect({path!r})\nsys.stderr.write('connected\\n')\n")
    o = run_python(code, Limits(timeout_s=3, leave_out=leave_out))
    assert o.status == "failed" and o.detail.startswith("PermissionError"), o
    assert "connected" not in o.stderr and ("socket made" in o.stderr) == (refused_by == "connect"), o.stderr
    if refused_by.startswith("sandbox:"):
        assert refused_by in o.detail
    else:
        assert "[Errno 13]" in o.detail
    assert not connected(srv)


def test_an_abstract_unix_socket_is_out_of_reach_without_hook_and_seccomp():
    """Abstract sockets belong to a network namespace (and Landlock scopes them): the host's is not there."""
    name = f"\0specee-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(name)
    srv.listen(1)
    try:
        o = run_python(f"import socket\nsocket.socket(socket.AF_UNIX).connect({name!r})\n",
                       Limits(timeout_s=3, leave_out=(HOOK, SECCOMP)))
        assert not connected(srv)
    finally:
        srv.close()
    assert o.status == "failed" and o.detail.split(":")[0] in ("ConnectionRefusedError", "PermissionError"), o


NETLINK = "import socket\ns = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\n"
LINKS = "import socket\nnames = [n for _, n in socket.if_nameindex()]\nassert names == ['lo'], names\n"  # glibc's own netlink socket


@pytest.mark.parametrize("code, leave_out, detail", [
    (NETLINK, (), "PermissionError: sandbox: socket.__new__ is not allowed"),  # the hook
    (LINKS, (), "PermissionError: [Errno 13] Permission denied"),  # seccomp: C code past the hook
    (NETLINK, (HOOK,), "PermissionError: [Errno 13] Permission denied"),  # seccomp
], ids=["hook", "seccomp-under-hook", "seccomp"])
def test_a_netlink_socket_is_refused(code, leave_out, detail):
    o = run_python(code, Limits(timeout_s=3, leave_out=leave_out))
    assert o.status == "failed" and o.detail == detail, o


def test_without_hook_and_seccomp_netlink_sees_only_the_sandbox_network():
    """The network namespace holds: a netlink socket opens, and the links it lists are the
    sandbox's loopback alone, none of the host's."""
    host = [n for _, n in socket.if_nameindex()]
    if host == ["lo"]:
        pytest.skip("this host has no interface but lo: the namespace would look the same")
    o = run_python(NETLINK + LINKS, Limits(timeout_s=3, leave_out=(HOOK, SECCOMP)))
    assert o.passed and o.guards["seccomp"].startswith("left out"), o
