"""AgentENV latency/density per backend: create->first exec, exec round trip, pause/resume, snapshot/restore,
fork per child, idle memory per sandbox, concurrent sandboxes held; next to AgentENV's published figures
(49 ms restore, 133 ms snapshot, 122 ms fork on bare-metal KVM hosts). Usage: python benchmarks/bench_agentenv.py
[--backends bwrap,gvisor] [--reps 5] [--max-concurrent 64]"""
import argparse
import statistics
import time

from k3.agentenv import SandboxSpec, get_backend

PUBLISHED = {"snapshot": "133 ms", "restore": "49 ms", "fork/child": "122 ms"}


def ms(f, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def bench(name, reps, max_concurrent):
    b = get_backend(name)
    ok, reason = b.available()
    if not ok:
        return {"backend": name, "skipped": reason}
    row = {"backend": name}

    def create_exec():
        s = b.create(SandboxSpec())
        s.exec("true")
        s.close()
    row["create->first exec"] = ms(create_exec, reps)
    s = b.create(SandboxSpec())
    s.write_file("f.txt", b"x" * 4096)
    row["exec round trip"] = ms(lambda: s.exec("true"), reps * 4)
    row["pause+resume"] = ms(lambda: (s.pause(), s.resume()), reps)
    snaps = []
    row["snapshot"] = ms(lambda: snaps.append(s.snapshot("fs")), reps)
    restored = []
    row["restore"] = ms(lambda: restored.append(b.restore(snaps[-1])), reps)
    for r in restored:
        r.close()
    for snap in snaps:  # a snapshot holds its layers until deleted
        b.delete_snapshot(snap)
    t = time.perf_counter()
    kids = s.fork(4)
    row["fork/child"] = (time.perf_counter() - t) * 1e3 / 4
    for k in kids:
        k.close()
    held = []
    try:
        while len(held) < max_concurrent:
            held.append(b.create(SandboxSpec()))
    except Exception as e:  # the machine's limit
        row["limit hit"] = str(e)[:80]
    row["concurrent held"] = len(held)
    if held and hasattr(held[0], "memory_usage"):
        time.sleep(0.5)
        row["idle MiB/sandbox"] = statistics.median(h.memory_usage() for h in held) / 2**20
    for h in held:
        h.close()
    s.close()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="bwrap,gvisor,firecracker")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-concurrent", type=int, default=64)
    a = ap.parse_args()
    cols = ["create->first exec", "exec round trip", "pause+resume", "snapshot", "restore", "fork/child",
            "idle MiB/sandbox", "concurrent held"]
    print("| backend | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name in a.backends.split(","):
        row = bench(name, a.reps, a.max_concurrent)
        if "skipped" in row:
            print(f"| {name} | backend unavailable: {row['skipped']} |")
            continue
        cells = [f"{row[c]:.1f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| AgentENV (published, KVM) | 49 (restore) | - | - | 133 | 49 | 122 | 1/10 of allocation | 400/128 cores |")
    print("times in ms (median)")


if __name__ == "__main__":
    main()
