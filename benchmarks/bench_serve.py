r"""`k3 bench serve` with the recorded settings: tiny on CPU at concurrency 1, 8, 32 (random prompts and the
multi-turn shared-prefix dataset) next to the static-batch `generate` baseline. Extra arguments override these.

CPU sanity check of every path (~15 s): `python benchmarks/bench_serve.py --quick`.

GPU run (one H200; `small` = 1.55B parameters, random weights, bf16):

    python benchmarks/bench_serve.py --preset small --device cuda --dtype bfloat16 --concurrency 1,8,32,64 \
        --num-prompts 1 --prompts-per-concurrency 3 --turns 3 --input-len 256 --output-len 128 \
        --memory-gib 16 --num-state-slots 512 --max-num-seqs 64 --max-batch-tokens 2048 \
        --block-size 256 --match-unit 16 --json benchmarks/serve_small_h200.json

Each level runs 3 x c requests: random = 3 waves of c, multi-turn = c conversations x 3 turns, static baseline =
3 batches of c. That is 9 x 128 decode steps per level, ~4,600 in all (plus prefill chunks): about 3 min at
40 ms a step, plus model build and warm-up. Memory: 16 GiB pool = 512 KDA slots (9.6 MiB each: 64 running +
checkpoints, so multi-turn checkpoints are not evicted at c=64) + ~4.7M tokens of MLA latents; with the 3 GB
of bf16 weights, far below the card's 141 GB. Results go to --json after every row; exit code 1 if a sanity
check failed.

The engine runs with async output (the default: each decode step launches before the previous one is read back;
`--no-async-output` times the synchronous engine). Its warm-up is the engine's own (`LLMEngine.warm_up`, as `k3 serve`
starts: every prefill bucket and decode graph), then the whole timed load on other prompts; `graphs_first_used` > 0
in a row means a capture landed inside its figures. Under each engine row, the engine's trace of the timed run
(`StepLog`): request intake, stepping, emitting, idle, and each step kind's count and period. The engine runs in
a process of its own, as `k3 serve` runs it (`--no-engine-process`: on a thread of the server's process)."""
import sys

from k3.cli import main

DEFAULTS = ["bench", "serve", "--concurrency", "1,8,32", "--num-prompts", "32", "--input-len", "32",
            "--output-len", "16", "--turns", "4", "--block-size", "64", "--match-unit", "16"]

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))
