"""k3.train.compiled_regions (`k3 train --compile`): the training step with its KDA, MLA, MoE and dense MLP forwards
compiled equals the eager step (loss, every gradient, the router scores the balancer reads), with activation
checkpointing too; each kind is one fullgraph graph (a break is an error) that every layer of the kind reuses;
recompiles stay bounded and one past the limit raises instead of quietly running eagerly.

The graphs go through aot_eager (AOTAutograd's traced backward, no C compiler); one test runs inductor itself. One
module fixture compiles `tiny` once for the equality asserts: compiling is most of this file's time."""
import copy
import dataclasses
import shutil

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from random_model import randomize_trivial_parts

from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiHeadLatentAttention
from k3.model.mlp import SiTUMLP
from k3.model.moe import LatentMoE
from k3.train import compiled_regions
from k3.train.compiled_regions import compile_regions
from k3.train.optim import build_optimizer
from k3.train.trainer import TrainConfig, Trainer

KINDS = 4  # KDA mixer, MLA mixer, LatentMoE, dense MLP


class GraphLog:
    """A torch.compile backend that counts the graphs it is given and the calls of each, then runs them through
    aot_eager."""

    def __init__(self):
        self.graphs, self.calls = 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        run = lookup_backend("aot_eager")(gm, example_inputs)

        def counted(*args):
            self.calls += 1
            return run(*args)
        return counted


def make_model(seed: int = 0, layers: int | None = None) -> K3ForCausalLM:
    config = K3Config.preset("tiny")
    if layers is not None:  # MLA every fourth layer, as in K3
        la = config.linear_attn_config
        full = list(range(4, layers + 1, 4))
        kda = [l for l in range(1, layers + 1) if l not in full]
        config = config.replace(num_hidden_layers=layers, linear_attn_config=dict(
            dataclasses.asdict(la), full_attn_layers=full, kda_layers=kda))
    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    model.reset_parameters(seed=seed)
    randomize_trivial_parts(model, torch.Generator().manual_seed(seed + 1), bias_scale=0.01, norm_scale=0.1)
    return model.train()


def batch(B: int, T: int, seed: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    doc_ids = (torch.rand(B, T, generator=g) < 0.1).long().cumsum(1)  # packed documents: MLA's masks, KDA's splits
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "doc_ids": doc_ids}


def run_step(model, b) -> tuple[float, list[torch.Tensor]]:
    """Forward + backward: (loss, the router scores of every MoE layer)."""
    loss = model(b["input_ids"], doc_ids=b["doc_ids"], labels=b["labels"]).loss
    loss.backward()
    scores = [m.last_scores.clone() for m in model.modules() if isinstance(m, LatentMoE)]
    return float(loss.detach()), scores


def assert_same_gradients(pairs, bar: float) -> None:
    """Per parameter (name, None where the reference has no gradient, else (got, want)): the gradient equal to the
    reference's within fp32 reordering: elementwise to `bar` times its largest entry, and in norm to `bar` of its
    norm."""
    for name, grads in pairs:
        if grads is None:  # (layer 0's first mix has no blocks to read: its weights get no gradient)
            continue
        got, want = grads
        assert got is not None, name
        scale = float(want.abs().max())
        assert scale > 0, name  # a gradient that vanished would compare equal for nothing
        torch.testing.assert_close(got, want, rtol=0, atol=bar * scale, msg=lambda m: f"{name}: {m}")
        assert float((got - want).norm()) <= bar * float(want.norm()), name


def gradient_pairs(got_model, want_model) -> list:
    """`assert_same_gradients`' pairs of two models' gradients (copies: an optimizer step may write into them)."""
    return [(name, None if want.grad is None else (got.grad.clone(), want.grad.clone()))
            for (name, want), got in zip(want_model.named_parameters(), got_model.parameters())]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """One compile of `tiny` that the equality asserts share (compiling is most of this file's time): three eager
    and compiled steps, each from the eager model's updated weights: T=32 plain (each kind's first graph), T=48
    under activation checkpointing (the dynamic-shape graph), T=24 plain (the dynamic graph again, no compile).
    Then the trainer, eager and with TrainConfig(compile=True), on those graphs (its model is another `tiny`: the
    kinds' graphs serve it). Last, one MoE layer's routed scaling is changed, which needs a third graph of its kind:
    past the default limit."""
    torch._dynamo.reset()
    eager = make_model()
    compiled = copy.deepcopy(eager)
    log = GraphLog()
    regions = compile_regions(compiled, backend=log)
    opt = build_optimizer(eager, "muon", lr=0.02, weight_decay=0.1)
    vocab = eager.config.vocab_size
    runs = []
    for step, (T, checkpointing) in enumerate(((32, False), (48, True), (24, False))):
        for m in (eager, compiled):
            m.model.gradient_checkpointing = checkpointing
        b = batch(2, T, seed=step, vocab=vocab)
        want_loss, want_scores = run_step(eager, b)
        calls, graphs = log.calls, log.graphs
        got_loss, got_scores = run_step(compiled, b)
        runs.append(dict(T=T, checkpointing=checkpointing, calls=log.calls - calls, new_graphs=log.graphs - graphs,
                         loss=(got_loss, want_loss), scores=(got_scores, want_scores),
                         grads=gradient_pairs(compiled, eager)))
        # the next step from the same new weights (Adam's g/sqrt(v) turns a gradient's last-bit differences, where
        # it is ~0, into lr-sized ones: two optimizers would compare the optimizer, not the step)
        opt.step()
        compiled.load_state_dict(eager.state_dict())
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            m.model.gradient_checkpointing = False
    graphs = log.graphs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_regions, "compile_regions", lambda model: compile_regions(model, backend=log))
        trainer = {}
        for compile in (False, True):
            calls = log.calls
            trainer[compile] = dict(losses=trainer_losses(tmp_path_factory.mktemp("train"), compile),
                                    calls=log.calls - calls)
        trainer["new_graphs"] = log.graphs - graphs
    moes = [m for m in compiled.modules() if isinstance(m, LatentMoE)]
    moes[-1].scale = moes[-1].scale * 2
    try:
        run_step(compiled, batch(2, 24, seed=0, vocab=vocab))
        past_limit = None
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        past_limit = e
    yield dict(regions=regions, runs=runs, graphs=graphs, trainer=trainer, past_limit=past_limit)
    torch._dynamo.reset()


def test_every_layer_of_a_kind_runs_its_kinds_graph(steps):
    """Each kind is compiled twice (its first shapes, then dynamic shapes) and every layer of the kind, at any
    length, runs that graph: 12 regions of `tiny`, every one called in every compiled forward."""
    regions = steps["regions"]
    assert len(regions) == 12  # tiny: KDA at layers 0, 1, 2, 4, MLA at 3 and 5, MoE at 1..5, the dense MLP at 0
    assert {type(m) for m in regions} == {KimiDeltaAttention, MultiHeadLatentAttention, LatentMoE, SiTUMLP}
    assert [r["new_graphs"] for r in steps["runs"]] == [KINDS, KINDS, 0]
    assert steps["graphs"] == 2 * KINDS
    for r in steps["runs"]:  # every region's forward ran its graph (recomputed once more under checkpointing)
        assert r["calls"] == len(regions) * (2 if r["checkpointing"] else 1), r["T"]


@pytest.mark.parametrize("run", [0, 1, 2], ids=["T32", "T48-activation-checkpointing", "T24"])
def test_compiled_step_equals_eager_step(steps, run):
    """Loss, router scores (what the balancer reads) and every gradient of the compiled step equal the eager
    step's within fp32 reordering."""
    r = steps["runs"][run]
    got, want = r["loss"]
    assert got == pytest.approx(want, rel=1e-6)
    for got, want in zip(*r["scores"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert_same_gradients(r["grads"], bar=2e-5)


def test_a_recompile_past_the_limit_raises(steps):
    """A layer whose configuration differs from its kind's (here one MoE's routed scaling) needs a graph of its own:
    past the limit (the first shapes and the dynamic ones) that is an error, not a silent fall back to eager code."""
    assert isinstance(steps["past_limit"], torch._dynamo.exc.FailOnRecompileLimitHit)


def test_evaluation_and_generation_stay_eager():
    model = make_model()
    log = GraphLog()
    compile_regions(model, backend=log)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    model.eval()
    with torch.no_grad():
        model(ids)
    model.generate(ids, max_new_tokens=3, temperature=0.0)
    model.train()
    with torch.no_grad():
        model(ids)
    assert log.graphs == 0 and log.calls == 0


def test_regions_are_not_compiled_twice():
    model = make_model()
    compile_regions(model, backend=GraphLog())
    with pytest.raises(ValueError, match="already has its own forward"):
        compile_regions(model, backend=GraphLog())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_step_equals_eager():
    """inductor's own code (C++ kernels) for the regions of a one-layer model: the KDA mixer, whose short convs and
    core are custom-op calls that inductor lays out around by their fake kernels (packed documents in play), and the
    dense MLP. Inductor's MLA and MoE code runs in the CUDA test (each kind's C++ build costs ~40 s of this file's
    CPU time); their graphs are the ones aot_eager runs above."""
    eager = make_model(seed=4, layers=1)
    compiled = copy.deepcopy(eager)
    regions = compile_regions(compiled)  # torch.compile's default backend
    assert {type(m) for m in regions} == {KimiDeltaAttention, SiTUMLP}
    b = batch(2, 32, seed=4, vocab=eager.config.vocab_size)
    want_loss, _ = run_step(eager, b)
    got_loss, _ = run_step(compiled, b)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert_same_gradients(gradient_pairs(compiled, eager), bar=1e-4)


def trainer_losses(out, compile: bool) -> list[float]:
    """Two steps' losses of a Trainer of `tiny` (packed documents, AdamW warmup)."""
    cfg = TrainConfig(out=str(out), max_steps=2, batch_size=2, seq_len=16, warmup_steps=1, seed=5, compile=compile)
    t = Trainer(cfg, log=lambda *a: None)
    return [t.train_step()["loss"] for _ in range(2)]


def test_trainer_compile_switch(steps):
    """TrainConfig(compile=True) trains through the regions (every region's graph called in each of its two steps)
    with the eager run's losses; the eager run calls none."""
    t = steps["trainer"]
    assert t[False]["calls"] == 0 and t[True]["calls"] == 2 * 12
    assert t["new_graphs"] == 0  # the graphs compiled above served the trainer's model
    assert t[True]["losses"] == pytest.approx(t[False]["losses"], rel=1e-5)


def test_compile_with_expert_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"--compile=True: does not combine with --ep > 1"):
        TrainConfig(compile=True, dp=2, ep=2).validate()


def fsdp_worker(rank, world, b):
    """One FSDP2 rank (dp=2) of the float64 harness model with its regions compiled: (full gradients after one step
    of the global batch, the compiled graphs' calls)."""
    from parallel_harness import make_model as harness_model

    from k3.parallel import ParallelDims, ParallelMesh
    from k3.parallel.fsdp import full_gradients
    from k3.parallel.parallelize import ParallelK3

    model = harness_model(0).train()
    runner = ParallelK3(model, ParallelMesh(ParallelDims(dp=world)), fsdp=True)
    log = GraphLog()
    compile_regions(model, backend=log)
    runner(**b).loss.backward()
    runner.sync_gradients()
    grads = {n: g.detach().clone() for n, g in full_gradients(model).items()}
    return {"grads": grads, "calls": log.calls, "sharded": any(hasattr(p, "full_tensor") for p in model.parameters())}


def test_compiled_regions_under_fsdp2_equal_one_eager_process(single_thread):
    from parallel_harness import launch, make_model as harness_model

    b = batch(4, 24, seed=7, vocab=harness_model(0).config.vocab_size)
    results = launch(fsdp_worker, 2, b)
    model = harness_model(0).train()
    model(**b).loss.backward()
    for res in results:
        assert res["sharded"] and res["calls"] == 12  # FSDP2 was on, and every region ran compiled
        for name, p in model.named_parameters():
            if p.grad is None:
                assert name not in res["grads"], name
                continue
            torch.testing.assert_close(res["grads"][name], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_cli_refuses_compile_with_expert_parallelism_before_launching(capsys):
    from k3.cli import main

    assert main(["train", "--nproc", "2", "--ep", "2", "--compile", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3 train: error: --compile does not combine with --ep > 1"), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_step_through_inductor_is_as_close_to_fp32_as_the_eager_step():
    """On CUDA under the trainer's bf16 autocast the regions replace k3's Triton kernels by inductor's code: each
    gradient's error against an fp32 eager step stays within 3x the eager bf16 step's own error (+0.1% of its norm)."""
    ref = make_model(seed=6).cuda()
    eager, compiled = copy.deepcopy(ref), copy.deepcopy(ref)
    compile_regions(compiled)
    b = {k: v.cuda() for k, v in batch(4, 256, seed=6, vocab=ref.config.vocab_size).items()}
    want, _ = run_step(ref, b)
    losses = {}
    for name, m in (("eager", eager), ("compiled", compiled)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses[name] = run_step(m, b)[0]
    assert abs(losses["compiled"] - want) <= 3 * abs(losses["eager"] - want) + 1e-3 * abs(want), (losses, want)
    for (name, r), e, c in zip(ref.named_parameters(), eager.parameters(), compiled.parameters()):
        if r.grad is None:
            continue
        err_e, err_c = float((e.grad - r.grad).norm()), float((c.grad - r.grad).norm())
        assert err_c <= 3 * err_e + 1e-3 * float(r.grad.norm()), (name, err_c, err_e)


def test_cpu_compile_without_a_cxx_compiler_is_refused_up_front(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    from torch._inductor import config as inductor_config
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "g++-that-is-not-there"))
    model = make_model()
    with pytest.raises(ValueError, match=r"--compile on the CPU needs a C\+\+ compiler"):
        compile_regions(model)
    assert not any("forward" in vars(m) for m in model.modules())  # nothing was changed


def test_the_decode_steps_compile_still_takes_the_model_whole():
    """GraphedDecodeStep compiles model.model for decoding (fullgraph): over the regions' forwards it still traces
    one graph, the eager branch of each, and decodes as the model without regions does."""
    plain = make_model(seed=8, layers=4).eval()  # (KDA, MLA, dense MLP, MoE: each kind, a shorter trace)
    model = copy.deepcopy(plain)
    log = GraphLog()
    compile_regions(model, backend=log)
    graphs = []
    core = torch.compile(model.model, fullgraph=True, backend=lambda gm, ex: graphs.append(gm) or gm.forward)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(8))
    out = {}
    with torch.no_grad():
        for name, m, step in (("plain", plain, plain.model), ("compiled", model, core)):
            cache = m.new_cache(2, 8)
            m(ids[:, :5], cache=cache)
            hs = []
            for t in range(5, 8):
                hs.append(step(ids[:, t:t + 1], cache=cache))
                cache.advance(1)
            out[name] = torch.cat(hs, 1)
    assert len(graphs) == 1 and log.graphs == 0
    torch.testing.assert_close(out["compiled"], out["plain"], rtol=1e-5, atol=1e-5)
