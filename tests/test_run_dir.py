"""The run directory of `k3 train`: nothing a user has is clobbered (a used --out is refused, --overwrite replaces
only a previous run, a failed or interrupted save leaves the previous checkpoint and no partial files), --resume
continues the saved run with its saved settings (contradicting flags refused, a damaged newest checkpoint
skipped with a warning), and `--task vision` honours or refuses every flag. Each case goes through the CLI and
checks the one-line message and the exit code."""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.checkpoint.hf import load_pretrained
from k3.cli import _VISION_FIXED, _VISION_FLAGS, build_parser, main
from k3.train import trainer as trainer_mod
from k3.train.run_dir import RunDirError
from k3.train.trainer import TrainConfig, Trainer

# the first run's settings, none of them the default: a resume must find each of them again
FIRST_RUN = ["--max-steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "1", "--lr", "0.02",
             "--balance", "sign", "--seed", "3", "--save-every", "1", "--eval-every", "100"]


@pytest.fixture(scope="module")
def corpus(short_corpus) -> str:
    return short_corpus


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus, single_thread) -> Path:
    """A 3-step run with a checkpoint after every step; tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("first") / "run"
    assert main(["train", "--out", str(out), "--corpus", corpus, *FIRST_RUN]) == 0
    return out


def copy_run(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def snapshot(root: Path) -> dict:
    """Every file under root with a hash of its bytes: 'nothing changed' is this dict being equal."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def error_line(capsys) -> str:
    """stderr of the last command, which must hold exactly one `k3 train: error:` line (besides the progress bar)."""
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip() and not l.startswith("train:")]
    assert len(err) == 1 and err[0].startswith("k3 train: error: "), err
    return err[0]


def steps_logged(out: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]


class Captured(Exception):
    pass


@pytest.fixture
def captured_config(monkeypatch):
    """Replaces the Trainer with one that records the configuration the CLI built, and stops."""
    seen = {}

    def trainer(cfg, **kw):
        seen["cfg"] = cfg
        raise Captured

    monkeypatch.setattr(trainer_mod, "Trainer", trainer)
    return seen


# ---- a fresh run never writes into a used directory -------------------------------------------------------------------
@pytest.mark.parametrize("held", ["a user's file", "a previous run"])
def test_fresh_run_refuses_a_used_out_dir(tmp_path, capsys, corpus, finished_run, held):
    if held == "a previous run":
        out = copy_run(finished_run, tmp_path)
    else:
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("do not lose me")
    before = snapshot(out)
    assert main(["train", "--out", str(out), "--corpus", corpus, "--max-steps", "1"]) == 2
    line = error_line(capsys)
    assert f"--out {out} is not empty" in line and "--resume" in line and "--overwrite" in line
    assert snapshot(out) == before


def test_overwrite_replaces_a_previous_run_only(tmp_path, capsys, corpus, finished_run):
    out = copy_run(finished_run, tmp_path)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert main(["train", "--out", str(out), "--corpus", corpus, "--overwrite", *FIRST_RUN[2:], "--max-steps", "1"]) == 2
    line = error_line(capsys)
    assert "did not write (notes.txt)" in line
    assert snapshot(out) == before  # nothing removed, not even the previous run's files

    (out / "notes.txt").unlink()
    assert main(["train", "--out", str(out), "--corpus", corpus, "--overwrite", *FIRST_RUN[2:], "--max-steps", "1"]) == 0
    assert steps_logged(out) == [1]  # the old run's steps 1..3 are gone, not mixed in
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


HOLD_RUN_DIR = """import sys, time
from pathlib import Path
from k3.train.run_dir import claim_run_dir
lock = claim_run_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path, capsys, corpus, finished_run):
    """Another process trains into --out (it holds the directory's lock): --overwrite and --resume are both refused
    and write nothing; once that process is killed (SIGKILL: no clean-up runs), the directory is free again."""
    out = copy_run(finished_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_DIR, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(out)
        for flags in (["--overwrite", "--max-steps", "1"], ["--resume"]):
            assert main(["train", "--out", str(out), "--corpus", corpus, *flags]) == 2
            line = error_line(capsys)
            assert f"--out {out} is in use by another k3 train (pid {holder.pid})" in line, line
            assert snapshot(out) == before  # the other run's checkpoints and metrics untouched
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", "--out", str(out), "--corpus", corpus, "--overwrite", *FIRST_RUN[2:], "--max-steps", "1"]) == 0
    assert steps_logged(out) == [1]


def test_a_directory_holding_only_a_stale_lock_counts_as_empty(tmp_path, corpus):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".k3-train.lock").write_text("12345\n")  # left by a killed run that wrote nothing else
    assert main(["train", "--out", str(out), "--corpus", corpus, *FIRST_RUN[2:], "--max-steps", "1"]) == 0
    assert steps_logged(out) == [1]


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys, finished_run):
    out = copy_run(finished_run, tmp_path)
    before = snapshot(out)
    assert main(["train", "--out", str(out), "--resume", "--overwrite"]) == 2
    assert "give one of them" in error_line(capsys)
    assert snapshot(out) == before


def test_default_run_dir_is_per_preset_and_task(tmp_path, monkeypatch, capsys, captured_config):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Captured):
        main(["train"])
    assert captured_config["cfg"].out == "runs/tiny"  # `make run` generates from runs/tiny/model
    for preset in ("small", "kimi-k3"):  # (too big to start here: --resume shows where they would be)
        assert main(["train", "--preset", preset, "--resume"]) == 2
        assert f"no complete checkpoint under runs/{preset}/checkpoints" in error_line(capsys)
    import k3.vision.train_vision as tv
    seen = {}

    def run(cfg):
        seen["cfg"] = cfg
        raise Captured

    monkeypatch.setattr(tv, "run", run)
    with pytest.raises(Captured):
        main(["train", "--task", "vision"])
    assert seen["cfg"].out == "runs/vision"


def test_library_trainer_refuses_a_used_out_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(RunDirError, match="is not empty"):
        Trainer(TrainConfig(out=str(tmp_path), max_steps=1), log=lambda *a: None)
    assert (tmp_path / "keep.txt").read_text() == "x"


# ---- an --out that cannot be used -------------------------------------------------------------------------------------
def test_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "results.txt"
    f.write_text("precious")
    assert main(["train", "--out", str(f)]) == 2
    assert f"--out {f} is a file, not a directory" in error_line(capsys)
    assert f.read_text() == "precious"
    assert main(["train", "--out", str(f / "run")]) == 2  # below a file: nothing can be created there
    assert "cannot be written: Not a directory" in error_line(capsys)
    assert f.read_text() == "precious"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-555 directory anyway; the unwritable case "
                                              "is covered by test_out_that_is_a_file (a path below a file)")
def test_out_in_a_read_only_directory(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["train", "--out", str(ro / "run")]) == 2
        assert "cannot be written: Permission denied" in error_line(capsys)
    finally:
        ro.chmod(0o755)


def test_error_is_one_line_without_traceback(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    p = subprocess.run([sys.executable, "-m", "k3.cli", "train", "--out", str(f)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"k3 train: error: --out {f} is a file, not a directory"]


# ---- saves that fail or are interrupted ---------------------------------------------------------------------------------
def full_disk_on_second_call(monkeypatch, target, name, error):
    real, calls = getattr(target, name), []

    def writer(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*a, **k)

    monkeypatch.setattr(target, name, writer)


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_full_disk_during_a_save(tmp_path, capsys, monkeypatch, corpus, writer):
    import k3.checkpoint.hf as hf
    out = tmp_path / "run"
    if writer == "safetensors":  # the shard writer: OSError(ENOSPC)
        full_disk_on_second_call(monkeypatch, hf, "save_file", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        reason = "No space left on device"
    else:  # torch's C++ zip writer reports a full disk as a RuntimeError
        reason = "PytorchStreamWriter failed writing file data/0: file write failed"
        full_disk_on_second_call(monkeypatch, trainer_mod.torch, "save", RuntimeError(reason))
    args = ["train", "--out", str(out), "--corpus", corpus, *FIRST_RUN[2:], "--max-steps", "2"]
    assert main(args) == 2
    line = error_line(capsys)
    assert f"saving checkpoint {out / 'checkpoints' / 'step_000002'} failed: {reason}" in line
    assert f"the previous checkpoint {out / 'checkpoints' / 'step_000001'} is intact" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]  # no .tmp-*
    assert (out / "checkpoints" / "latest").read_text() == "step_000001\n"
    load_pretrained(out / "checkpoints" / "step_000001")  # whole
    if writer == "safetensors":  # the disk has room again: --resume continues from step 1
        monkeypatch.undo()
        assert main([*args[:3], "--resume"]) == 0
        assert steps_logged(out) == [1, 2]


def test_killed_save_is_removed_on_resume(tmp_path, capsys, finished_run):
    out = copy_run(finished_run, tmp_path)
    # a process killed with SIGKILL mid-save leaves its temporary directories: the next --resume removes them
    stale = out / "checkpoints" / ".tmp-step_000004-99999"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    (out / ".tmp-model").mkdir()
    assert main(["train", "--out", str(out), "--resume"]) == 0
    assert "removed 2 unfinished save(s)" in capsys.readouterr().out
    assert not stale.exists() and not (out / ".tmp-model").exists()


# ---- --resume -----------------------------------------------------------------------------------------------------------
def test_resume_takes_the_saved_configuration(tmp_path, finished_run, corpus, captured_config):
    out = copy_run(finished_run, tmp_path)
    with pytest.raises(Captured):
        main(["train", "--out", str(out), "--resume"])
    cfg = captured_config["cfg"]
    got = {k: getattr(cfg, k) for k in ("max_steps", "batch_size", "seq_len", "warmup_steps", "lr", "balance", "seed",
                                        "save_every", "eval_every", "corpus", "preset", "optimizer", "resume")}
    assert got == dict(max_steps=3, batch_size=2, seq_len=16, warmup_steps=1, lr=0.02, balance="sign", seed=3,
                       save_every=1, eval_every=100, corpus=corpus, preset="tiny", optimizer="muon", resume=True)
    # a flag that repeats the saved value is no contradiction; one that changes an evaluation setting is honoured
    with pytest.raises(Captured):
        main(["train", "--out", str(out), "--resume", "--max-steps", "3", "--eval-every", "7"])
    assert (captured_config["cfg"].max_steps, captured_config["cfg"].eval_every) == (3, 7)


@pytest.mark.parametrize("flag", [["--max-steps", "5"], ["--batch-size", "4"], ["--seq-len", "32"],
                                  ["--warmup-steps", "20"], ["--lr", "0.01"], ["--preset", "small"],
                                  ["--optimizer", "adamw"], ["--balance", "quantile"], ["--seed", "0"],
                                  ["--qat"], ["--grad-accum", "2"]])
def test_resume_refuses_a_flag_that_contradicts_the_saved_run(tmp_path, capsys, finished_run, flag):
    out = copy_run(finished_run, tmp_path)
    before = snapshot(out)
    assert main(["train", "--out", str(out), "--resume", *flag]) == 2
    line = error_line(capsys)
    assert f"--resume: {flag[0]} " in line and "contradicts the saved run" in line
    assert snapshot(out) == before


def test_library_resume_refuses_a_contradicting_config(tmp_path, finished_run, corpus):
    out = copy_run(finished_run, tmp_path)
    cfg = TrainConfig(out=str(out), resume=True, corpus=corpus, max_steps=9, batch_size=2, seq_len=16, warmup_steps=1,
                      lr=0.02, balance="sign", seed=3)
    with pytest.raises(RunDirError, match=r"--max-steps 9 contradicts the saved run .*\(--max-steps 3\)"):
        Trainer(cfg, log=lambda *a: None)


def damage(ckpt: Path, what: str) -> str:
    """Damages one file of a checkpoint; returns its name."""
    if what == "trainer_state.pt":
        (ckpt / what).write_bytes(b"PK\x03\x04 not a zip archive")
        return what
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated: a disk that filled or a copy cut short
    return shard.name


@pytest.mark.parametrize("what", ["trainer_state.pt", "shard"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, capsys, finished_run, what):
    out = copy_run(finished_run, tmp_path)
    first_losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    name = damage(out / "checkpoints" / "step_000003", what)
    assert main(["train", "--out", str(out), "--resume"]) == 0
    captured = capsys.readouterr()
    warnings = [l for l in captured.err.splitlines() if "warning" in l]
    assert len(warnings) == 1 and warnings[0].startswith("k3 train: warning: checkpoint step_000003 is damaged")
    assert name in warnings[0]
    assert "resumed from" in captured.out and "step_000002 at step 2" in captured.out
    assert [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()] == first_losses  # exact
    load_pretrained(out / "checkpoints" / "step_000003")  # the damaged one was replaced by a whole one


def test_damaged_trainer_state_is_named_when_no_checkpoint_is_left(tmp_path, capsys, finished_run):
    out = copy_run(finished_run, tmp_path)
    for step in ("step_000001", "step_000002"):
        shutil.rmtree(out / "checkpoints" / step)
    damage(out / "checkpoints" / "step_000003", "trainer_state.pt")
    assert main(["train", "--out", str(out), "--resume"]) == 2
    line = error_line(capsys)
    assert f"corrupt {out / 'checkpoints' / 'step_000003' / 'trainer_state.pt'}" in line


def test_resume_without_a_run_is_refused(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert "--resume: no complete checkpoint under" in error_line(capsys)
    assert not (tmp_path / "nothing").exists()


# ---- --task vision ------------------------------------------------------------------------------------------------------
def refused_by_vision() -> dict[str, list[str]]:
    """Every `k3 train` flag that --task vision does not honour, with a value it cannot take: read from the
    parser, so a flag added later is covered too."""
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    cases = {}
    for a in train._actions:
        if a.dest in ("help", "task", *_VISION_FLAGS):
            continue
        flag = a.option_strings[0]
        if a.nargs == 0:
            cases[flag] = [flag]
        elif a.choices:  # a choice other than the one the vision task trains with
            cases[flag] = [flag, next(c for c in a.choices if c != _VISION_FIXED.get(a.dest))]
        else:
            cases[flag] = [flag, "small" if a.dest == "preset" else "2"]
    return cases


REFUSED_WITH_VISION = refused_by_vision()


def test_the_refused_flags_are_the_expected_ones():
    for flag in ("--preset", "--resume", "--qat", "--nproc", "--dp", "--ep", "--cp", "--fsdp", "--corpus",
                 "--tokenizer", "--seq-len", "--grad-accum", "--optimizer", "--balance", "--save-every",
                 "--activation-checkpointing"):
        assert flag in REFUSED_WITH_VISION


@pytest.mark.parametrize("flag", list(REFUSED_WITH_VISION))
def test_vision_refuses_flags_it_cannot_honour(tmp_path, capsys, flag):
    assert main(["train", "--task", "vision", "--out", str(tmp_path / "v"), *REFUSED_WITH_VISION[flag]]) == 2
    line = error_line(capsys)
    assert line.startswith(f"k3 train: error: {flag}") and "does not apply to --task vision" in line
    assert not (tmp_path / "v").exists()


def test_vision_honours_its_flags(tmp_path, monkeypatch):
    import k3.vision.train_vision as tv
    seen = {}

    def run(cfg):
        seen["cfg"] = cfg
        raise Captured

    monkeypatch.setattr(tv, "run", run)
    with pytest.raises(Captured):
        main(["train", "--task", "vision", "--out", "runs/tiny", "--max-steps", "7", "--batch-size", "3", "--lr", "0.1",
              "--eval-every", "5", "--warmup-steps", "2", "--time-budget", "9", "--seed", "4", "--device", "cpu",
              "--overwrite", "--preset", "tiny", "--optimizer", "adamw", "--balance", "quantile"])
    c = seen["cfg"]
    assert (c.out, c.max_steps, c.batch_size, c.lr, c.eval_every, c.warmup_steps, c.time_budget, c.seed, c.device,
            c.overwrite) == ("runs/tiny", 7, 3, 0.1, 5, 2, 9.0, 4, "cpu", True)


def test_vision_run_refuses_a_used_out_dir(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert main(["train", "--task", "vision", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is not empty" in error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_resume_relaunches_the_saved_process_layout(tmp_path, monkeypatch):
    """A run trained with --nproc 2 --ep 2 is resumed on 2 processes without being told (each process then takes
    --ep 2 from the saved run, as the launcher did)."""
    import subprocess

    import torch
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    saved = {**TrainConfig(out=str(tmp_path / "run")).__dict__, "dp": 2, "ep": 2, "max_steps": 9}
    torch.save({"step": 4, "train_config": saved}, ckpt / "trainer_state.pt")  # what the launcher reads first
    launched = {}
    monkeypatch.setattr(subprocess, "call", lambda argv: launched.setdefault("argv", argv) and 0)
    monkeypatch.setattr(sys, "argv", ["k3", "train", "--out", str(tmp_path / "run"), "--resume"])
    assert main(sys.argv[1:]) == 0
    argv = launched["argv"]
    assert "--nproc-per-node=2" in argv and argv[-2:] == ["--dp", "2"]
    assert argv[argv.index("train") + 1:-2] == ["--out", str(tmp_path / "run"), "--resume"]
