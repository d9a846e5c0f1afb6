"""The training-step memory estimate (k3.train.memory_estimate) against the measured peak: each shape runs two
real training steps (model, Muon, forward with packed-document mask, backward, step) in a fresh process, whose
peak resident memory over its resident memory before the model is the measured figure.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_train_memory.py [--preset tiny] [--shapes 16x256,4x2048,1x8192]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

STEP = r"""
import json, sys, torch
from k3.config import K3Config
from k3.memory import peak_resident_bytes
from k3.model.decoder import K3ForCausalLM
from k3.train.optim import build_optimizer
preset, B, T, ckpt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
base = int(open("/proc/self/statm").read().split()[1]) * 4096
model = K3ForCausalLM(K3Config.preset(preset)).train()
model.model.gradient_checkpointing = ckpt
opt = build_optimizer(model, "muon", lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (B, T))
for _ in range(2):
    model(ids, doc_ids=torch.zeros_like(ids), labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(json.dumps(peak_resident_bytes() - base))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--shapes", default="2x256,16x256,1x2048,4x2048,1x8192", help="BATCHxSEQ_LEN,...")
    ap.add_argument("--checkpointing", action="store_true")
    a = ap.parse_args()
    from k3.config import K3Config
    from k3.train.memory_estimate import PEAK_FACTOR, estimate_train_memory

    mem = estimate_train_memory(K3Config.preset(a.preset), "muon", a.checkpointing)
    print(f"{a.preset}, muon, checkpointing {'on' if a.checkpointing else 'off'}: state {mem.fixed / 2**20:.1f} MiB, "
          f"kept {mem.per_token / 1024:.1f} KiB/token + {mem.per_token_squared} B x T per token, "
          f"PEAK_FACTOR {PEAK_FACTOR}")
    print("| batch x seq_len | kept MiB | estimate MiB | measured peak MiB | measured / estimate | peak / kept |")
    print("|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        out = subprocess.run([sys.executable, "-c", STEP, a.preset, str(B), str(T), str(int(a.checkpointing))],
                             capture_output=True, text=True, check=True).stdout
        peak = json.loads(out.splitlines()[-1])
        kept, est = mem.kept(B, T), mem.total(B, T)
        print(f"| {B} x {T} | {kept / 2**20:,.0f} | {est / 2**20:,.0f} | {peak / 2**20:,.0f} | {peak / est:.2f} | "
              f"{(peak - mem.fixed) / kept:.2f} |", flush=True)


if __name__ == "__main__":
    main()
