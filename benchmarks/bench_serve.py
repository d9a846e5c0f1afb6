"""`k3 bench serve` with the recorded settings: tiny on CPU at concurrency 1, 8, 32 (random prompts and the
multi-turn shared-prefix dataset) next to the static-batch `generate` baseline. Extra arguments are passed on,
e.g. `python benchmarks/bench_serve.py --preset small --device cuda --dtype bfloat16 --concurrency 1,8,32,64`."""
import sys

from k3.cli import main

DEFAULTS = ["bench", "serve", "--concurrency", "1,8,32", "--num-prompts", "32", "--input-len", "32",
            "--output-len", "16", "--turns", "4", "--block-size", "64", "--match-unit", "16"]

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))
