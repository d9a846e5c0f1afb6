"""Tensor parallelism (k3.parallel.tensor_parallel) on 2 and 4 gloo processes against one process (float32):
the plain forward (rows and packed documents), K3Cache and StaticCache decode; the paged serving path through
LLMEngine with chunked prefill, prefix-cache hits, preemption by swapping, prompt logprobs and the fixed-shape
decode step (greedy tokens equal, logprobs close); a TP model built from a rank-sharded load equal bit for bit
to one sliced from the full load (MXFP4 experts dequantised and kept packed); and the refusals: head counts and
vocabularies T does not divide, a second split, another rank's shard, saving a rank's blocks as a checkpoint.
One spawned job per world size runs every check."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint.hf import load_pretrained
from k3.checkpoint.sharded import RankLayout, load_rank_shard
from k3.parallel.tensor_parallel import apply_tensor_parallel, load_tensor_parallel, model_from_rank_shard
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from parallel_harness import launch
from random_model import randomize_trivial_parts

GREEDY = dict(temperature=0.0)


def make_model(config: K3Config | None = None) -> K3ForCausalLM:
    """The tiny preset (4 KDA and 4 MLA heads, vocabulary 8192) in float32, every mix and gate non-trivial."""
    torch.manual_seed(0)
    model = K3ForCausalLM(config or K3Config.preset("tiny"))
    model.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(1)
    randomize_trivial_parts(model, g, bias_scale=0.01)
    return model.eval()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(10, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def forward_checks(model) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 8192, (2, 13), generator=g).to(model.device)
    docs = torch.tensor([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4], device=model.device)
    with torch.no_grad():
        out = {"logits": model(ids).logits, "packed": model(ids, doc_ids=docs).logits,
               "generate": model.generate(ids[:1, :7], max_new_tokens=6, eos_token_id=None)}
        cache = model.new_cache(2, 13)  # the preallocated cache of graphed decoding: a prefill, then steps
        steps = [model(ids[:, :7], cache=cache, logits_to_keep=1).logits[:, -1]]
        steps += [model(ids[:, t:t + 1], cache=cache).logits[:, -1] for t in range(7, 13)]
        out["static"] = torch.stack(steps, 1)
        out["static_state"] = tuple(cache.layers[1].state.shape)
    return out


def run_engine(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    """Every request to completion; per request its tokens, each sampled token's (logprob, top-3) and its
    prompt logprobs and cache report."""
    ids = [eng.add_request(p, params) for p in prompts]
    got = {i: {"lps": [], "tops": []} for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            rec = got[out.request_id]
            rec["lps"] += [t.logprob for t in out.new_logprobs]
            rec["tops"] += [[tid for tid, _ in t.top] for t in out.new_logprobs]
            if out.prompt_logprobs is not None:
                rec["prompt_lps"] = [None if t is None else t.logprob for t in out.prompt_logprobs]
            if out.finished:
                rec["tokens"] = list(out.output_ids)
                rec["restored"] = out.cache.restored_tokens
    return [got[i] for i in ids]


def serve_checks(model) -> dict:
    """The paged serving path: chunked prefill (7-token steps), prefix hits and prompt logprobs in one engine;
    preemption by swapping (7 blocks for three sequences) in another."""
    engine = lambda **kw: LLMEngine(model, None, EngineConfig(**{  # noqa: E731
        "memory_bytes": 16 << 20, "block_size": 16, "match_unit": 4, "max_num_seqs": 8, **kw}))
    eng = engine(max_batch_tokens=7, decode_graphs=True)  # (decode-only steps: the graphs' fixed-shape step)
    base = prompt(1, 30)
    first = run_engine(eng, [base], SamplingParams(max_tokens=6, logprobs=3, **GREEDY))
    hits = run_engine(eng, [base + prompt(2, 9), prompt(3, 11)],
                      SamplingParams(max_tokens=6, logprobs=3, **GREEDY))
    scored = run_engine(eng, [prompt(4, 20)], SamplingParams(max_tokens=3, logprobs=3, prompt_logprobs=2, **GREEDY))
    eng2 = engine(num_blocks=7, max_batch_tokens=64, prefix_caching=False)
    swapped = run_engine(eng2, [prompt(40 + i, 18) for i in range(3)], SamplingParams(max_tokens=20, logprobs=3,
                                                                                        **GREEDY))
    return {"requests": first + hits + scored + swapped, "preemptions": eng2.scheduler.num_preemptions,
            "swaps": eng2.pool.stats["swaps_in"], "kda_state": tuple(eng.pool.state[1].shape),
            "latents": tuple(eng.pool.kv[eng.pool.mla_layers[0]].shape),
            "fixed_shape_steps": len(eng.runner.graphs.entries),
            "captured_graphs": sum(graph is not None for _, graph, _ in eng.runner.graphs.entries.values())}


def loader_checks(path: str) -> dict:
    """TP from a rank-sharded load vs TP sliced from the full load: every tensor and the logits, bit for bit."""
    out = {}
    ids = torch.randint(0, 8192, (2, 11), generator=torch.Generator().manual_seed(9))
    for packed in (False, True):
        sharded = load_tensor_parallel(path, dtype=torch.float32, packed_experts=packed)
        sliced = apply_tensor_parallel(load_pretrained(path, dtype=torch.float32, packed_experts=packed))
        a, b = sharded.state_dict(), sliced.state_dict()
        with torch.no_grad():
            la, lb = sharded(ids).logits, sliced(ids).logits
        out[packed] = {"keys_equal": a.keys() == b.keys(),
                       "differ": [n for n in a
                                  if n not in b or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])],
                       "shapes": {n: tuple(t.shape) for n, t in a.items()},
                       "logits_equal": torch.equal(la, lb), "logits": la}
    rank, world = dist.get_rank(), dist.get_world_size()
    other = load_rank_shard(path, RankLayout(tp_rank=(rank + 1) % world, tp=world), dtype=torch.float32)
    try:  # another rank's blocks have this rank's shapes: only the layout tells them apart
        model_from_rank_shard(K3Config.from_pretrained(path), other)
        out["other_rank"] = None
    except ValueError as e:
        out["other_rank"] = str(e)
    return out


def refusal_checks(world: int) -> dict:
    """MLA head counts T does not divide (5 for T = 2, 6 for T = 4) and a vocabulary it does not divide (8191)."""
    out = {}
    heads = 5 if world == 2 else 6
    odd = K3Config.preset("tiny").replace(num_attention_heads=heads, num_key_value_heads=heads)
    for key, config in (("heads", odd), ("vocab", K3Config.preset("tiny").replace(vocab_size=8191))):
        model = make_model(config)
        before = {n: p.clone() for n, p in model.state_dict().items()}
        try:
            apply_tensor_parallel(model)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
        after = model.state_dict()
        out[key + "_untouched"] = before.keys() == after.keys() and all(torch.equal(before[n], after[n])
                                                                        for n in before)
    return out


def worker(rank, world, path):
    res = {"refusals": refusal_checks(world)}
    model = apply_tensor_parallel(make_model())
    kept = {n: t.clone() for n, t in model.state_dict().items()}
    try:  # a second slicing would cut the rank's blocks again
        apply_tensor_parallel(model)
        res["again"] = None
    except ValueError as e:
        res["again"] = str(e)
    res["again_untouched"] = all(torch.equal(kept[n], t) for n, t in model.state_dict().items())
    target = Path(path).parent / f"tp_save_{world}_{rank}"
    try:  # a rank's blocks saved as if they were the model would make a checkpoint nothing can load
        model.save_pretrained(target)
        res["save"] = None
    except ValueError as e:
        res["save"] = str(e)
    res["save_wrote"] = target.exists()
    res["local_heads"] = [layer.self_attn.num_heads for layer in model.model.layers]
    res["forward"] = forward_checks(model)
    res["serve"] = serve_checks(model)
    res["loader"] = loader_checks(path)
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_ckpt")
    make_model().save_pretrained(path, experts="mxfp4", max_shard_bytes=200_000)
    return path


@pytest.fixture(scope="module")
def reference(saved):
    model = make_model()
    return {"forward": forward_checks(model), "serve": serve_checks(model),
            "loaded": {p: load_pretrained(saved, dtype=torch.float32, packed_experts=p) for p in (False, True)}}


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_one_process(world, saved, reference):
    results = launch(worker, world, str(saved))
    H = 4  # tiny's KDA and MLA heads
    for rank, res in enumerate(results):
        assert res["local_heads"] == [H // world] * 6
        # the plain forward, packed documents and K3Cache decode
        assert res["forward"]["static_state"] == (2, H // world, 32, 32)
        for key in ("logits", "packed", "static"):
            torch.testing.assert_close(res["forward"][key], reference["forward"][key], rtol=1e-5, atol=1e-5)
        assert torch.equal(res["forward"]["generate"], reference["forward"]["generate"])
        # the serving path: the pool's KDA state holds the rank's heads, the MLA latents stay whole
        serve, ref = res["serve"], reference["serve"]
        assert serve["kda_state"] == (ref["kda_state"][0], H // world, *ref["kda_state"][2:])
        # (the same budget holds more latent blocks, as the slots are smaller)
        assert serve["latents"][1:] == ref["latents"][1:] and serve["latents"][0] > ref["latents"][0]
        assert serve["preemptions"] > 0 and serve["swaps"] > 0 and serve["fixed_shape_steps"] > 0
        assert [r["restored"] for r in serve["requests"]] == [r["restored"] for r in ref["requests"]]
        assert serve["requests"][1]["restored"] == 28  # the first prompt's checkpoint at its last match boundary
        for got, want in zip(serve["requests"], ref["requests"], strict=True):
            assert got["tokens"] == want["tokens"]
            assert got["tops"] == want["tops"]
            torch.testing.assert_close(torch.tensor(got["lps"]), torch.tensor(want["lps"]), rtol=0, atol=1e-4)
            assert ("prompt_lps" in got) == ("prompt_lps" in want)
            if "prompt_lps" in got:
                assert got["prompt_lps"][0] is None and len(got["prompt_lps"]) == 20
                torch.testing.assert_close(torch.tensor(got["prompt_lps"][1:]), torch.tensor(want["prompt_lps"][1:]),
                                           rtol=0, atol=1e-4)
        # rank-sharded load == slicing the full load, bit for bit, unpacked and packed experts
        assert res["loader"].pop("other_rank") == (f"the shard was loaded for TP rank {(rank + 1) % world} of "
                                                   f"{world}, but this process is TP rank {rank} of {world}")
        for packed, check in res["loader"].items():
            assert check["keys_equal"] and check["differ"] == [] and check["logits_equal"]
            full = reference["loaded"][packed]
            assert check["shapes"]["lm_head.weight"] == (8192 // world, 128)
            assert check["shapes"]["model.layers.1.self_attn.q_proj.weight"] == (128 // world, 128)
            torch.testing.assert_close(check["logits"], full(torch.randint(
                0, 8192, (2, 11), generator=torch.Generator().manual_seed(9))).logits.detach(), rtol=1e-5, atol=1e-5)
        # refusals: one line naming the heads (or the tensor) and T; the model untouched
        heads = 5 if world == 2 else 6
        assert res["refusals"]["heads"] == (
            f"tensor parallel size {world} must divide the attention heads: {heads} MLA heads (num_attention_heads), "
            f"4 KDA heads (linear_attn_config.num_heads)")
        assert f"tensor parallel size {world} must divide" in res["refusals"]["vocab"]
        assert "embed_tokens" in res["refusals"]["vocab"] and "8191" in res["refusals"]["vocab"]
        assert "\n" not in res["refusals"]["heads"] + res["refusals"]["vocab"]
        assert res["refusals"]["heads_untouched"] and res["refusals"]["vocab_untouched"]
        assert res["again"] == f"the model is already tensor parallel (size {world})" and res["again_untouched"]
        assert res["save"].startswith(f"this model is one rank of tensor parallelism of size {world}")
        assert not res["save_wrote"]


def test_refuses_what_is_not_a_k3_model():
    with pytest.raises(TypeError, match="apply_tensor_parallel takes a K3ForCausalLM, got Linear"):
        apply_tensor_parallel(torch.nn.Linear(4, 4))
