"""Host-side filesystem plumbing shared by the backends: the state directory, sealed (read-only, shared)
template layers with git history and set-id bits stripped, reference-counted so a layer goes with its last
user, sized tmpfs disks and overlay mounts (nosuid, nodev), owner records and sweeping."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

# owner on disk of the shared layers (and gVisor's in-guest uid); each bwrap sandbox runs as a host uid of its
# own that sees them as its files (idmap.py)
SANDBOX_UID = int(os.environ.get("K3_AGENTENV_UID", "61000"))
INSIDE_UID = 1000  # what the sandbox sees
MNT_DETACH = 2
MS_NOSUID, MS_NODEV = 2, 4
SANDBOX_MOUNT_FLAGS = MS_NOSUID | MS_NODEV  # a set-id file a sandbox leaves is inert through its host path
_libc = ctypes.CDLL(None, use_errno=True)


def state_root() -> Path:
    return Path(os.environ.get("K3_AGENTENV_ROOT", "/var/tmp/k3-agentenv"))


def mount(source: str, target: str | Path, fstype: str, options: str = "", flags: int = 0) -> None:
    r = _libc.mount(source.encode(), str(target).encode(), fstype.encode(), ctypes.c_ulong(flags),
                    options.encode() if options else None)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount -t {fstype} {source} {target} ({options}): {os.strerror(e)}")


def umount(target: str | Path) -> None:
    _libc.umount2(str(target).encode(), MNT_DETACH)


def is_mounted(target: str | Path) -> bool:
    t = os.path.realpath(target)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == t for line in f)


def mounts_under(root: str | Path) -> list[str]:
    r = os.path.realpath(root) + "/"
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(r)]


def ensure_state(root: Path | None = None) -> Path:
    """The state root with etc/ (a minimal passwd/group/hosts), layers/, sb/ and the guest agent."""
    root = root or state_root()
    for sub in ("layers", "sb", "etc", "agent"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711)
    for sub in ("layers", "sb", "agent"):
        os.chmod(root / sub, 0o711 if sub != "agent" else 0o755)
    etc = root / "etc"
    files = {"passwd": f"root:x:0:0:root:/root:/bin/sh\nuser:x:{INSIDE_UID}:{INSIDE_UID}:user:/workspace:/bin/sh\n",
             "group": f"root:x:0:\nuser:x:{INSIDE_UID}:\n", "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
             "hostname": "sandbox\n", "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n"}
    for name, text in files.items():
        p = etc / name
        if not p.exists() or p.read_text() != text:
            p.write_text(text)
    if Path("/etc/ld.so.cache").exists() and not (etc / "ld.so.cache").exists():
        shutil.copy2("/etc/ld.so.cache", etc / "ld.so.cache")
    src = Path(__file__).with_name("guest_agent.py")
    dst = root / "agent" / "guest_agent.py"
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
        tmp = dst.with_suffix(".tmp")
        tmp.write_bytes(src.read_bytes())
        tmp.replace(dst)
    os.chmod(root / "agent", 0o755)
    os.chmod(dst, 0o644)
    return root


def tree_fingerprint(path: Path) -> str:
    """A hash of names, sizes, modes and mtimes below `path` (cheap change detection for template caching)."""
    h = hashlib.sha256(str(path.resolve()).encode())
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            st = os.lstat(os.path.join(dirpath, name))
            h.update(f"{os.path.relpath(os.path.join(dirpath, name), path)}\0{st.st_size}\0{st.st_mode}\0"
                     f"{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def seal_tree(tree: Path) -> None:
    """Make a layer being sealed (which nothing else touches yet) owned by SANDBOX_UID throughout, with no
    setuid/setgid bits: every sandbox sees it as its own files (idmap.py), and nothing in it runs set-id."""
    os.lchown(tree, SANDBOX_UID, SANDBOX_UID)
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            os.lchown(p, SANDBOX_UID, SANDBOX_UID)
            st = os.lstat(p)
            if st.st_mode & 0o6000 and not os.path.islink(p):
                os.chmod(p, st.st_mode & 0o1777)


# ---- reference-counted layers ----------------------------------------------------------------------------
# A layer's users (sandboxes, snapshots) each hold a marker file layers/.users/<layer>/<user> naming their
# owning process. Releasing the last live marker deletes the layer. All under one flock, across processes.
def _users(layer: Path) -> Path:
    return layer.parent / ".users" / layer.name


@contextlib.contextmanager
def layers_locked(root: Path):
    (root / "layers").mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "layers" / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _owner_record() -> str:
    return json.dumps({"pid": os.getpid(), "start": proc_start_time(os.getpid())})


def owner_alive_record(marker: Path) -> bool:
    """Whether the process a {"pid", "start"} record file names is still the one that wrote it."""
    try:
        rec = json.loads(marker.read_text())
        return proc_start_time(rec["pid"]) == rec["start"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _acquire_locked(layers, user: str) -> None:
    for layer in map(Path, layers):
        if layer.name == "empty":
            continue
        if not layer.is_dir():
            raise FileNotFoundError(f"layer {layer.name} is gone (its snapshot was deleted)")
        _users(layer).mkdir(parents=True, exist_ok=True)
        (_users(layer) / user).write_text(_owner_record())


def acquire_layers(root: Path, layers, user: str) -> None:
    """Mark `user` as a user of every layer (idempotent). FileNotFoundError if one is already gone."""
    with layers_locked(root):
        _acquire_locked(layers, user)


def _collect_locked(layer: Path) -> bool:
    """Delete `layer` if it is tracked and none of its markers has a live owner. True if it was deleted."""
    users = _users(layer)
    if layer.name == "empty" or not users.is_dir():  # untracked: not ours to judge
        return False
    markers = list(users.iterdir())
    if any(owner_alive_record(m) for m in markers):
        return False
    remove_tree(layer)
    shutil.rmtree(users, ignore_errors=True)
    return True


def new_layer_dir(root: Path, name: str, user: str) -> Path:
    """An empty layer directory held by `user` (e.g. for a process image), made and held in one step."""
    layer = root / "layers" / name
    with layers_locked(root):
        layer.mkdir()
        _acquire_locked([layer], user)
    return layer


def release_layers(root: Path, layers, user: str) -> None:
    """Drop `user`'s mark on each layer; a layer left without live users is deleted."""
    with layers_locked(root):
        for layer in map(Path, layers):
            with contextlib.suppress(FileNotFoundError):
                (_users(layer) / user).unlink()
            _collect_locked(layer)


def collect_layers(root: Path) -> int:
    """Delete every tracked layer whose users are all gone (their processes died). Returns how many."""
    n = 0
    with layers_locked(root):
        users = root / "layers" / ".users"
        for d in sorted(users.iterdir()) if users.is_dir() else []:
            n += _collect_locked(root / "layers" / d.name)
    return n


def layer_users(layer: str | Path) -> list[str]:
    users = _users(Path(layer))
    return sorted(p.name for p in users.iterdir()) if users.is_dir() else []


def seal_template(template: str | Path | None, root: Path, user: str, strip_git: bool = True) -> Path:
    """A read-only shared copy of the template owned by the sandbox uid, `.git` removed so a repository's
    future history cannot be read, set-id bits cleared. Cached by content fingerprint while in use (held by
    `user` on return); built atomically (tmp dir + rename)."""
    if template is None:
        layer = root / "layers" / "empty"
        layer.mkdir(exist_ok=True)
        os.chown(layer, SANDBOX_UID, SANDBOX_UID)
        return layer
    src = Path(template)
    layer = root / "layers" / f"tpl-{tree_fingerprint(src)}{'-nogit' if strip_git else ''}"
    with layers_locked(root):
        if layer.is_dir():
            _acquire_locked([layer], user)
            return layer
    tmp = root / "layers" / f".building-{os.getpid()}-{time.monotonic_ns()}"
    ignore = shutil.ignore_patterns(".git") if strip_git else None
    try:
        shutil.copytree(src, tmp, symlinks=True, ignore=ignore)
        seal_tree(tmp)
        with layers_locked(root):
            if layer.is_dir():  # someone else sealed it first
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.rename(layer)
            _acquire_locked([layer], user)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return layer


def seal_upper(upper: Path, root: Path, name: str, user: str) -> Path:
    """Copy a sandbox's overlay upper dir (whiteouts and opaque-dir xattrs included) into a sealed layer
    held by `user`, with set-id bits cleared."""
    dst = root / "layers" / name
    tmp = dst.with_name("." + name)
    try:
        subprocess.run(["cp", "-a", "--", str(upper), str(tmp)], check=True, capture_output=True)
        seal_tree(tmp)
        with layers_locked(root):
            tmp.rename(dst)
            _acquire_locked([dst], user)
    except (OSError, subprocess.CalledProcessError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"cannot seal {upper} as layer {name}: {e}") from e
    return dst


def proc_start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_owner(d: Path, extra: dict) -> None:
    rec = {"pid": os.getpid(), "start": proc_start_time(os.getpid()), **extra}
    (d / "owner.json").write_text(json.dumps(rec))


def owner_alive(d: Path) -> bool:
    try:
        rec = json.loads((d / "owner.json").read_text())
    except (OSError, ValueError):
        return False
    return proc_start_time(rec["pid"]) == rec["start"]


def remove_tree(d: Path) -> None:
    for m in sorted(mounts_under(d), key=len, reverse=True):
        umount(m)
    shutil.rmtree(d, ignore_errors=True)


def _cmdline(pid) -> str:
    """A process's command line as one line ('' once it is gone): what names a stray's origin in a report."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return ""


def leftovers(root: Path | None = None, pid: int | None = None) -> list[str]:
    """What sandboxes of process `pid` (default: this one) left behind once all were closed: sandbox
    directories, mounts, layer holds; and, from any process, layer directories nothing holds, sandbox cgroups
    without a sandbox directory and sandbox-uid processes outside every live sandbox's cgroup. Empty when
    nothing leaked."""
    from k3.agentenv import cgroups, idmap
    root, pid = root or state_root(), pid or os.getpid()
    out = []
    live = set()
    for kind in ("sb", "gv"):
        for d in sorted((root / kind).glob("*")):
            live.add(d.name)
            try:
                owner = json.loads((d / "owner.json").read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            if owner == pid:
                out.append(f"sandbox directory {d}")
    for m in mounts_under(root):
        parts = Path(m).relative_to(root).parts
        if len(parts) < 2 or parts[0] not in ("sb", "gv") or parts[1] not in live:
            out.append(f"mount {m}")
    users = root / "layers" / ".users"
    for marker in sorted(users.glob("*/*")) if users.is_dir() else []:
        try:
            if json.loads(marker.read_text())["pid"] == pid:
                out.append(f"layer {marker.parent.name} held by {marker.name}")
        except (OSError, ValueError, KeyError):
            pass
    with layers_locked(root) if (root / "layers").is_dir() else contextlib.nullcontext():
        # (a layer appears together with its first hold, under this lock)
        for layer in sorted((root / "layers").iterdir()) if (root / "layers").is_dir() else []:
            if layer.is_dir() and not layer.name.startswith(".") and layer.name != "empty" and \
                    not _users(layer).is_dir():
                out.append(f"layer directory {layer} that nothing holds")
    version = cgroups.detect()[0]
    own = cgroups.own_cgroups() if version else {}
    bases = ([cgroups.CG_ROOT / c / own[c].lstrip("/") for c in cgroups.V1_CONTROLLERS] if version == "v1" else
             [cgroups.CG_ROOT / own[""].lstrip("/")] if version == "v2" else [])
    for base in bases:
        for g in sorted(base.glob("k3*-*")):
            if g.is_dir() and g.name.split("-", 1)[1] not in live:
                out.append(f"cgroup {g}")
    for proc, uid, status in idmap.live_processes():
        if not (uid == SANDBOX_UID or idmap.in_range(uid)):
            continue
        try:
            groups = Path(f"/proc/{proc}/cgroup").read_text()
        except OSError:
            continue
        if not any(f"-{n}" in groups for n in live):
            field = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            where = next((g.split(":", 2)[2] for g in groups.splitlines() if ":pids:" in g or g.startswith("0::")), "?")
            out.append(f"process {proc} of sandbox uid {uid} outside every live sandbox ({field.get('Name')}, "
                       f"state {field.get('State')}, parent {field.get('PPid')} {_cmdline(field.get('PPid'))!r}, "
                       f"cgroup {where})")
    out += [f"uid {u} still leased" for u in idmap.leases_of(root, pid)]
    return out
