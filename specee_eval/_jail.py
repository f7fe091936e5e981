"""The sandbox's child side: locks itself down, then runs the untrusted program.

Started by specee_eval.sandbox as `python -s -S -B [-P] _jail.py WORKDIR LIMITS_JSON STATUS_FD`, the
nonce on stdin. Standard library only, single-threaded, before any untrusted code runs:

1. the nonce is read from stdin (never in the environment), the program's source is read;
2. root drops to nobody (65534): host files keep their owners' permissions;
3. resource limits: address space, CPU seconds, file size, processes (as nobody), open files, no cores;
4. new user, network, mount and PID namespaces: no network interface but a downed loopback; a
   size-capped tmpfs over WORKDIR (the program's files live and die in it); the program runs as
   PID 1 of its namespace, so every process it starts dies with it (and it dies with this jail);
5. Landlock (Linux >= 5.13): no reads outside WORKDIR, the Python installation, the system's
   shared libraries, /dev/null, /dev/urandom and /proc/self; no writes, creation, removal or
   execution outside WORKDIR; TCP bind/connect denied (ABI >= 4); signals and abstract sockets
   scoped to the sandbox (ABI >= 6);
6. a Python audit hook (state in a closure, the program in a fresh __main__): no subprocess, exec,
   fork, ctypes, sockets, signals, gc introspection, or file changes outside WORKDIR.

What holds is reported on STATUS_FD as the first line (JSON), before the program starts. The
program passes when it runs to its end: then the jail writes "passed <nonce>" there. A layer the
kernel refuses is reported with the reason in place of what it would hold (a string); when it is
among LIMITS_JSON's "require", the jail adds "refused": [layers] to that line and exits with
REFUSED before the program runs.
"""
import ctypes
import errno
import json
import os
import resource
import signal
import sys

NOBODY = 65534
REFUSED = 3  # exit status: a required layer could not be set up, the program never ran


def world_readable(path) -> bool:
    """path and every directory above it can be read and entered by any user."""
    path = os.path.realpath(path)
    while True:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def drop_root(libc, guards):
    """Root becomes nobody when nobody can still run this Python (its standard library readable
    by others); otherwise the uid stays, and says so."""
    if os.geteuid() != 0:
        guards["uid"] = os.geteuid()
        return
    stdlib = os.path.dirname(os.__file__)
    if not (world_readable(stdlib) and world_readable(os.path.join(stdlib, "lib-dynload"))
            and world_readable(sys.executable)):
        guards["uid"] = "0: this Python's files are not readable by nobody"
        return
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: the uid change made /proc/self root's; the maps need it ours
    guards["uid"] = NOBODY


def set_limits(limits, guards):
    cpu = limits["cpu_s"]
    values = {"RLIMIT_AS": (limits["memory_mb"] << 20,) * 2, "RLIMIT_CPU": (cpu, cpu + 1),
              "RLIMIT_FSIZE": (limits["file_bytes"],) * 2, "RLIMIT_NOFILE": (limits["open_files"],) * 2,
              "RLIMIT_CORE": (0, 0)}
    if guards["uid"] == NOBODY:  # per user: only meaningful for a user of the sandbox's own
        values["RLIMIT_NPROC"] = (limits["processes"],) * 2
    for name, value in values.items():
        resource.setrlimit(getattr(resource, name), value)
    guards["rlimits"] = sorted(values)


def write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def isolate(libc, workdir, limits, guards):
    """New user, network, mount and PID namespaces; a tmpfs over workdir. True when the PID
    namespace holds (the caller must fork: its child is the namespace's init)."""
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID) != 0:
        guards["namespaces"] = f"unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS|CLONE_NEWPID) failed: {errno_name()}"
        return False
    try:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as e:
        guards["namespaces"] = f"writing the user namespace's id maps failed: {errno.errorcode.get(e.errno, e.errno)}"
        return False
    guards["namespaces"] = ["user", "net", "mount", "pid"]
    MS_NOSUID, MS_NODEV, MS_PRIVATE, MS_REC = 2, 4, 1 << 18, 1 << 14
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    opts = f"size={limits['disk_kb']}k,nr_inodes={limits['files']},mode=0700".encode()
    guards["tmpfs"] = libc.mount(b"sandbox", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0
    return True


def errno_name() -> str:
    code = ctypes.get_errno()
    return errno.errorcode.get(code, str(code))


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


# Read-only beyond the Python installation: the shared libraries extension modules load (hashlib's
# libcrypto), the loader's cache, time zones, the random device and the process's own /proc entry
SYSTEM_READ = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache",
               "/usr/share/zoneinfo", "/dev/urandom", "/proc/self")


def readable_roots() -> list[str]:
    """The trees the program may read besides its directory: this Python (prefixes, sys.path) and SYSTEM_READ."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, *SYSTEM_READ]
    # /proc/self stays a name: resolved, it would be this process's number
    return sorted({p if p.startswith("/proc/") else os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def landlock(libc, workdir, guards):
    """Reads confined to workdir and readable_roots(); writes, creation, removal and execution to
    workdir (execution nowhere). guards["landlock"]: the ABI when it holds, else why not."""
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:  # ENOSYS: not built in; EOPNOTSUPP: not enabled at boot (lsm=)
        guards["landlock"] = f"landlock_create_ruleset failed: {errno_name()}"
        return
    handled = (FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_READ_DIR | FS_CHANGES | (FS_REFER if abi >= 2 else 0)
               | (FS_TRUNCATE if abi >= 3 else 0))
    attr = RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                       SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        guards["landlock"] = f"landlock_create_ruleset (ABI {abi}) failed: {errno_name()}"
        return
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)  # all a file rule takes
    roots = readable_roots()
    rules = [(workdir, handled & ~FS_EXECUTE), ("/dev/null", FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))]
    rules += [(root, FS_READ_FILE | FS_READ_DIR) for root in roots]
    for path, allowed in rules:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if not os.path.isdir(path):
            allowed &= file_rights
        rule = PathBeneathAttr(allowed, fd)
        ok = libc.syscall(SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) == 0  # LANDLOCK_RULE_PATH_BENEATH
        os.close(fd)
        if not ok:
            guards["landlock"] = f"landlock_add_rule({path}) failed: {errno_name()}"
            return
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        guards["landlock"] = f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno_name()}"
        return
    if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
        guards["landlock"] = f"landlock_restrict_self failed: {errno_name()}"
        return
    os.close(ruleset)
    guards["landlock"], guards["readable"] = abi, roots


def audit_hook(workdir):
    """The hook, its state held in its closure (nothing the program can reach by name)."""
    denied = frozenset({
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
        "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "os.kill",
        "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect", "socket.bind",
        "socket.getaddrinfo", "resource.setrlimit", "resource.prlimit", "sys.setprofile", "sys.settrace",
        "os.chroot", "os.setuid", "webbrowser.open", "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.setxattr",
        "os.removexattr", "sys.addaudithook", "cpython.PyInterpreterState_Clear"})
    path_args = {"os.remove": 1, "os.rmdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "os.mkdir": 1,
                 "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                 "shutil.copyfile": 2, "shutil.move": 2, "os.mknod": 1}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fsdecode, sep, is_int, is_str = os.path.realpath, os.fsdecode, os.sep, int, str
    fd_path = "/proc/self/fd/{}".format
    readlink = os.readlink

    def inside(path) -> bool:
        if isinstance(path, is_int):  # a descriptor: where it points
            try:
                path = readlink(fd_path(path))
            except OSError:
                return False
        real = realpath(fsdecode(path))
        return real == workdir or real.startswith(workdir + sep) or real == "/dev/null"

    def hook(event, args):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, is_str) and any(c in mode for c in "wax+")) or (flags & write_flags)
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
        elif event in path_args:
            if len(args) > path_args[event] and event in ("os.chmod", "os.chown", "os.utime") and args[-1] not in (None, -100):
                raise PermissionError(f"sandbox: {event} through a descriptor is not allowed")  # -100: AT_FDCWD
            for path in args[: path_args[event]]:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the sandbox directory")

    return hook


HELD = {"namespaces": list, "landlock": int}  # a layer holds when its guard has this type, else it holds the reason


def refuse_if_missing(guards, required, status, layers):
    """Stops before the program runs when one of `layers` is required and did not hold."""
    missing = [l for l in layers if l in required and not isinstance(guards.get(l), HELD[l])]
    if missing:
        guards["refused"] = missing
        os.write(status, (json.dumps(guards) + "\n").encode())
        os._exit(REFUSED)


def run_program(source, status, nonce):
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main  # this jail's module is no longer reachable by name
    exec(compile(source, "program.py", "exec"), main.__dict__)
    os.write(status, f"passed {nonce}\n".encode())


def jail():
    workdir, limits, status = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    nonce = sys.stdin.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with open(os.path.join(workdir, "program.py")) as f:
        source = f.read()
    guards = {}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    required = limits.get("require", list(HELD))
    drop_root(libc, guards)
    set_limits(limits, guards)
    held = isolate(libc, workdir, limits, guards)
    refuse_if_missing(guards, required, status, ["namespaces"])
    if held:
        pid = os.fork()
        if pid:  # outside the PID namespace: wait for its init, leave as it left
            os.close(status)
            _, st = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(st)
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the jail (killed at the timeout)
    os.chdir(workdir)  # the tmpfs mounted over it, when there is one
    landlock(libc, workdir, guards)
    refuse_if_missing(guards, required, status, ["landlock"])
    if limits.get("audit_hook", True):
        sys.addaudithook(audit_hook(workdir))
    guards["audit_hook"] = limits.get("audit_hook", True)
    os.write(status, (json.dumps(guards) + "\n").encode())
    del libc
    run_program(source, status, nonce)


if __name__ == "__main__":
    jail()
