"""The trainer: bit-exact resume, atomic checkpoints, and clear errors for bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.cli import main
from k3.train import trainer as trainer_mod
from k3.train.trainer import TrainConfig, Trainer


def small_run(out, corpus, **kw) -> TrainConfig:
    base = dict(out=str(out), corpus=corpus, max_steps=6, batch_size=2, seq_len=32, eval_every=100, eval_batches=1,
                save_every=3, warmup_steps=2, sample_tokens=4, seed=3, final_eval_batches=2)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, short_corpus):
    out = tmp_path_factory.mktemp("full")
    t = Trainer(small_run(out, short_corpus), log=lambda *a: None)
    t.run()
    return [h["loss"] for h in t.history], t


def test_resume_is_bit_exact(tmp_path, uninterrupted, short_corpus):
    full_losses, full = uninterrupted
    t = Trainer(small_run(tmp_path, short_corpus), log=lambda *a: None)
    t.history = [t.train_step() for _ in range(3)]  # a run stopped after step 3's checkpoint
    t.save_checkpoint()
    del t
    # the interrupted run had logged a step past its checkpoint, and was killed writing the next: resume keeps
    # neither (the torn line made it raise JSONDecodeError)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 0.0}) + "\n" + json.dumps({"step": 5, "loss": 1.25})[:15])
    resumed = Trainer(small_run(tmp_path, short_corpus, resume=True), log=lambda *a: None)
    resumed.run()
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5, 6]
    again = Trainer(small_run(tmp_path, short_corpus, resume=True), log=lambda *a: None)  # resuming a finished run
    assert again.run()["steps"] == 6
    assert resumed.step == 6
    resumed_losses = [h["loss"] for h in resumed.history[3:]]
    assert resumed_losses == full_losses[3:], (resumed_losses, full_losses[3:])
    # the final weights are identical too, including the balancing biases (buffers)
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_interrupted_save_is_never_resumed(tmp_path, monkeypatch, short_corpus):
    t = Trainer(small_run(tmp_path, short_corpus), log=lambda *a: None)
    t.train_step()
    good = t.save_checkpoint()
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    t.train_step()
    written = []

    def interrupted(obj, f, *a, **k):  # Ctrl-C while trainer_state.pt of the second checkpoint is written
        written.append(Path(f).parent)
        raise KeyboardInterrupt("simulated Ctrl-C")

    monkeypatch.setattr(trainer_mod.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint()
    monkeypatch.undo()
    assert written and written[0].name.startswith(".tmp-step_000002")  # the save had begun...
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]  # ...and left nothing
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before  # the previous checkpoint is untouched
    assert t.latest_checkpoint() == good
    r = Trainer(small_run(tmp_path, short_corpus, resume=True), log=lambda *a: None)
    r.load_checkpoint(r.latest_checkpoint())
    assert r.step == 1


def test_metrics_plots_and_summary_are_written(uninterrupted):
    _, t = uninterrupted
    lines = (t.out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == list(range(1, 7))
    assert "val_loss" in json.loads(lines[-1])
    summary = json.loads((t.out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["unigram_baseline"] > 5.0
    assert (t.out / "loss.png").stat().st_size > 1000 and (t.out / "expert_load.png").stat().st_size > 1000
    assert (t.out / "model" / "config.json").is_file() and (t.out / "model" / "tokenizer.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (["--lr", "-1"], "--lr"),
    (["--seq-len", "0"], "--seq-len"),
    (["--preset", "huge"], "unknown preset"),
    (["--max-steps", "abc"], "--max-steps"),
])
def test_bad_hyperparameters_fail_clearly(tmp_path, capsys, args, needle):
    try:
        code = main(["train", "--out", str(tmp_path), *args])
    except SystemExit as e:  # argparse's own rejection
        code = e.code
    assert code == 2
    assert needle in capsys.readouterr().err


def test_missing_and_corrupt_files_fail_clearly(tmp_path, capsys):
    out = str(tmp_path / "run")  # a directory of its own: a fresh run refuses one holding the inputs
    assert main(["train", "--out", out, "--corpus", str(tmp_path / "nope.jsonl.xz")]) == 2
    assert "nope.jsonl.xz" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl.xz"
    bad.write_bytes(b"not xz at all")
    assert main(["train", "--out", out, "--corpus", str(bad)]) == 2
    assert "bad.jsonl.xz" in capsys.readouterr().err
    tok = tmp_path / "tok.json"
    tok.write_text("{ broken")
    assert main(["train", "--out", out, "--tokenizer", str(tok)]) == 2
    assert "tok.json" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "fresh"), "--resume"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


class _RunsCode:
    """Unpickling this calls exec: what a hostile trainer_state.pt (a pickle) can make torch.load do."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_a_checkpoint_that_would_run_code_is_refused_and_never_runs(tmp_path, uninterrupted, capsys):
    """A run directory can come from anyone: resuming from one whose newest trainer state carries a payload (a
    valid state plus an object that runs code as it unpickles) names the file, runs nothing, and resumes from the
    checkpoint before it, saving the newest step again; a rank's state file is read the same way."""
    import shutil

    from k3.checkpoint.hf import CheckpointError
    from k3.train.run_dir import load_state_file
    _, t = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(t.out, out)
    newest = out / "checkpoints" / "step_000006" / "trainer_state.pt"
    state = torch.load(newest, weights_only=False)
    marker = tmp_path / "payload-ran"
    torch.save({**state, "extra": _RunsCode(marker)}, newest)
    rank_file = tmp_path / "rank_00000.pt"
    torch.save({"optimizer": {}, "rng": state["rng"], "layout": _RunsCode(marker)}, rank_file)

    with pytest.raises(CheckpointError, match="does not run code") as e:
        load_state_file(rank_file)
    assert "builtins.exec" in str(e.value) and str(rank_file) in str(e.value)
    assert main(["train", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert str(newest) in err and "does not run code" in err
    assert not marker.exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert load_state_file(newest)["step"] == 6 and "extra" not in load_state_file(newest)  # saved again, clean

def test_cli_error_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "k3.cli", "train", "--out", str(tmp_path), "--corpus", "/nonexistent.xz"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "/nonexistent.xz" in p.stderr



def test_generate_with_bad_sampling_writes_nothing_but_the_error(uninterrupted, capsys):
    _, t = uninterrupted
    assert main(["generate", "--model", str(t.out / "model"), "--prompt", "ROMEO:", "--temperature", "-1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "temperature must be a number >= 0" in err

def test_generate_streams_from_a_trained_model(uninterrupted, capsys):
    _, t = uninterrupted
    assert main(["generate", "--model", str(t.out / "model"), "--prompt", "ROMEO:", "--max-new-tokens", "5",
                 "--seed", "1", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:")
    # greedy CLI output equals the model's own greedy continuation
    ids = t.tokenizer.encode("ROMEO:", add_bos=True)
    from k3.model.decoder import K3ForCausalLM
    m = K3ForCausalLM.from_pretrained(t.out / "model")
    cont = m.generate(ids, max_new_tokens=5, eos_token_id=t.tokenizer.eos_id)[0, len(ids):].tolist()
    cont = cont[: cont.index(t.tokenizer.eos_id)] if t.tokenizer.eos_id in cont else cont
    assert out == "ROMEO:" + t.tokenizer.decode(cont, skip_special_tokens=True) + "\n"


def test_activation_checkpointing_trains_identically(tmp_path, uninterrupted, short_corpus):
    """Recomputing every layer in backward changes neither the losses nor the balancer's statistics."""
    full_losses, full = uninterrupted
    t = Trainer(small_run(tmp_path, short_corpus, activation_checkpointing=True), log=lambda *a: None)
    assert t.model.model.gradient_checkpointing
    recs = [t.train_step() for _ in range(3)]
    assert [r["loss"] for r in recs] == full_losses[:3]
    assert [r["maxvio"] for r in recs] == [h["maxvio"] for h in full.history[:3]]


@pytest.mark.parametrize("flag, field", [("--activation-checkpointing", "activation_checkpointing"),
                                         ("--compile", "compile")])
def test_cli_train_flags_reach_the_trainer(tmp_path, monkeypatch, flag, field):
    class Stop(Exception):
        pass

    seen = {}

    def trainer(cfg, **kw):
        seen["cfg"] = cfg
        raise Stop

    monkeypatch.setattr(trainer_mod, "Trainer", trainer)
    for flags, want in (([], False), ([flag], True)):
        with pytest.raises(Stop):
            main(["train", "--out", str(tmp_path), *flags])
        assert getattr(seen["cfg"], field) is want


def test_a_step_out_of_gpu_memory_says_how_to_fit_it(tmp_path, capsys, monkeypatch, short_corpus):
    """A CUDA out-of-memory in the training step (raised here from step 2 on) runs the step again once
    with fla's intermediates recomputed; out of memory again, it is one line naming the batch and the ways left to
    fit it, exit 2, no traceback; the checkpoints written before it stand and resume."""
    from k3.model.decoder import K3ForCausalLM

    real, calls = K3ForCausalLM.forward, []

    def forward(self, *a, **kw):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) >= 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB.")
        return real(self, *a, **kw)

    monkeypatch.setattr(K3ForCausalLM, "forward", forward)
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--corpus", short_corpus, "--max-steps", "4", "--save-every", "1",
                 "--eval-every", "100", "--batch-size", "2", "--seq-len", "32"])
    captured = capsys.readouterr()
    err = captured.err
    lines = [line for line in err.splitlines() if "error:" in line]  # (the rest: the progress bar)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    # (the first grad-enabled forward is k3 train's memory probe: the third is step 2's, run once more)
    assert len(calls) == 4 and "step 2 ran out of" in captured.out + err
    assert all(s in lines[0] for s in ("2 x 32 tokens", "ran out of", "--batch-size", "--activation-checkpointing")), lines
    assert "K3_FLA_KEEP_FORWARD=0" not in lines[0]  # (the second run already recomputed them)
    monkeypatch.setattr(K3ForCausalLM, "forward", real)
    assert main(["train", "--out", str(out), "--resume"]) == 0  # from step 2's checkpoint, to step 4
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_step_out_of_memory_with_fla_intermediates_kept_runs_again_recomputing_them(tmp_path, capsys,
                                                                                      monkeypatch, short_corpus):
    """An out-of-memory while fla's forward intermediates are kept (K3_FLA_KEEP_FORWARD, the default; raised here in
    step 2's second micro-batch) runs that step again on the same batches with them recomputed, and every step
    after it: the run ends as one that never ran out (the same losses, gradient norms, balancing and weights:
    nothing of the failed attempt was applied or counted twice)."""
    from safetensors.torch import load_file

    from k3 import envs
    from k3.model.decoder import K3ForCausalLM

    real = K3ForCausalLM.forward
    calls, kept_after = [], []

    def forward(self, *a, **kw):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) > 5:
                kept_after.append(envs.current().fla_keep_forward)
            # (call 1 is k3 train's memory probe; 2-3 step 1; 4-5 step 2's two micro-batches)
            if len(calls) == 5 and envs.current().fla_keep_forward:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB.")
        return real(self, *a, **kw)

    args = ["--corpus", short_corpus, "--max-steps", "4", "--eval-every", "100", "--batch-size", "2", "--seq-len",
            "32", "--grad-accum", "2", "--save-every", "100"]
    assert main(["train", "--out", str(tmp_path / "plain"), *args]) == 0
    monkeypatch.setattr(K3ForCausalLM, "forward", forward)
    assert main(["train", "--out", str(tmp_path / "oom"), *args]) == 0
    assert "step 2 ran out of" in capsys.readouterr().out
    assert len(calls) == 11 and kept_after == [False] * 6  # step 2 again from its first micro-batch, then 3 and 4

    def record(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["grad_norm"], r["load"]) for r in rows]

    assert record("oom") == record("plain")
    plain = load_file(str(next((tmp_path / "plain" / "model").glob("*.safetensors"))))
    oom = load_file(str(next((tmp_path / "oom" / "model").glob("*.safetensors"))))
    assert plain.keys() == oom.keys() and all(torch.equal(plain[k], oom[k]) for k in plain)
