"""Writing a checkpoint directory all or nothing: the files go into a temporary directory beside OUT, which is
renamed into place only when whole. A failed write removes its temporary; one left by a process that was killed
(SIGKILL, power loss) is removed by the next write to the same OUT, once its process is gone."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from k3.checkpoint.hf import CheckpointError


def check_new_out(out: Path, verb: str) -> None:
    """OUT must be missing or an empty directory: a checkpoint write never mixes with files already there."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"OUT {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"OUT {out} is not empty: give a new directory ({verb} never writes over files)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_temporaries(out: Path, verb: str) -> list[Path]:
    """Temporaries of `verb` beside OUT whose writing process is gone (a live one's are never touched)."""
    removed = []
    for p in out.parent.glob(f".{out.name}.tmp-{verb}-*"):
        pid = p.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextmanager
def staged_out(out, verb: str):
    """Yields the temporary directory to write OUT's files into; renames it to OUT when the block ends without
    an error, removes it otherwise (a full disk or an unwritable parent becomes one CheckpointError)."""
    out = Path(out)
    check_new_out(out, verb)
    remove_dead_temporaries(out, verb)
    tmp = out.with_name(f".{out.name}.tmp-{verb}-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        yield tmp
        if out.is_dir():
            out.rmdir()  # empty (checked above); fails, keeping both, if something appeared there meanwhile
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
            raise CheckpointError(f"writing OUT {out} failed: {reason}; its partial files were removed") from None
        raise
