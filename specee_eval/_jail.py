"""The sandbox's child side: locks this process down, then runs the untrusted program.

Started by specee_eval.sandbox as `python -I -S _jail.py WORKDIR LIMITS_JSON` with WORKDIR as its
working directory. Runs with the standard library only, single-threaded, before any untrusted
code, in this order (each layer holds on its own; a layer this kernel lacks is reported, not faked):

1. resource limits: address space, CPU seconds, file size, open files, no core files;
2. a new user and network namespace: no network interface but a downed loopback;
3. Landlock (Linux >= 5.13): no file writes, creation, removal or execution outside WORKDIR;
   TCP bind/connect denied (ABI >= 4); signals and abstract sockets scoped to the sandbox (ABI >= 6);
4. a Python audit hook: no subprocess, exec, fork, ctypes, sockets, signals to other processes,
   or file changes outside WORKDIR.

The layers applied go to WORKDIR/_guards.json. The program passes when it returns; then the jail
writes the nonce it was given to WORKDIR/_result, so an early exit(0) or os._exit(0) is a failure.
"""
import ctypes
import json
import os
import resource
import sys

WORKDIR, LIMITS = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2])
NONCE = os.environ.pop("SPECEE_SANDBOX_NONCE", "")
GUARDS = {}


def set_limits():
    mem = LIMITS["memory_mb"] << 20
    cpu = LIMITS["cpu_s"]
    for name, value in (("RLIMIT_AS", mem), ("RLIMIT_CPU", cpu), ("RLIMIT_FSIZE", LIMITS["file_bytes"]),
                        ("RLIMIT_NOFILE", LIMITS["open_files"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    GUARDS["rlimits"] = True


def no_network(libc):
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    GUARDS["netns"] = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0


# Landlock (include/uapi/linux/landlock.h)
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_CHANGES = sum(1 << b for b in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(libc):
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        GUARDS["landlock"] = 0
        return
    handled = FS_EXECUTE | FS_WRITE_FILE | FS_CHANGES | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    attr = RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                       SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    # WORKDIR: every handled right but execution; /dev/null: writable (file rules take file rights only)
    for path, allowed in ((WORKDIR, handled & ~FS_EXECUTE), ("/dev/null", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneathAttr(allowed, fd)
        if libc.syscall(SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    GUARDS["landlock"] = abi


DENIED = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
          "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "os.kill",
          "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect", "socket.bind",
          "socket.getaddrinfo", "resource.setrlimit", "resource.prlimit", "sys.setprofile", "sys.settrace",
          "os.chroot", "os.setuid", "webbrowser.open"}
PATH_CHANGES = {"os.remove": 1, "os.rmdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "os.mkdir": 1,
                "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "shutil.copyfile": 2, "shutil.move": 2, "os.mknod": 1}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def inside(path) -> bool:
    if isinstance(path, int):  # an already open descriptor
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == WORKDIR or real.startswith(WORKDIR + os.sep) or real == "/dev/null"


def audit(event, args):
    if event in DENIED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & WRITE_FLAGS)
        if writes and path is not None and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in PATH_CHANGES:
        for path in args[: PATH_CHANGES[event]]:
            if path is not None and not inside(path):
                raise PermissionError(f"sandbox: {event} on {path!r} outside the sandbox directory")


def main():
    set_limits()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    no_network(libc)
    landlock(libc)
    if LIMITS.get("audit_hook", True):
        sys.addaudithook(audit)
    GUARDS["audit_hook"] = LIMITS.get("audit_hook", True)
    with open(os.path.join(WORKDIR, "_guards.json"), "w") as f:
        json.dump(GUARDS, f)
    with open(os.path.join(WORKDIR, "program.py")) as f:
        code = compile(f.read(), "program.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    with open(os.path.join(WORKDIR, "_result"), "w") as f:
        f.write(NONCE)


if __name__ == "__main__":
    main()
