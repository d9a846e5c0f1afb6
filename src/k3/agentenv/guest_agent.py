"""The guest agent: runs inside a sandbox with the system Python, standard library only. Its first stdin line
is its configuration (limits, env: secrets never reach a command line); then it reads one JSON request per
line and answers one JSON line on stdout, echoing the request's nonce: exec (with timeout, output cap and
rlimits), background spawn/poll/kill, read/write/list files and tar up/download. Paths resolve inside the
sandbox's own mount namespace, so a symlink can only ever point at something the sandbox already sees; the
files API opens only regular files, without blocking (a FIFO cannot wedge it). The agent makes itself
non-dumpable first, so the commands it starts cannot ptrace it, read its memory or take its descriptors.
`--oneshot` serves a single request and exits (backends that start a process per call)."""
import base64
import errno
import io
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import time

WORKDIR = "/workspace"
CONFIG = {"cpu_seconds": 60, "file_bytes": 64 << 20, "open_files": 256, "output_bytes": 1 << 20,
          "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8"}}
BACKGROUND = {}  # handle -> dict(proc, out, err, done)
MAX_TAR_BYTES = 256 << 20  # the largest tar download (the host caps its answer line to match)
PR_SET_DUMPABLE = 4


def b64(data):
    return base64.b64encode(data).decode("ascii")


def unb64(s):
    return base64.b64decode(s.encode("ascii"), validate=True) if s else b""


def make_undumpable():
    """No ptrace, /proc/<pid>/{mem,fd} or pidfd_getfd on this process for anything without CAP_SYS_PTRACE,
    i.e. for every command it starts (they get their own dumpable flag back at execve)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def command_ids():
    """(uid, gid) the commands run as, when the agent runs as the guest's root (gVisor: commands under another
    uid cannot open its /proc files, signal or trace it); None when both share the sandbox's one uid (bwrap)."""
    uid = CONFIG.get("command_uid")
    return (uid, uid) if uid is not None and os.geteuid() == 0 else None


def give_to_commands(name, dir_fd=None):
    """What the agent creates belongs to the commands' uid (they can edit the files they were given)."""
    ids = command_ids()
    if ids:
        if isinstance(name, int):
            os.fchown(name, *ids)
        else:
            os.chown(name, *ids, dir_fd=dir_fd, follow_symlinks=False)


def make_parents(path):
    missing, d = [], os.path.dirname(path)
    while d and d != "/" and not os.path.lexists(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        give_to_commands(d)


def open_regular(path, flags, mode=0o644):
    """Open `path` only if it is a regular file; non-blocking, so a FIFO or device returns at once."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_entry(name, dir_fd):
    """Remove whatever `name` is in `dir_fd` (file, symlink, FIFO, socket, or a whole directory tree)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def create_fresh(path, mode):
    """A new regular file at `path`, reached without following any symlink: whatever the sandbox put there
    (a symlink to /dev/null, a FIFO, a directory, a symlinked parent) is replaced, never written through."""
    parts = [p for p in path.split("/") if p]
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        for name in parts[:-1]:
            try:
                nfd = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # missing, not a dir, a symlink
                    raise
                remove_entry(name, fd)
                os.mkdir(name, 0o755, dir_fd=fd)
                give_to_commands(name, dir_fd=fd)
                nfd = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = nfd
        remove_entry(parts[-1], fd)
        new = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                      dir_fd=fd)
        give_to_commands(new)
        return new
    finally:
        os.close(fd)


def resolve(path):
    if not isinstance(path, str) or not path:
        raise ValueError("path must be a non-empty string")
    return os.path.normpath(path if path.startswith("/") else os.path.join(WORKDIR, path))


def limit_child():
    """In the child before exec: rlimits, a high OOM score (so the memory killer picks the command, not us)."""
    resource.setrlimit(resource.RLIMIT_CPU, (CONFIG["cpu_seconds"], CONFIG["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (CONFIG["file_bytes"], CONFIG["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (CONFIG["open_files"], CONFIG["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # set by backends whose guest kernel binds them (gVisor: a non-root uid of its own kernel); bwrap's
    # root-mapped user is not bound by RLIMIT_NPROC and relies on the pids/memory cgroups instead
    if CONFIG.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (CONFIG["nproc"], CONFIG["nproc"]))
    if CONFIG.get("address_space_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (CONFIG["address_space_bytes"], CONFIG["address_space_bytes"]))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    ids = command_ids()
    if ids:  # last: dropping from root to another uid also drops every capability
        os.setgroups([])
        os.setresgid(ids[1], ids[1], ids[1])
        os.setresuid(ids[0], ids[0], ids[0])


def start(argv, cwd, env, stdin_bytes):
    full_env = dict(CONFIG["env"])
    full_env.update(env or {})
    return subprocess.Popen(argv, cwd=resolve(cwd), env=full_env, stdin=subprocess.PIPE if stdin_bytes else
                            subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=limit_child, close_fds=True)


def kill_group(proc):
    """SIGKILL the command's process group. The leader is reaped first (a zombie still counts as a member);
    orphans are reaped by the sandbox's pid 1, so the group empties quickly. A fork bomb keeps adding members:
    repeat, bounded."""
    for i in range(50):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=0.5 if i == 0 else 0.01)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.002 * min(i, 5))


def op_exec(req):
    t0 = time.monotonic()
    stdin_bytes = unb64(req.get("stdin"))
    try:
        proc = start(req["argv"], req.get("cwd") or WORKDIR, req.get("env"), stdin_bytes)
    except (OSError, ValueError) as e:
        return {"stdout": "", "stderr": b64(f"exec failed: {e}\n".encode()), "exit_code": 127, "signal": None,
                "timed_out": False, "truncated": False, "duration": time.monotonic() - t0}
    cap = int(req.get("output_bytes") or CONFIG["output_bytes"])
    deadline = t0 + float(req.get("timeout") or 30)
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    pending_in = memoryview(stdin_bytes)
    if stdin_bytes:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    timed_out = truncated = False
    exited_at = None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.2:  # a stray grandchild holds the pipe: stop reading
            break
        for key, _ in sel.select(timeout=min(0.05, deadline - now)):
            fd = key.fd
            if stdin_bytes and fd == proc.stdin.fileno():
                try:
                    n = os.write(fd, pending_in[:65536])
                    pending_in = pending_in[n:]
                except BrokenPipeError:
                    pending_in = pending_in[:0]
                if not len(pending_in):
                    sel.unregister(fd)
                    proc.stdin.close()
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                continue
            bufs[fd] += chunk
            if len(bufs[fd]) > cap:
                truncated = True
        if truncated:
            break
    if not (timed_out or truncated):  # its pipes can close just before it exits: let it exit, not be killed
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)  # also a finished command's leftovers in its group (use spawn for daemons)
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        rc = None
    out, err = bytes(bufs[proc.stdout.fileno()][:cap]), bytes(bufs[proc.stderr.fileno()][:cap])
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f:
            f.close()
    sig = -rc if rc is not None and rc < 0 else None
    return {"stdout": b64(out), "stderr": b64(err), "exit_code": rc if rc is not None and rc >= 0 else None,
            "signal": sig, "timed_out": timed_out, "truncated": truncated, "duration": time.monotonic() - t0}


def op_spawn(req):
    proc = start(req["argv"], req.get("cwd") or WORKDIR, req.get("env"), b"")
    handle = str(proc.pid)
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
    BACKGROUND[handle] = {"proc": proc, "out": bytearray(), "err": bytearray(), "eof": set()}
    return {"handle": handle}


def drain_background():
    cap = CONFIG["output_bytes"]
    for bg in BACKGROUND.values():
        for name, f in (("out", bg["proc"].stdout), ("err", bg["proc"].stderr)):
            if name in bg["eof"]:
                continue
            for _ in range(64):
                try:
                    chunk = os.read(f.fileno(), 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    bg["eof"].add(name)
                    break
                if len(bg[name]) < cap:
                    bg[name] += chunk[:cap - len(bg[name])]


def op_poll(req):
    drain_background()
    bg = BACKGROUND.get(req["handle"])
    if bg is None:
        raise ValueError(f"no background process {req['handle']!r}")
    rc = bg["proc"].poll()
    out, err = bytes(bg["out"]), bytes(bg["err"])
    bg["out"].clear()
    bg["err"].clear()
    if rc is not None and len(bg["eof"]) == 2:
        BACKGROUND.pop(req["handle"])
    return {"stdout": b64(out), "stderr": b64(err), "running": rc is None,
            "exit_code": rc if rc is not None and rc >= 0 else None, "signal": -rc if rc is not None and rc < 0 else None}


def op_kill(req):
    bg = BACKGROUND.get(req["handle"])
    if bg is not None:
        kill_group(bg["proc"])
        bg["proc"].wait(timeout=5)
    return {}


def op_read(req):
    limit = int(req.get("max_bytes") or (64 << 20))
    with os.fdopen(open_regular(resolve(req["path"]), os.O_RDONLY), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"file larger than max_bytes={limit}")
    return {"data": b64(data)}


def op_write(req):
    path = resolve(req["path"])
    data, mode = unb64(req.get("data")), int(req.get("mode") or 0o644) & 0o777
    if req.get("fresh"):
        fd = create_fresh(path, mode)
    else:
        if req.get("parents", True):
            make_parents(path)
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        give_to_commands(fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return {}


def op_list(req):
    path = resolve(req.get("path") or WORKDIR)
    out = []
    with os.scandir(path) as it:
        for e in it:
            st = e.stat(follow_symlinks=False)
            kind = "dir" if e.is_dir(follow_symlinks=False) else "symlink" if e.is_symlink() else "file"
            out.append({"name": e.name, "path": os.path.join(path, e.name), "type": kind, "size": st.st_size,
                        "mode": st.st_mode & 0o7777})
    return {"entries": sorted(out, key=lambda d: d["name"])}


def op_tar_get(req):
    path = resolve(req.get("path") or WORKDIR)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(path, arcname=".")
    if buf.tell() > MAX_TAR_BYTES:
        raise ValueError(f"tar of {path} is larger than {MAX_TAR_BYTES} bytes")
    return {"data": b64(buf.getvalue())}


def op_tar_put(req):
    dest = resolve(req.get("dest") or WORKDIR)
    if not os.path.isdir(dest):
        make_parents(dest + "/x")
    with tarfile.open(fileobj=io.BytesIO(unb64(req.get("data"))), mode="r") as tf:
        members = []
        for m in tf.getmembers():
            name = os.path.normpath(m.name)
            if name.startswith(("/", "..")) or not (m.isfile() or m.isdir() or m.issym()):
                raise ValueError(f"refused tar member {m.name!r} (absolute, '..' or special file)")
            m.mode &= 0o777  # no setuid bits from outside
            members.append(m)
            target = os.path.join(dest, name)
            if not m.isdir() and os.path.lexists(target) and not os.path.isdir(target):
                os.unlink(target)  # a FIFO or symlink named like a member is replaced, not opened
        tf.extractall(dest, members=members)
        for m in members:  # not the owners named in the archive
            give_to_commands(os.path.join(dest, os.path.normpath(m.name)))
    return {}


OPS = {"exec": op_exec, "spawn": op_spawn, "poll": op_poll, "kill": op_kill, "read": op_read, "write": op_write,
       "list": op_list, "tar_get": op_tar_get, "tar_put": op_tar_put, "ping": lambda req: {"pid": os.getpid()}}


def handle(line):
    req = {}
    try:
        req = json.loads(line)
        res = OPS[req["op"]](req)
        res["ok"] = True
    except Exception as e:  # every failure goes back to the host as an answer, never kills the agent
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    # the host drops answers without its current nonce (late ones to calls it gave up on)
    res["nonce"] = req.get("nonce") if isinstance(req, dict) else None
    return json.dumps(res) + "\n"


def deny_namespaces():
    """Install a seccomp filter (inherited by every command this agent starts, and irremovable) so that no
    process can make or join a user namespace: unshare/clone with CLONE_NEWUSER and setns fail with EPERM,
    clone3 with ENOSYS (a filter cannot read its flags; libc then falls back to clone). For sandboxes whose
    kernel allows unprivileged user namespaces (gVisor) and whose exec'd processes miss the OCI filter."""
    import ctypes
    import struct
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, errno = 0x7FFF0000, 0x0, 0x00050000
    nr_clone, nr_unshare, nr_setns, nr_clone3 = 56, 272, 308, 435  # x86_64
    prog = [(ld_abs, 0, 0, 4),                   # 0  arch
            (jeq, 0, 12, 0xC000003E),            # 1  not x86_64 → kill (14)
            (ld_abs, 0, 0, 0),                   # 2  syscall number
            (jge, 10, 0, 0x40000000),            # 3  x32 ABI → kill (14)
            (jeq, 4, 0, nr_unshare),             # 4  → flags (9)
            (jeq, 3, 0, nr_clone),               # 5  → flags (9)
            (jeq, 5, 0, nr_setns),               # 6  → EPERM (12)
            (jeq, 5, 0, nr_clone3),              # 7  → ENOSYS (13)
            (ret, 0, 0, allow),                  # 8
            (ld_abs, 0, 0, 16),                  # 9  low word of args[0]: the flags
            (jset, 1, 0, 0x10000000),            # 10 CLONE_NEWUSER → EPERM (12)
            (ret, 0, 0, allow),                  # 11
            (ret, 0, 0, errno | 1),              # 12 EPERM
            (ret, 0, 0, errno | 38),             # 13 ENOSYS
            (ret, 0, 0, kill)]                   # 14
    code = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    if libc.prctl(38, 1, None, 0, 0) != 0 or libc.prctl(22, 2, ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p),
                                                        0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP filter
        raise OSError(ctypes.get_errno(), "cannot install the namespace seccomp filter")


def main():
    make_undumpable()  # before anything else: fail closed (the agent exits) if it cannot
    if "--connect" in sys.argv:  # the host's one-time socket: a channel no other process in the box holds
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sys.argv[sys.argv.index("--connect") + 1])
        inp, out = conn.makefile("rb"), conn.makefile("w", encoding="utf-8")
    else:
        inp, out = sys.stdin.buffer, sys.stdout
    CONFIG.update(json.loads(inp.readline()))
    if CONFIG.get("deny_namespaces"):
        deny_namespaces()  # before any request: fail closed (the agent exits) if it cannot be installed
    if "--oneshot" in sys.argv:
        out.write(handle(inp.readline()))
        out.flush()
        return
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    while True:
        line = inp.readline()
        if not line:
            return
        out.write(handle(line))
        out.flush()
        drain_background()


if __name__ == "__main__":
    main()
