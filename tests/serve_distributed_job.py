"""The serving workload the distributed-engine tests run twice, on one process and on N lockstep ranks, and the
rank entry points (torch.multiprocessing spawn through parallel_harness, or a torchrun node:
`python -m torch.distributed.run ... tests/serve_distributed_job.py MODEL_DIR OUT EP TP`)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import Tokenizer
from k3.serve import EngineConfig, SamplingParams
from k3.serve.grammar import Grammar, chat_grammar
from random_model import randomize_trivial_parts

# A small pool (preemption), an 8-token step budget (chunked prefill) and a 4-token match unit (prefix hits).
ENGINE = dict(memory_bytes=16 << 20, block_size=8, match_unit=4, max_batch_tokens=8, max_num_seqs=4, num_blocks=8)


def save_models(root: Path) -> Path:
    """A tiny random K3 with non-trivial AttnRes mixes and router bias, saved in float32 (bit-exact on reload)
    and with MXFP4 experts, beside the bundled tokenizer."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(1)
    randomize_trivial_parts(model, g, bias_scale=0.05)
    model.save_pretrained(root / "f32", dtype=None, max_shard_bytes=400_000)  # several shards: ranks skip some
    model.save_pretrained(root / "mxfp4", dtype=None, experts="mxfp4", max_shard_bytes=400_000)
    for d in ("f32", "mxfp4"):
        Tokenizer.from_file().save_pretrained(root / d)
    return root


def engine_config() -> EngineConfig:
    return EngineConfig(**ENGINE)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(10, 8000, (9,), generator=g).tolist()
    return [shared + torch.randint(10, 8000, (n,), generator=g).tolist() for n in (3, 6, 2)] + \
        [torch.randint(10, 8000, (11,), generator=g).tolist()]


def workload(engine) -> dict:
    """Three waves on one engine: greedy requests with logprobs (one scoring its prompt too) that outgrow the
    pool; two of the prompts again (prefix hits); then a seeded sampled request, a grammar-constrained one, and
    one aborted mid-way.
    Returns what a client sees of each request, plus the engine's preemption and prefix-hit counts."""
    greedy = SamplingParams(max_tokens=7, temperature=0.0, logprobs=2, ignore_eos=True)
    scored = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_k=50, seed=11, logprobs=0, ignore_eos=True)
    seen: dict[str, dict] = {}
    for i, (p, sp) in enumerate(zip(prompts(), [greedy, greedy, scored, greedy])):
        engine.add_request(p, sp, f"first-{i}")
    run(engine, seen)
    for i in (0, 1):  # again, one at a time: each restores its cached prefix
        engine.add_request(prompts()[i], greedy, f"again-{i}")
        run(engine, seen)
    engine.add_request(prompts()[0], sampled, "sampled")
    engine.add_request(prompts()[1], greedy, "aborted")
    tok = engine.tokenizer  # a JSON-object grammar: its matcher must cross to the other ranks and stay in step
    json_only = Grammar(tok, chat_grammar(tok, thinking=False, response_format={"type": "json_object"}))
    engine.add_request(prompts()[2], SamplingParams(max_tokens=8, seed=5, logprobs=0, grammar=json_only), "json")
    run(engine, seen, abort_at=3)
    return {"requests": seen, "preemptions": engine.scheduler.num_preemptions, "hits": engine.pool.stats["hits"]}


def run(engine, seen: dict, abort_at: int | None = None) -> None:
    """Step until done, keeping each request's tokens, logprobs and final state (abort 'aborted' at step abort_at)."""
    step = 0
    while engine.has_unfinished():
        if step == abort_at:
            seen["abort returned"] = engine.abort("aborted")
        for o in engine.step():
            r = seen.setdefault(o.request_id, {"ids": [], "logprobs": [], "top": []})
            r["ids"] += o.new_token_ids
            r["logprobs"] += [lp.logprob for lp in o.new_logprobs]
            r["top"] += [lp.top for lp in o.new_logprobs]
            if o.prompt_logprobs is not None:
                r["prompt_logprobs"] = [None if p is None else p.logprob for p in o.prompt_logprobs]
            if o.finished:
                r.update(text=o.text, finish=o.finish_reason, restored=o.cache.restored_tokens)
        step += 1


def serve_or_follow(engine, rank: int) -> dict | None:
    """Rank 0 runs the workload and closes the engine (the others' follow loops end with it); the others follow."""
    if rank != 0:
        engine.follow()
        return None
    got = workload(engine)
    engine.close()
    return got


def rank_job(rank: int, world: int, model_dir: str, layouts: list[tuple[int, int, bool]], device: str = "cpu") -> list:
    """For each (ep, tp, mxfp4?) in layouts: this rank's engine over the model directory; rank 0 runs the workload
    and returns it with what this rank holds (and the decode graphs it captured), the others follow."""
    from k3.model.moe import LatentMoE
    from k3.serve.distributed import ServeLayout, build_rank_engine

    results = []
    for ep, tp, mxfp4 in layouts:
        path = Path(model_dir) / ("mxfp4" if mxfp4 else "f32")
        engine = build_rank_engine(path, ServeLayout(world, ep, tp), engine_config(), device)
        moes = [m for m in engine.model.modules() if isinstance(m, LatentMoE)]
        held = {"rows": {(m.experts.w1_packed if m.experts.packed else m.experts.w1).shape[0] for m in moes},
                "packed": {m.experts.packed for m in moes}, "first": {m.combine_experts.first for m in moes},
                "vocab_rows": engine.model.lm_head.weight.shape[0]}
        runner = engine.runner
        got = serve_or_follow(engine, rank)
        graphs = runner.graphs.entries.values() if runner.graphs is not None else []
        held["captured_graphs"] = sum(graph is not None for _, graph, _ in graphs)
        results.append((got, held))
    return results


def assert_same_serving(got: dict, want: dict, atol: float = 1e-4) -> None:
    assert want["preemptions"] > 0 and want["hits"] > 0  # the workload really preempts and hits the cache
    assert (got["preemptions"], got["hits"]) == (want["preemptions"], want["hits"])
    assert want["requests"]["abort returned"] and "finish" not in want["requests"].get("aborted", {})
    assert got["requests"].keys() == want["requests"].keys()
    for rid, w in want["requests"].items():
        if not isinstance(w, dict):
            assert got["requests"][rid] == w
            continue
        g = got["requests"][rid]
        assert g["ids"] == w["ids"], rid
        assert [g.get(k) for k in ("text", "finish", "restored")] == [w.get(k) for k in ("text", "finish", "restored")]
        torch.testing.assert_close(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), rtol=1e-4, atol=atol)
        assert [[i for i, _ in t] for t in g["top"]] == [[i for i, _ in t] for t in w["top"]], rid
        if "prompt_logprobs" in w:
            assert g["prompt_logprobs"][0] is None and len(g["prompt_logprobs"]) == len(w["prompt_logprobs"])
            torch.testing.assert_close(torch.tensor(g["prompt_logprobs"][1:]), torch.tensor(w["prompt_logprobs"][1:]),
                                       rtol=1e-4, atol=atol)
    assert sum(r.get("restored", 0) for r in got["requests"].values() if isinstance(r, dict)) > 0


if __name__ == "__main__":  # one torchrun rank: MODEL_DIR OUT EP TP
    import torch.distributed as dist

    from k3.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed(120, "cpu")
    res = rank_job(dist.get_rank(), dist.get_world_size(), sys.argv[1], [(int(sys.argv[3]), int(sys.argv[4]), False)])
    torch.save(res, f"{sys.argv[2]}.{dist.get_rank()}")
    dist.destroy_process_group()
