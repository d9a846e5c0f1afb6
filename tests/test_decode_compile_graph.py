"""The decode steps torch.compile takes whole: with fullgraph=True any graph break is an error, so these fail when a
Dynamo break creeps into the model (a data-dependent branch, `.item()`, a logger call, an import, an op whose fake
tensor rule refuses the inputs). Each compiled step equals the eager step and the full forward.

Compiled here as they are on a GPU: bench_gpu_decode's and GraphedDecodeStep's `torch.compile(model.model)` over a
StaticCache, and the serving engine's fixed-shape decode step (`DecodeGraphs._forward`, the step its CUDA graphs
capture) over the paged pool. `tiny` (fp32): KDA and MLA layers, a dense layer and MoE layers, AttnRes blocks; one
row takes the decode experts (a token's k experts read in place), four rows the grouped path."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the kernel test below)

from random_model import randomize_trivial_parts  # noqa: E402

from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.ops.fused_linear import fuse_projections  # noqa: E402
from k3.serve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

T, STEPS = 5, 3  # prompt tokens, decode steps


def graph_recorder(graphs: list):
    """A torch.compile backend that keeps each graph it is given and runs it as traced."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def ops_of(graphs) -> set[str]:
    return {str(n.target).removesuffix(".default") for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


def reseed(model, seed: int) -> None:
    """New random weights in place (the same modules: a step compiled once serves every seed), with non-zero AttnRes
    queries and KDA decay rates, so that every mix and gate matters."""
    model.reset_parameters(seed=seed)
    randomize_trivial_parts(model, torch.Generator().manual_seed(seed))
    fuse_projections(model)  # the stacked projections the compiled step reads (GraphedDecodeStep does the same)


def static_decode(model, core, ids):
    """Logits [STEPS, B, V] of decoding ids[:, T:] one token at a time over a StaticCache after a T-token prefill,
    each step `core(tokens, cache)` then the LM head (GraphedDecodeStep's compiled forward, without the graph)."""
    cache = model.new_cache(ids.shape[0], T + STEPS)
    model(ids[:, :T], cache=cache)
    out = []
    for t in range(T, T + STEPS):
        h = core(ids[:, t:t + 1], cache=cache)
        cache.advance(1)
        out.append(model.lm_head(h[:, -1]))
    return torch.stack(out)


@pytest.fixture(scope="module")
def compiled_core(model):
    torch._dynamo.reset()
    graphs = []
    return torch.compile(model.model, fullgraph=True, backend=graph_recorder(graphs)), graphs


@pytest.mark.parametrize("seed", [0, 1])
def test_static_cache_decode_step_compiles_as_one_graph_equal_to_eager_and_full_forward(model, compiled_core, seed):
    core, graphs = compiled_core
    reseed(model, seed)
    ids = torch.randint(0, model.config.vocab_size, (1, T + STEPS), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids).logits[:, T:].transpose(0, 1)
        eager = static_decode(model, model.model, ids)
        compiled = static_decode(model, core, ids)
    assert len(graphs) == 1  # one graph, traced once for both seeds and every step (no guard on the length)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, full, rtol=2e-4, atol=2e-4)
    assert torch.equal(compiled.argmax(-1), full.argmax(-1))


def engine_decode_logits(model, compile_backend=None):
    """Three requests (prompts of 5, 9 and 13 tokens, 4 greedy tokens each, decoding alike) through an engine
    whose decode-only steps take the fixed-shape step (4 rows over the pool, compiled with `compile_backend` when
    given): per decode step [(request id, position of its input token)] and the step's logits."""
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=16 << 20, block_size=16, match_unit=4,
                                              max_batch_tokens=64, max_num_seqs=4, decode_graphs=True))
    graphs = eng.runner.graphs
    if compile_backend is not None:
        graphs._forward = torch.compile(graphs._forward, fullgraph=True, backend=compile_backend)
    steps, run = [], graphs.run

    def recorded(seqs, ids=None):
        where = [(s.request_id, s.num_computed) for s in seqs]
        logits = run(seqs, ids)
        steps.append((where, logits.clone()))
        return logits
    graphs.run = recorded
    prompts = [torch.randint(10, 8192, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 13)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=STEPS + 1, temperature=0.0))
    tokens = {o.request_id: p + list(o.output_ids) for p, o in zip(prompts, outs)}
    return steps, tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_decode_step_compiles_as_one_graph_equal_to_eager_and_full_forward(model, seed):
    reseed(model, seed)
    torch._dynamo.reset()
    graphs = []
    with torch.no_grad():
        eager, _ = engine_decode_logits(model)
        compiled, tokens = engine_decode_logits(model, graph_recorder(graphs))
        full = {rid: model(torch.tensor([ids])).logits[0] for rid, ids in tokens.items()}
    assert len(graphs) == 1 and len(compiled) == STEPS + 1  # every decode step through the one graph
    for (where, got), (where_eager, want) in zip(compiled, eager):
        assert [pos for _, pos in where] == [pos for _, pos in where_eager]  # (request ids count on per engine)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        reference = torch.stack([full[rid][pos] for rid, pos in where])
        torch.testing.assert_close(got, reference, rtol=2e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("rows, experts_op", [(1, "k3.moe_selected_experts"), (2, "k3.moe_expert_major")])
def test_decode_step_with_the_decode_kernels_compiles_as_one_graph(monkeypatch, rows, experts_op):
    """K3_TRITON=all: the decode kernels (KDA's step, the AttnRes mix + norm with the router, the routed experts
    slot by slot at one row of `tiny`'s top-4 of 16, expert by expert at two, MLA's StaticCache
    attention with its kv norm, whose workspace must not grow a list the trace guards on, the decode GEMVs with the
    MoE's shared down + routed up pair) are custom ops in the
    one graph, KDA's kernel module first imported inside the trace (on a CPU the kernels are forced onto CPU tensors,
    run by Triton's interpreter), and the step equals the full forward."""
    pytest.importorskip("triton")
    import k3.model.attn_res as attn_res
    import k3.ops.gemv as gemv
    import k3.ops.mla_static_decode as mla_static_decode
    import k3.ops.moe_decode as moe_decode
    import k3.ops.router as router
    from k3.ops import kda_decode, triton_dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        real = triton_dispatch.use_triton_op
        ops = ("_router_triton", "_attn_res_norm_triton", "_attn_res_route_triton", "_mla_static_decode_triton",
               "_gemv_triton", "_moe_decode_triton", "_moe_expert_major_triton")
        forced = lambda x, name: name in ops if x.device.type == "cpu" else real(x, name)  # noqa: E731
        for module in (attn_res, router, mla_static_decode, gemv, moe_decode):
            monkeypatch.setattr(module, "use_triton_op", forced)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    reseed(model, 2)
    model.to(device)
    fuse_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (rows, T + STEPS), generator=torch.Generator().manual_seed(2))
    ids = ids.to(device)
    torch._dynamo.reset()
    graphs = []
    core = torch.compile(model.model, fullgraph=True, backend=graph_recorder(graphs))
    with torch.no_grad(), envs.override(triton_opt_in="all"), kda_decode.force_fused_decode(True):
        full = model(ids).logits[:, T:].transpose(0, 1)
        compiled = static_decode(model, core, ids)
    assert len(graphs) == 1
    # (the MoE layers' mix and router as one launch)
    assert {"k3.kda_decode_step", "k3.attn_res_mix_norm_route", "k3.attn_res_mix_norm", experts_op,
            "k3.mla_static_decode", "k3.decode_gemv", "k3.decode_gemv_pair"} <= ops_of(graphs), \
        sorted(ops_of(graphs))
    torch.testing.assert_close(compiled, full, rtol=2e-4, atol=2e-4)
    assert torch.equal(compiled.argmax(-1), full.argmax(-1))
