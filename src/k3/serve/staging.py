"""A step's host-made inputs to a static device buffer (CUDA graphs replay it), one non-blocking copy a load.

On CUDA the values go through pinned memory, and the copy is queued behind the kernels launched before it; the
host must not overwrite a pinned buffer whose copy has not run yet. With one buffer, a load waits for the copy
the load before it queued: with async output (k3.serve.engine) that copy sits behind the step still on the
device, which the host has not waited for, so the load could stall on it. Two buffers take turns: a load waits
only for the copy two loads back, which ran before a step the host has since read back, so on the serving path
the wait returns at once (tests/test_serve_host_syncs.py checks it on a GPU).
"""
from __future__ import annotations

import torch

TURNS = 2  # pinned buffers a staging area takes turns over


class PinnedStaging:
    """Loads of `device_buffer`'s whole contents from the host. On a CPU the copy is the load itself."""

    def __init__(self, device_buffer: torch.Tensor):
        self.device_buffer = device_buffer
        turns = TURNS if device_buffer.device.type == "cuda" else 0  # none: a CPU buffer is loaded directly
        self.hosts = [torch.empty(device_buffer.shape, dtype=device_buffer.dtype, pin_memory=True)
                      for _ in range(turns)]
        self.copied = [torch.cuda.Event() for _ in range(turns)]  # each host buffer's last copy has run
        self.turn = 0

    def load(self, values: torch.Tensor) -> None:
        """Copy `values` (a host tensor of the buffer's shape) to the device buffer, in stream order."""
        if not self.hosts:
            self.device_buffer.copy_(values)
            return
        host, copied = self.hosts[self.turn], self.copied[self.turn]
        self.turn = (self.turn + 1) % len(self.hosts)
        copied.synchronize()  # the copy out of this buffer two loads back: never overwrite its source
        host.copy_(values)
        self.device_buffer.copy_(host, non_blocking=True)
        copied.record()
