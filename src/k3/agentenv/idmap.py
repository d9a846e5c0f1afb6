"""Host uids of its own for every sandbox (one for its guest agent, one for the commands it runs), so no two
sandboxes share a per-uid kernel quota (inotify instances, keyrings) and no command can signal, trace or read
the agent. Uids are leased from a range by lock files naming their owning process (a dead owner's lease is
taken back); the sandbox's user namespace maps exactly those two; the shared read-only layers, owned on disk
by `hostfs.SANDBOX_UID`, reach each sandbox through idmapped bind mounts that show them as the commands'."""
from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import struct
import subprocess
import time
from pathlib import Path

from k3.agentenv import hostfs

UID_BASE = int(os.environ.get("K3_AGENTENV_UID_BASE", str(0x70000000)))  # a range no login or container uses
UID_COUNT = int(os.environ.get("K3_AGENTENV_UID_COUNT", "65536"))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # x86_64 and aarch64 alike
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_EMPTY_PATH, _AT_FDCWD = 1, 0o2000000, 0x1000, -100
_MOVE_MOUNT_F_EMPTY_PATH, _MOUNT_ATTR_IDMAP = 4, 0x100000


def in_range(uid: int) -> bool:
    return UID_BASE <= uid < UID_BASE + UID_COUNT


def live_processes() -> list[tuple[int, int, str]]:
    """(pid, real uid, /proc status text) of every process but zombies (a zombie holds nothing; its parent,
    init for bwrap's, reaps it)."""
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            status = (p / "status").read_text()
            uid = int(status.split("\nUid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if "\nState:\tZ" not in status:
            out.append((int(p.name), uid, status))
    return out


def processes_of(uids: set[int] | list[int]) -> list[int]:
    """Pids of the live processes (zombies aside) whose real uid is one of `uids`."""
    uids = set(uids)
    return [pid for pid, uid, _ in live_processes() if uid in uids]


def end_processes_of(uids: list[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of the leased `uids` until none is left (or `timeout`); the pids still there.
    A sandbox's cgroup holds all it starts, but its uids are its own: whatever runs as them, inside the cgroup
    or not (the cgroup already gone, a process still exiting), is the sandbox's and ends with it."""
    deadline = time.monotonic() + timeout
    while True:
        pids = processes_of(uids)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def lease_uid(root: Path, holder: str) -> int:
    """A host uid no live sandbox holds and no process runs as, leased to `holder` until `release_uids`."""
    leases = root / "uids"
    leases.mkdir(mode=0o700, exist_ok=True)
    record = json.dumps({"pid": os.getpid(), "start": hostfs.proc_start_time(os.getpid()), "holder": holder})
    busy = {uid for _, uid, _ in live_processes()}  # e.g. a released uid whose process has not ended yet
    for _ in range(200):
        uid = UID_BASE + random.randrange(UID_COUNT)
        path = leases / str(uid)
        if uid in busy:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if hostfs.owner_alive_record(path):
                continue
            path.unlink(missing_ok=True)  # its owner died: take it back (a racing taker loses the O_EXCL)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(record)
        return uid
    raise OSError(f"no free sandbox uid in [{UID_BASE}, {UID_BASE + UID_COUNT})")


def release_uids(root: Path, uids: list[int]) -> None:
    """End whatever still runs as a sandbox's `uids`, then give them back (a uid some process would not leave
    is still never leased again while that process lives: `lease_uid` skips it)."""
    end_processes_of(uids)
    for uid in uids:
        (root / "uids" / str(uid)).unlink(missing_ok=True)


def leases_of(root: Path, pid: int) -> list[int]:
    out = []
    for p in sorted((root / "uids").glob("*")):
        try:
            if json.loads(p.read_text())["pid"] == pid:
                out.append(int(p.name))
        except (OSError, ValueError, KeyError):
            pass
    return out


def userns_mapping(inner: int, outer: int) -> int:
    """An fd of a fresh user namespace whose only uid and gid mapping is `inner` -> `outer`."""
    return user_namespace([(inner, outer)])


def user_namespace(mappings: list[tuple[int, int]], owner: int | None = None) -> int:
    """An fd of a fresh user namespace mapping each (inner, outer) uid and gid, created by `owner` (a host
    uid, which then holds every capability inside it and can join it) or by root."""
    drop = ["setpriv", f"--reuid={owner}", f"--regid={owner}", "--clear-groups"] if owner is not None else []
    holder = subprocess.Popen([*drop, "unshare", "--user", "--", "sleep", "30"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        mine, deadline = os.readlink("/proc/self/ns/user"), time.monotonic() + 10
        while True:  # setpriv execs unshare in place: the same pid, in its own namespace once unshared
            try:
                if os.readlink(f"/proc/{holder.pid}/ns/user") != mine:
                    break
            except OSError:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"unshare --user failed: {holder.stderr.read().decode(errors='replace')[-200:]}")
            time.sleep(0.001)
        text = "".join(f"{inner} {outer} 1\n" for inner, outer in mappings)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as f:
                f.write(text)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()
        holder.stderr.close()


def idmapped_bind(source: str | Path, target: str | Path, userns_fd: int) -> None:
    """Bind `source` read-only-in-effect at `target` with owners translated through `userns_fd`."""
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, str(source).encode(), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"open_tree {source}: {os.strerror(e)}")
    try:
        attr = struct.pack("QQQQ", _MOUNT_ATTR_IDMAP | 0x1 | 0x2 | 0x4, 0, 0, userns_fd)  # + ro, nosuid, nodev
        if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, attr, len(attr)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"idmapped mount of {source} (kernel >= 5.12 and a filesystem that allows it): "
                             f"{os.strerror(e)}")
        if _libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, str(target).encode(), _MOVE_MOUNT_F_EMPTY_PATH) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"move_mount to {target}: {os.strerror(e)}")
    finally:
        os.close(fd)
