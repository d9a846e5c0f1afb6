"""`k3 bench serve` end to end on a tiny random K3 (CPU): a real server, clients in their own process, both
datasets and the static baseline. Its summaries must add up: every request answered with exactly
--output-len tokens, first tokens before the ends, and the second chat turn served partly from the cache."""
import json

import pytest

from k3.cli import main


ALL_ROWS = {"engine random c=2", "engine multiturn c=2", "static generate batch=2"}


# the synchronous run (--no-async-output; async output is the default) takes the multi-turn dataset only (its prefix
# hits are where the two paths differ most) and no static baseline: each dataset costs two client processes
@pytest.mark.parametrize("flags, runs", [([], ALL_ROWS),
                                         (["--no-async-output", "--dataset", "multiturn", "--no-baseline"],
                                          {"engine multiturn c=2"})])
def test_bench_serve_runs_every_dataset_and_the_baseline(tmp_path, flags, runs):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--preset", "tiny", "--concurrency", "2", "--num-prompts", "4",
               "--prompts-per-concurrency", "2", "--input-len", "12", "--output-len", "5", "--turns", "2",
               "--block-size", "16", "--match-unit", "4", "--json", str(out), *flags])
    assert rc == 0
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    assert set(rows) == runs
    for name, r in rows.items():
        assert r["requests"] == 4 and r["failed"] == 0 and r["wrong_length"] == 0 and r["problems"] == [], name
        assert abs(r["out_tok_per_s"] * r["wall_s"] - 4 * 5) < 1e-6, name  # 4 requests x 5 tokens
    for name in runs - {"static generate batch=2"}:
        r = rows[name]
        assert 0 < r["ttft_ms"]["mean"] < r["e2e_ms"]["mean"], name
        assert r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["median"] > 0, name
        e = r["engine"]  # the engine's own trace of the timed run: every request prefilled and decoded in it
        assert e["prompt"]["steps"] >= 1 and e["decode"]["steps"] >= 4, name  # 5 tokens: 4 decode steps at least
        assert 0 < e["step_s"] < r["wall_s"] and e["idle_s"] > -1e-3, name
        assert e["intake_s"] > 0, name  # 4 requests were taken in
        # the engine sees a request after the client sent it and hands its first token over before the client reads it
        assert 0 < e["engine_ms"]["ttft"] < r["ttft_ms"]["mean"], name
    assert rows["engine multiturn c=2"]["hit_rate"] > 0.2  # turn 2 resumes turn 1's checkpointed prefix


def test_bench_serve_warm_up_uses_every_graph_key_the_timed_run_uses(tmp_path):
    """With --prefill-graphs (on CPU the same per-bucket pieces run eagerly, keyed as on CUDA), no prefill bucket
    is first used while timed: on CUDA each first use is a capture inside the timed figures."""
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--preset", "tiny", "--concurrency", "2", "--num-prompts", "4",
               "--prompts-per-concurrency", "2", "--input-len", "12", "--output-len", "5",
               "--block-size", "16", "--match-unit", "4", "--prefill-graphs", "--dataset", "random",
               "--max-batch-tokens", "64", "--no-baseline", "--json", str(out)])  # buckets 16, 32, 64: a fast warm-up
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["graph_keys"] > 0  # the prefill buckets were in use: the count below is not vacuous
    assert row["graphs_first_used"] == 0


def test_profile_engine_lists_the_engine_steps_functions(capsys):
    """`--profile-engine N`: the timed run's engine steps under cProfile, in the engine's own process; its tables
    name the engine's step and at most N rows each."""
    from k3.cli import main
    code = main(["bench", "serve", "--quick", "--dataset", "random", "--no-baseline", "--profile-engine", "7"])
    out = capsys.readouterr().out
    assert code == 0
    assert "engine.py" in out and "(step)" in out and "Ordered by: internal time" in out
    tables = out.split("Ordered by:")[1:]
    assert len(tables) == 2 * 2  # --quick's two engine rows (concurrency 1 and 4): own time, then cumulative
    for t in tables:
        assert "List reduced from" in t and "to 7 due to restriction <7>" in t


@pytest.mark.parametrize("keep_alive", [True, False])
def test_load_generator_keeps_a_connection_per_stream_and_survives_closed_ones_and_long_lines(keep_alive):
    """run_load's session (aiohttp: httpx's pools made the load generator the bottleneck at 64 streams,
    benchmarks/bench_load_client.py): the server sees at most `concurrency` requests at once and, with keep-alive,
    no more connections over the whole run; a server that closes every connection after its response
    (Connection: close) still gets every request; a chunk longer than aiohttp's default line limit (64 KiB: long
    logprobs) is read whole."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from k3.serve.bench import run_load
    from k3.serve.local_server import local_server

    peers, live = set(), {"now": 0, "most": 0}

    async def completions(request):
        peers.add(request.client.port)
        n = (await request.json())["max_tokens"]
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])

        async def events():
            for i in range(n):
                text = "a" * (300_000 if i == 1 else 1)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": text, "token_ids": [i]}]}) + "\n\n"
                await asyncio.sleep(0.002)
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}) + "\n\n"
            yield "data: [DONE]\n\n"
            live["now"] -= 1
        headers = {} if keep_alive else {"Connection": "close"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with local_server(app) as url:
        out = asyncio.run(run_load(url, "m", "random", 12, 3, None, 4, 5, 1, None))
    assert out["requests"] == 12 and out["failed"] == 0 and out["wrong_length"] == 0
    assert live["most"] <= 3
    assert len(peers) <= 3 if keep_alive else len(peers) == 12  # kept connections reused; closed ones replaced
