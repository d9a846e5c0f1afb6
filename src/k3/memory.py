"""Free memory of a device, and the one error for work that would not fit in it (checked before allocating)."""
from __future__ import annotations

from pathlib import Path

import torch


class NotEnoughMemoryError(MemoryError, ValueError):
    """Work that needs more memory than the device has free; the message gives both numbers. A ValueError
    too, so that callers treating bad sizes as bad input (the CLI) report it in one line."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def available_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes that can still be allocated on `device` (None: unknown, or unbounded as on `meta`).
    CPU: the kernel's MemAvailable, lowered to what a cgroup (container) limit leaves; CUDA: the driver's free."""
    device = torch.device(device if device is not None else torch.get_default_device())
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = _meminfo_available()
    limit = _cgroup_room()
    if free is None or limit is None:
        return free if limit is None else limit
    return min(free, limit)


def check_fits(what: str, need: int, device: torch.device | str | None = None) -> None:
    """Raise NotEnoughMemoryError naming `what` when `need` bytes exceed what `device` has free."""
    free = available_bytes(device)
    if free is not None and need > free:
        dev = torch.device(device if device is not None else torch.get_default_device())
        raise NotEnoughMemoryError(f"{what} needs {format_bytes(need)} but only {format_bytes(free)} is free on {dev}")


def peak_resident_bytes() -> int:
    """This process's peak resident memory (Linux's VmHWM). Not getrusage's ru_maxrss: that one survives
    fork and exec, so a child started by a large parent (a test runner of 1 GB) reports the parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """What this container's memory cgroup limit leaves (v2 memory.max, else v1 limit_in_bytes), or None."""
    for limit_file, used_file in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (Path("/sys/fs/cgroup") / limit_file).read_text().strip()
            used = int((Path("/sys/fs/cgroup") / used_file).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(limit) - used)
    return None
