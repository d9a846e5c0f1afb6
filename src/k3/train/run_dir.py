"""The run directory of `k3 train`: where a run may write, what a fresh run may replace, and which checkpoint
a resume reads. Nothing here deletes a file that k3 did not write."""
from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from k3.checkpoint.hf import CheckpointError

# what `k3 train` (text or vision) writes into a run directory: all that --overwrite may remove
RUN_FILES = frozenset({"checkpoints", "model", ".tmp-model", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json",
                       "loss.png", "expert_load.png"})

# held (flock) by the process that trains into a run directory, so that a second `k3 train` on the same --out
# is refused instead of interleaving its checkpoints with the first's; the kernel drops it when that process dies
LOCK_NAME = ".k3-train.lock"

# the fields that shape a run's trajectory: a resume keeps them, and a flag that contradicts them is refused
RUN_FIELDS = ("preset", "corpus", "data", "tokenizer", "max_steps", "batch_size", "seq_len", "grad_accum", "lr",
              "optimizer", "weight_decay", "warmup_steps", "decay_fraction", "grad_clip", "balance", "seed", "qat")


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message is one line naming it."""


def default_run_dir(preset: str, task: str = "text") -> str:
    """runs/<preset> for text runs, runs/vision for the vision task: one preset never writes into another's."""
    return "runs/vision" if task == "vision" else f"runs/{preset}"


def check_run_dir(out: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Before anything is written: `out` must be a directory k3 can write, and a fresh run's `out` must be
    missing or empty, or (with overwrite) hold nothing but a previous k3 run. Creates `out`."""
    if resume and overwrite:
        raise RunDirError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    if resume and not out.exists():
        raise RunDirError(f"--resume: no complete checkpoint under {out / 'checkpoints'} ({out} does not exist)")
    if not resume and out.is_dir():
        held = sorted(n for n in os.listdir(out) if n != LOCK_NAME)
        if held and not overwrite:
            raise RunDirError(f"--out {out} is not empty ({_few(held)}): continue that run with --resume, replace it "
                              f"with --overwrite, or choose another --out")
        foreign = [n for n in held if n not in RUN_FILES]
        if foreign:
            raise RunDirError(f"--overwrite: --out {out} holds files k3 train did not write ({_few(foreign)}); "
                              f"choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # the real test of writability (ACLs, read-only mounts, root)
            pass
    except OSError as e:
        raise RunDirError(f"--out {out} cannot be written: {e.strerror or e}"
                          f"{f' ({e.filename})' if e.filename and str(e.filename) != str(out) else ''}") from None


def claim_run_dir(out: Path):
    """Take the run directory for this process (after check_run_dir): returns the open lock file, which must stay
    open for as long as the run writes. Raises RunDirError naming the other process when one holds it."""
    f = open(out / LOCK_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise RunDirError(f"--out {out} is in use by another k3 train (pid {pid}): wait for it to finish, or choose "
                          f"another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def clear_previous_run(out: Path) -> None:
    """--overwrite: removes what a previous run wrote into `out` (check_run_dir has vouched that is all it holds)."""
    for name in RUN_FILES:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def remove_stale_temporaries(out: Path, log=print) -> None:
    """Temporary directories left by a process that was killed while saving (SIGKILL, power loss): never
    complete, never resumed from, and possibly what filled the disk."""
    stale = [*(out / "checkpoints").glob(".tmp-*"), *out.glob(".tmp-model")]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    if stale:
        log(f"removed {len(stale)} unfinished save(s) of an earlier process: {_few([p.name for p in stale])}")


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoints that finished saving (trainer_state.pt is written last), newest first; the one `latest`
    names leads. Temporary directories of interrupted saves are never listed."""
    done = sorted((p for p in ckpt_root.glob("step_*") if (p / "trainer_state.pt").is_file()),
                  key=lambda p: p.name, reverse=True)
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        named = ckpt_root / pointer.read_text().strip()
        if named in done:
            done.remove(named)
            done.insert(0, named)
    return done


# What a trainer state holds beyond tensors and containers: numpy's RNG state (one uint32 array). A checkpoint is
# a pickle, and a pickle may name any callable (`os.system` included) to run as it loads; a run directory can come
# from anyone, so states load with torch's weights-only unpickler, which refuses every other global.
_NUMPY_ARRAY = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np.array(0).__reduce__()[0]]  # any numpy


def load_state_file(f: Path, mmap: bool = False):
    """One `torch.save`d state of a run (trainer_state.pt, a rank's rank_*.pt) on the CPU, without running any code
    the file names; a damaged file, or one that needs code to load, is a CheckpointError naming it."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY):
            return torch.load(f, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as e:
        try:  # what the file names beyond the allowed (read from the pickle's opcodes, nothing run)
            with torch.serialization.safe_globals(_NUMPY_ARRAY):
                foreign = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        except Exception:  # noqa: BLE001 (a file too damaged to list: reported as corrupt below)
            foreign = []
        if foreign:
            raise CheckpointError(f"{f} names Python objects a k3 state never holds ({_few(foreign)}); k3 does not "
                                  f"run code from a checkpoint: it was not written by k3, or was tampered with"
                                  ) from None
        raise CheckpointError(f"corrupt {f}: {_first_line(e)}") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ... for a damaged file
        raise CheckpointError(f"corrupt {f}: {_first_line(e)}") from None


def read_trainer_state(ckpt: Path, mmap: bool = False) -> dict:
    """trainer_state.pt of one checkpoint; a file that does not load is a CheckpointError naming it."""
    f = ckpt / "trainer_state.pt"
    state = load_state_file(f, mmap=mmap)
    if not isinstance(state, dict) or "step" not in state or "train_config" not in state:
        raise CheckpointError(f"corrupt {f}: not a k3 trainer state")
    return state


def saved_train_config(out: Path, warn=print) -> dict:
    """The configuration the run in `out` was started with, from its newest readable checkpoint."""
    ckpts = complete_checkpoints(out / "checkpoints")
    if not ckpts:
        raise RunDirError(f"--resume: no complete checkpoint under {out / 'checkpoints'}")
    problems = []
    for ckpt in ckpts:
        try:
            return read_trainer_state(ckpt, mmap=True)["train_config"]
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"{e}; trying the previous checkpoint")
    raise RunDirError(f"--resume: no readable checkpoint under {out / 'checkpoints'}: {'; '.join(problems)}")


def check_resume_config(cfg: dict, saved: dict, where: Path) -> None:
    """A resumed run continues the saved trajectory: each RUN_FIELDS value must equal the saved one."""
    for name in RUN_FIELDS:
        if name in saved and name in cfg and cfg[name] != saved[name]:
            flag = "--" + name.replace("_", "-")
            raise RunDirError(f"--resume: {flag} {cfg[name]!r} contradicts the saved run in {where} "
                              f"({flag} {saved[name]!r}); leave it out to continue that run, or start a new one "
                              f"in another --out")


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
