"""AgentENV sandboxes per backend, beside AgentENV's published figures (Firecracker on bare-metal KVM: snapshot
133 ms, restore 49 ms, fork 122 ms per child). Prints two markdown tables:

1. one row per backend: create->first exec, exec round trip, pause+resume, snapshot, restore, restore->first
   exec, fork per child, idle memory per sandbox, sandboxes held at once. A backend that cannot run here gets a
   row saying why; gVisor also gets a row for full snapshots (process memory, like AgentENV's VM snapshots).
2. workspace scaling: snapshot, restore and fork per child, and the snapshot's new bytes on disk, for
   workspaces of 4 KiB to 100 MiB in 1 to 1000 files, beside what bounds a copying snapshot: a plain `cp -a`
   of the same tree onto the state disk, measured in the same run (its MB/s is the disk's copy bandwidth).

Usage: python benchmarks/bench_agentenv.py [--backends bwrap,gvisor,firecracker] [--reps 5]
       [--scaling bwrap,gvisor] [--scaling-reps 3] [--max-concurrent 8] [--sizes 4096,...] [--files 1,10,...]
Times are medians in ms."""
import argparse
import os
import shutil
import statistics
import subprocess
import time
import uuid
from pathlib import Path

from k3.agentenv import Limits, SandboxSpec, get_backend, hostfs

PUBLISHED = {"snapshot": 133.0, "restore": 49.0, "fork/child": 122.0}
SIZES = [4 << 10, 1 << 20, 10 << 20, 100 << 20]
FILE_COUNTS = [1, 10, 100, 1000]
# the workspace of a scaling cell: n files of size/n random bytes under /workspace/data
FILL = ("import os, sys\nn, size = int(sys.argv[1]), int(sys.argv[2])\nos.makedirs('data', exist_ok=True)\n"
        "for i in range(n):\n    with open(f'data/f{i:04d}', 'wb') as f:\n"
        "        f.write(os.urandom(size // n + (i < size % n)))\n")


def timed(f) -> float:
    """Milliseconds one call of f takes."""
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def median_ms(f, reps: int) -> float:
    return statistics.median(timed(f) for _ in range(reps))


def tree_bytes(path) -> int:
    """Bytes a directory tree takes on disk (allocated blocks, not apparent sizes)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, f)).st_blocks * 512 for f in files)
    return total


def backend_label(name: str) -> str:
    if name != "gvisor":
        return name
    from k3.agentenv.backends.gvisor import _runsc_base
    platform = next(a.split("=", 1)[1] for a in _runsc_base(Path("/")) if a.startswith("--platform="))
    version = subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout.split()[2]
    return f"gvisor (runsc {version}, {platform})"


def restore_then_exec(b, snap, closing: list):
    def run():
        r = b.restore(snap)
        closing.append(r)
        assert r.exec("true").ok
    return run


def fork_per_child(s, n: int, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        kids = s.fork(n)
        out.append((time.perf_counter() - t) * 1e3 / n)
        for k in kids:
            k.close()
    return statistics.median(out)


def snapshot_restore(b, s, level: str, reps: int, row: dict, prefix: str = "") -> None:
    """snapshot, restore and restore->first exec medians of `s` at `level`, into row."""
    snaps, opened = [], []
    try:
        row[prefix + "snapshot"] = median_ms(lambda: snaps.append(s.snapshot(level)), reps)
        row[prefix + "restore"] = median_ms(lambda: opened.append(b.restore(snaps[-1])), reps)
        row[prefix + "restore->first exec"] = median_ms(restore_then_exec(b, snaps[-1], opened), reps)
    finally:
        for r in opened:
            r.close()
        for snap in snaps:  # a snapshot holds its layers until deleted
            b.delete_snapshot(snap)


def bench_backend(name: str, reps: int, max_concurrent: int) -> list[dict]:
    b = get_backend(name)
    ok, reason = b.available()
    if not ok:
        return [{"backend": name, "skipped": reason}]
    slow = name == "gvisor"  # seconds per sandbox start: fewer reps and children keep the run short
    row = {"backend": backend_label(name)}

    made = []

    def create_exec():
        made.append(b.create(SandboxSpec()))
        assert made[-1].exec("true").ok
    try:
        row["create->first exec"] = median_ms(create_exec, reps)
    finally:  # closing is not timed (runsc delete alone takes a second)
        for s in made:
            s.close()
    rows = [row]
    s = b.create(SandboxSpec())
    try:
        s.write_file("f.txt", b"x" * 4096)
        row["exec"] = median_ms(lambda: s.exec("true"), reps * 4)
        row["pause+resume"] = median_ms(lambda: (s.pause(), s.resume()), reps)
        snapshot_restore(b, s, "fs", reps, row)
        row["fork/child"] = fork_per_child(s, 2 if slow else 4, max(2, reps // 2) if slow else reps)
        if name == "gvisor":  # process memory too: what AgentENV's VM snapshots keep
            full = {"backend": row["backend"] + ", full snapshot (processes)"}
            snapshot_restore(b, s, "full", max(2, reps // 2), full)
            rows.append(full)
    finally:
        s.close()
    held = []
    try:
        while len(held) < max_concurrent:
            held.append(b.create(SandboxSpec()))
    except Exception as e:  # the machine's limit
        row["limit hit"] = str(e)[:80]
    row["held"] = len(held)
    if held and hasattr(held[0], "memory_usage"):
        time.sleep(1.0)  # start-up allocations settle
        row["idle MiB"] = statistics.median(h.memory_usage() for h in held) / 2**20
    for h in held:
        h.close()
    return rows


def copy_floor(src: Path, root: Path, reps: int) -> float:
    """A plain `cp -a` of src onto the state disk (where snapshot layers go): what a copying snapshot costs."""
    def copy():
        dst = root / "layers" / f".bench-copy-{uuid.uuid4().hex[:8]}"
        copies.append(dst)
        subprocess.run(["cp", "-a", "--", str(src), str(dst)], check=True)
    copies: list[Path] = []
    try:
        return median_ms(copy, reps)
    finally:
        for d in copies:
            shutil.rmtree(d, ignore_errors=True)


def scaling_cell(b, size: int, nfiles: int, reps: int, fork_n: int) -> dict:
    limits = Limits(disk_bytes=size + (64 << 20), memory_bytes=size + (256 << 20))
    s = b.create(SandboxSpec(limits=limits))
    cell = {"size": size, "files": nfiles}
    try:
        r = s.exec(["/usr/bin/python3", "-I", "-c", FILL, str(nfiles), str(size)], timeout=120)
        assert r.ok, r.stderr
        snaps, opened = [], []
        try:
            cell["snapshot"] = median_ms(lambda: snaps.append(s.snapshot("fs")), reps)
            cell["layer bytes"] = tree_bytes(snaps[-1].layers[0])
            cell["restore"] = median_ms(lambda: opened.append(b.restore(snaps[-1])), reps)
            check = opened[-1].exec(["/bin/sh", "-c", "cat data/* | wc -c"])
            assert check.text.strip() == str(size), check  # the restored workspace is all there
        finally:
            for o in opened:
                o.close()
            for snap in snaps:
                b.delete_snapshot(snap)
        cell["fork/child"] = fork_per_child(s, fork_n, reps)
        s.pause()  # as a snapshot copies it: frozen
        try:
            cell["cp -a"] = copy_floor(s.upper, b.root, reps)
        finally:
            s.resume()
    finally:
        s.close()
    return cell


def scaling(name: str, reps: int, sizes: list[int], counts: list[int]):
    b = get_backend(name)
    if not b.available()[0]:
        return
    if name == "gvisor":  # seconds per start: the size axis in the fewest files, the file axis at 1 MiB or less
        mid = max(s for s in sizes if s <= 1 << 20) if min(sizes) <= 1 << 20 else min(sizes)
        grid = [(size, counts[0]) for size in sizes] + [(mid, n) for n in counts[1:]]
        reps, fork_n = min(reps, 2), 1
    else:
        grid = [(size, n) for size in sizes for n in counts]
        fork_n = 4
    for size, n in grid:  # one at a time, so each row prints as soon as it is measured
        yield {"backend": name, "fork n": fork_n, **scaling_cell(b, size, n, reps, fork_n)}


def ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"
    return "–" if v is None else str(v)


def human(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.3g} {unit}"
    return f"{size} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="bwrap,gvisor,firecracker")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scaling", default="bwrap,gvisor", help="backends for the workspace-size table ('' for none)")
    ap.add_argument("--scaling-reps", type=int, default=3)
    ap.add_argument("--max-concurrent", type=int, default=8)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="workspace bytes, comma-separated")
    ap.add_argument("--files", default=",".join(map(str, FILE_COUNTS)), help="file counts, comma-separated")
    a = ap.parse_args()
    t0 = time.time()
    root = hostfs.ensure_state()
    fstype = subprocess.run(["df", "--output=fstype", str(root)], capture_output=True, text=True).stdout.split()[-1]
    print(f"/dev/kvm {'present' if os.path.exists('/dev/kvm') else 'absent'}; state root {root} on {fstype}")
    cols = ["create->first exec", "exec", "pause+resume", "snapshot", "restore", "restore->first exec", "fork/child",
            "idle MiB", "held"]
    print("\n| backend | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name in filter(None, a.backends.split(",")):
        for row in bench_backend(name, a.reps, a.max_concurrent):
            if "skipped" in row:
                print(f"| {name} | backend unavailable: {row['skipped']} |" + " |" * (len(cols) - 1))
                continue
            print(f"| {row['backend']} | " + " | ".join(fmt(row.get(c)) for c in cols) + " |", flush=True)
    print("| AgentENV published (Firecracker, bare-metal KVM) | – | – | – | "
          f"{PUBLISHED['snapshot']:.0f} | {PUBLISHED['restore']:.0f} | – | {PUBLISHED['fork/child']:.0f} "
          "| – | – |")

    header = ("\n| backend | workspace | files | snapshot | new layer on disk | restore | fork/child (n) | "
              "bound: cp -a of the tree | cp -a MB/s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in filter(None, a.scaling.split(",")):
        for c in scaling(name, a.scaling_reps, ints(a.sizes), ints(a.files)):
            if header:
                print(header, flush=True)
                header = ""
            mbs = f"{c['size'] / 1e6 / (c['cp -a'] / 1e3):.0f}" if c["size"] >= 1 << 20 else "–"
            print(f"| {c['backend']} | {human(c['size'])} | {c['files']} | {fmt(c['snapshot'])} | "
                  f"{human(c['layer bytes'])} | {fmt(c['restore'])} | {fmt(c['fork/child'])} ({c['fork n']}) | "
                  f"{fmt(c['cp -a'])} | {mbs} |", flush=True)
    if not header:
        print(f"| AgentENV published | – | – | {PUBLISHED['snapshot']:.0f} | – | {PUBLISHED['restore']:.0f} | "
              f"{PUBLISHED['fork/child']:.0f} | – | – |")
    print(f"\nmedians in ms; whole run {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
