"""Keep Python's cyclic garbage collector off what a serving process builds before it serves.

A process that imported torch and built a model, an engine and an app holds hundreds of thousands of long-lived
objects; each full (generation 2) collection walks them all while the event loop, or the engine's step loop, stands
still. On a 2-core VM one took 145 ms in the middle of 64 streams, and new requests' first tokens waited behind it
(a probe of benchmarks/bench_serve_frontend.py's server: its first chunks 124 -> 43 ms after the requests arrived,
with ~206,000 objects frozen). `freeze` moves everything alive now into the permanent generation, which the
collector skips (vLLM's servers do the same at start-up); what is made afterwards is collected as before."""
from __future__ import annotations

import contextlib
import gc


def freeze() -> None:
    """Collect once (nothing already garbage is frozen), then exempt every live object from later collections."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen():
    """`freeze` for a block (a benchmark's timed run in a process that lives on), then return the objects to the
    collector."""
    freeze()
    try:
        yield
    finally:
        gc.unfreeze()
