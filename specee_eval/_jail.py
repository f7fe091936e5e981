"""The sandbox's child side: locks itself down, then runs the untrusted program.

Started by specee_eval.sandbox as `python -s -S -B [-P] _jail.py WORKDIR LIMITS_JSON STATUS_FD`, the
nonce on stdin. Standard library only, single-threaded, before any untrusted code runs:

1. the nonce is read from stdin (never in the environment), the program's source is read;
2. root becomes a uid of the program's own (random, high, no account's), and WORKDIR (0700) its
   own. Where this Python or WORKDIR lies under a directory others may not enter (/root is 0700),
   a mount namespace of the jail's own covers that directory with a tmpfs holding only the way to
   them, bind-mounted back at their own paths, so the uid can read them and nothing else there.
   Where that fails the uid stays root, and says why;
3. resource limits: address space, CPU seconds, file size, open files, no cores;
4. new user, network, mount and PID namespaces: no network interface but a downed loopback; a
   size-capped tmpfs over WORKDIR (the program's files live and die in it); the program runs as
   PID 1 of its namespace, so every process it starts dies with it (and it dies with this jail);
5. a process limit (RLIMIT_NPROC) where it counts the program's processes alone: under a uid of
   its own, or in a user namespace of its own (Linux >= 5.14 counts per namespace). With the
   address-space limit it bounds the whole program's memory: processes x memory;
6. Landlock (Linux >= 5.13): no reads outside WORKDIR, the Python installation, the system's
   shared libraries, /dev/null, /dev/urandom and /proc/self; no writes, creation, removal or
   execution outside WORKDIR; TCP bind/connect denied (ABI >= 4); signals and abstract sockets
   scoped to the sandbox (ABI >= 6);
7. seccomp: no socket of any family (socket, socketpair and io_uring, which opens sockets
   without socket(), fail with EACCES), no syscall of another ABI;
8. a Python audit hook (state in a closure, the program in a fresh __main__): no subprocess, exec,
   fork, ctypes, sockets, signals, gc introspection, or file changes outside WORKDIR.

What holds is reported on STATUS_FD as the first line (JSON), before the program starts. The
program passes when it runs to its end: then the jail writes "passed <nonce>" there. A layer that
cannot be set up is reported with the reason in place of what it would hold (a string); when it is
among LIMITS_JSON's "require", the jail adds "refused": [layers] to that line and exits with
REFUSED before the program runs. LIMITS_JSON's "leave_out" names layers not to set up at all
(tests use it to show what the others hold on their own).
"""
import ctypes
import errno
import json
import os
import random
import re
import resource
import signal
import struct
import sys

REFUSED = 3  # exit status: a required layer could not be set up, the program never ran
OWN_IDS = (1 << 30, 1 << 31)  # the uids a program's own is drawn from, far above accounts and subordinate ranges
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 1 << 12, 1 << 14, 1 << 18


def errno_name() -> str:
    code = ctypes.get_errno()
    return errno.errorcode.get(code, str(code))


def world_readable(path) -> bool:
    """path and every directory above it can be read and entered by any user."""
    path = os.path.realpath(path)
    while True:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def ancestors(path) -> list[str]:
    """The directories above path, from / down."""
    out = []
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def mapped_ids(kind) -> list[tuple[int, int]]:
    """The id ranges [lo, hi) this user namespace maps (/proc/self/uid_map or gid_map)."""
    with open(f"/proc/self/{kind}_map") as f:
        return [(int(lo), int(lo) + int(n)) for lo, _, n in (line.split() for line in f)]


def own_id() -> int | str:
    """A uid (the same number as gid) for this program alone: drawn from OWN_IDS where this user
    namespace maps it (a host's does), else from the ids above 1000 it maps (a container's), and
    never an account's or nobody's. A string (why not) when there is none."""
    import pwd

    uids, gids = mapped_ids("uid"), mapped_ids("gid")
    both = [(max(a, c), min(b, d)) for a, b in uids for c, d in gids if max(a, c) < min(b, d)]
    rng = random.SystemRandom()
    for floor, ceil in (OWN_IDS, (1001, 65534)):
        ranges = [(max(lo, floor), min(hi, ceil)) for lo, hi in both if max(lo, floor) < min(hi, ceil)]
        for _ in range(20 if ranges else 0):
            lo, hi = rng.choices(ranges, weights=[hi - lo for lo, hi in ranges])[0]
            uid = rng.randrange(lo, hi)
            try:
                pwd.getpwuid(uid)
            except KeyError:
                return uid
    return f"no unused id mapped in both uid_map and gid_map ({uids}, {gids})"


def first_closed(path) -> str | None:
    """The topmost directory above path that others may not enter, if any."""
    return next((a for a in ancestors(path) if not os.stat(a).st_mode & 0o001), None)


def expose(libc, paths) -> list[str] | str:
    """Makes `paths` reachable by any uid without changing a host file: in a mount namespace of this
    process's own, each topmost directory above them that others may not enter is covered by a
    tmpfs (0755) holding only the way to them, each bind-mounted back at its own path. Returns the
    covered directories, or a string (why not)."""
    paths = [p for p in paths if not any(p.startswith(q + "/") for q in paths)]
    tops = sorted({first_closed(p) for p in paths} - {None})
    if not tops:
        return []
    if libc.unshare(CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS) failed: {errno_name()}"
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    for top in tops:
        inner = [p for p in paths if p.startswith(top.rstrip("/") + "/")]
        fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in inner]  # reached now, through the directory about to be covered
        if libc.mount(b"sandbox-root", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=64k,nr_inodes=1024") != 0:
            return f"mounting a tmpfs over {top} failed: {errno_name()}"
        for p, fd in zip(inner, fds):
            for d in ancestors(p)[len(ancestors(top)) + 1:] + ([p] if os.path.isdir(f"/proc/self/fd/{fd}") else []):
                if not os.path.isdir(d):
                    os.mkdir(d)
                    os.chmod(d, 0o755)
            if not os.path.isdir(f"/proc/self/fd/{fd}"):
                os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
            ok = libc.mount(f"/proc/self/fd/{fd}".encode(), p.encode(), None, MS_BIND | MS_REC, None) == 0
            os.close(fd)
            if not ok:
                return f"bind-mounting {p} back failed: {errno_name()}"
    return tops


def python_paths() -> list[str]:
    """This Python's installation: prefixes, the standard library, the interpreter's directory."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path,
             os.path.dirname(os.path.realpath(sys.executable))]
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def drop_root(libc, workdir, guards) -> bool:
    """Root becomes a uid of the program's own, WORKDIR (0700) its own; True when it did. Otherwise
    guards["uid"] says why and the uid stays root. A caller that is not root keeps its uid."""
    if os.geteuid() != 0:
        guards["uid"] = os.geteuid()
        return False
    uid = own_id()
    if isinstance(uid, str):
        guards["uid"] = uid
        return False
    exposed = expose(libc, python_paths() + [workdir])
    if isinstance(exposed, str):
        guards["uid"] = f"this Python or the work folder lies where others may not enter, and {exposed}"
        return False
    stdlib = os.path.dirname(os.__file__)
    closed = [p for p in (stdlib, os.path.join(stdlib, "lib-dynload"), sys.executable)
              if os.path.exists(p) and not world_readable(p)] + [d for d in [first_closed(workdir)] if d]
    if closed:
        guards["uid"] = f"closed to others even so: {closed}"
        return False
    try:
        for path in (workdir, os.path.join(workdir, "program.py")):
            os.chown(path, uid, uid)
        os.chmod(workdir, 0o700)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        guards["uid"] = f"changing to uid {uid} failed: {errno.errorcode.get(e.errno, e.errno)}"
        return False
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: the uid change made /proc/self root's; the maps need it ours
    guards["uid"], guards["exposed"] = uid, exposed
    return True


def set_limits(limits, guards):
    cpu = limits["cpu_s"]
    values = {"RLIMIT_AS": (limits["memory_mb"] << 20,) * 2, "RLIMIT_CPU": (cpu, cpu + 1),
              "RLIMIT_FSIZE": (limits["file_bytes"],) * 2, "RLIMIT_NOFILE": (limits["open_files"],) * 2,
              "RLIMIT_CORE": (0, 0)}
    for name, value in values.items():
        resource.setrlimit(getattr(resource, name), value)
    guards["rlimits"] = sorted(values)


def limit_processes(limits, guards, own_uid, own_userns):
    """RLIMIT_NPROC, where the kernel counts the program's processes (threads included) alone: under
    a uid of its own, or in a user namespace of its own on Linux >= 5.14, which counts per namespace.
    Root is never held to it, and a uid shared with other processes would count theirs too."""
    if "processes" in limits["leave_out"]:
        guards["processes"] = "left out (Limits.leave_out)"
        return
    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    per_namespace = bool(version) and (int(version[1]), int(version[2])) >= (5, 14)
    if os.getuid() == 0:
        guards["processes"] = "the program runs as root, which RLIMIT_NPROC does not hold"
    elif not (own_uid or (own_userns and per_namespace)):
        guards["processes"] = f"uid {os.getuid()} is shared and this kernel counts processes per uid only in a user namespace of its own (Linux >= 5.14)"
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
        guards["processes"] = limits["processes"]


def write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def isolate(libc, workdir, limits, guards):
    """New user, network, mount and PID namespaces; a tmpfs over workdir. True when the PID
    namespace holds (the caller must fork: its child is the namespace's init)."""
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
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    opts = f"size={limits['disk_kb']}k,nr_inodes={limits['files']},mode=0700".encode()
    guards["tmpfs"] = libc.mount(b"sandbox", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0
    return True


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


# seccomp (include/uapi/linux/seccomp.h, filter.h). machine: (AUDIT_ARCH_*, {syscall: number}) for the
# syscalls that make a socket; io_uring can open one (IORING_OP_SOCKET) without socket()
SOCKET_CALLS = {"x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "io_uring_setup": 425}),
                "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "io_uring_setup": 425})}
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
X32_BIT = 0x40000000  # x86_64's second ABI: the same arch field, its syscall numbers above this


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def socket_filter(arch, numbers) -> bytes:
    """A classic BPF program: `numbers` fail with EACCES, as does every syscall of another ABI."""
    LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
    ALLOW, DENY = 0x7FFF0000, 0x00050000 | errno.EACCES  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, arch), (RET_K, 0, 0, DENY),  # seccomp_data.arch
            (LD_W_ABS, 0, 0, 0), (JGE_K, 0, 1, X32_BIT), (RET_K, 0, 0, DENY)]  # seccomp_data.nr
    for nr in numbers:
        prog += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, DENY)]
    prog.append((RET_K, 0, 0, ALLOW))
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def seccomp(libc, limits, guards):
    """No socket of any family from here on, in this process and every one it starts.
    guards["seccomp"]: the syscalls denied when it holds, else why not."""
    machine = os.uname().machine
    if "seccomp" in limits["leave_out"]:
        guards["seccomp"] = "left out (Limits.leave_out)"
        return
    if machine not in SOCKET_CALLS:
        guards["seccomp"] = f"no syscall numbers known for {machine}"
        return
    arch, calls = SOCKET_CALLS[machine]
    code = socket_filter(arch, calls.values())
    buf = ctypes.create_string_buffer(code, len(code))
    prog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: what lets an unprivileged process install a filter
        guards["seccomp"] = f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno_name()}"
        return
    if libc.syscall(SYS_SECCOMP[machine], 1, 0, ctypes.byref(prog)) != 0:  # SECCOMP_SET_MODE_FILTER
        guards["seccomp"] = f"seccomp(SECCOMP_SET_MODE_FILTER) failed: {errno_name()}"
        return
    guards["seccomp"] = sorted(calls)


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


# a layer holds when its guard has this type, else the guard holds the reason
HELD = {"uid": int, "processes": int, "namespaces": list, "landlock": int, "seccomp": list}


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
    required = limits["require"]
    own_uid = drop_root(libc, workdir, guards)
    refuse_if_missing(guards, required, status, ["uid"])
    set_limits(limits, guards)
    held = isolate(libc, workdir, limits, guards)
    limit_processes(limits, guards, own_uid, held)
    refuse_if_missing(guards, required, status, ["namespaces", "processes"])
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
    seccomp(libc, limits, guards)
    refuse_if_missing(guards, required, status, ["seccomp"])
    hook = "audit_hook" not in limits["leave_out"]
    if hook:
        sys.addaudithook(audit_hook(workdir))
    guards["audit_hook"] = hook
    os.write(status, (json.dumps(guards) + "\n").encode())
    del libc
    run_program(source, status, nonce)


if __name__ == "__main__":
    jail()
