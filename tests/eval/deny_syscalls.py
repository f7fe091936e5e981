"""Take a sandbox layer away for real: a seccomp filter makes the kernel answer its syscalls with an
error, as hosts and container runtimes do: user.max_user_namespaces=0 or Ubuntu's AppArmor policy
refuse new user namespaces (EPERM) while other namespaces still work; a root without CAP_SETUID
cannot change its uid (EPERM); older kernels answer the Landlock syscalls with ENOSYS, and seccomp's
own syscall with ENOSYS where it is not built in. The filter holds for the process that installs
it and every process it starts, so tests run it in a child Python (`run_without`)."""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLONE_NEWUSER = 0x10000000
# machine: (AUDIT_ARCH_*, {layer: [(syscall number, errno, flags in its first argument that must be set or None)]})
ARCHES = {
    "x86_64": (0xC000003E, {"namespaces": [(272, errno.EPERM, CLONE_NEWUSER)],  # unshare
                            "uid": [(117, errno.EPERM, None)],  # setresuid
                            "seccomp": [(317, errno.ENOSYS, None)]}),
    "aarch64": (0xC00000B7, {"namespaces": [(97, errno.EPERM, CLONE_NEWUSER)],
                             "uid": [(147, errno.EPERM, None)],
                             "seccomp": [(277, errno.ENOSYS, None)]}),
}
LANDLOCK = [(444, errno.ENOSYS, None), (445, errno.ENOSYS, None), (446, errno.ENOSYS, None)]  # the same number on every arch
SUPPORTED = platform.machine() in ARCHES


def deny(layer: str) -> None:
    """From now on, in this process and its children, `layer`'s syscalls fail ("namespaces", "uid",
    "landlock" or "seccomp")."""
    arch, table = ARCHES[platform.machine()]
    calls = LANDLOCK if layer == "landlock" else table[layer]
    LD_W_ABS, JEQ_K, JSET_K, RET_K = 0x20, 0x15, 0x45, 0x06
    ALLOW, ERRNO = 0x7FFF0000, 0x00050000
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, arch), (RET_K, 0, 0, ALLOW)]  # seccomp_data.arch
    for nr, err, flags in calls:
        prog.append((LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
        if flags is None:
            prog += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, ERRNO | err)]
        else:  # the first argument's low word (seccomp_data.args[0])
            prog += [(JEQ_K, 0, 3, nr), (LD_W_ABS, 0, 0, 16), (JSET_K, 0, 1, flags), (RET_K, 0, 0, ERRNO | err)]
    prog.append((RET_K, 0, 0, ALLOW))
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    fprog = Fprog(len(prog), ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # NO_NEW_PRIVS; SECCOMP filter
        raise OSError(ctypes.get_errno(), "installing the seccomp filter")


def run_without(layer: str, body: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`body` in a fresh Python (this repository importable, logging to stderr) after deny(layer);
    the body may also call deny itself (then pass layer="")."""
    prelude = ("import logging\nlogging.basicConfig(level=logging.INFO)\n"
               "from tests.eval.deny_syscalls import deny\n" + (f"deny({layer!r})\n" if layer else ""))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", prelude + body], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
