"""Distributed serving (k3.serve.distributed, k3.serve.expert_shard): one engine as N gloo ranks in lockstep,
routed experts sharded over the ranks. The engine's greedy tokens, logprobs, sampled tokens and prefix-cache
results equal the single-process engine's, with prefix hits, preemption, chunked prefill, an abort and a grammar in
play, on 2 and 4 spawned processes (experts sharded 2 and 4 ways, attention replicated or split 2 ways by heads),
MXFP4 experts kept packed, and on two torchrun "nodes"; `k3 serve --nproc 2`, and `k3 serve` as two torchrun
nodes, answer HTTP as `--nproc 1` does; a killed worker makes rank 0 report it and exit (and a killed rank 0 its
worker), as does a rank that fails to load; bad layouts are refused by flag."""
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.cli import main
from k3.data import Tokenizer
from k3.model.moe import LatentMoE
from k3.serve import LLMEngine
from k3.serve.expert_shard import ExpertShardCombine
from k3.serve.local_server import free_port
from live_serve import k3_serve, wait_until_healthy
from parallel_harness import launch
from serve_distributed_job import assert_same_serving, engine_config, rank_job, save_models, workload

E = 16  # the tiny preset's routed experts
REPO = Path(__file__).resolve().parents[1]
SERVE_FLAGS = ("--memory-gib", "0.25", "--block-size", "64", "--match-unit", "16")  # as live_serve.k3_serve's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def single(model_dir):
    """The single-process engine's workload on each checkpoint (MXFP4 experts dequantised, as `k3 serve` does)."""
    return {fmt: workload(LLMEngine(K3ForCausalLM.from_pretrained(model_dir / fmt).eval(),
                                    Tokenizer.from_file(), engine_config())) for fmt in ("f32", "mxfp4")}


def test_two_ranks_equal_one_process(model_dir, single):
    # experts 2 ways with attention replicated; experts 2 ways (packed MXFP4) with attention 2 ways by heads
    layouts = [(2, 1, False), (2, 2, True)]
    results = launch(rank_job, 2, str(model_dir), layouts)
    V = K3Config.preset("tiny").vocab_size
    for i, (ep, tp, mxfp4) in enumerate(layouts):
        got, held0 = results[0][i]
        _, held1 = results[1][i]
        assert_same_serving(got, single["mxfp4" if mxfp4 else "f32"])
        assert held0["rows"] == held1["rows"] == {E // ep}  # each rank holds only its experts
        assert held0["packed"] == held1["packed"] == {mxfp4}
        assert (held0["first"], held1["first"]) == ({0}, {E // 2})
        assert held0["vocab_rows"] == held1["vocab_rows"] == V // tp


def test_four_ranks_equal_one_process(model_dir, single):
    # experts 4 ways; attention by heads over {0, 1} and over {2, 3} (two copies)
    results = launch(rank_job, 4, str(model_dir), [(4, 2, False)])
    assert_same_serving(results[0][0][0], single["f32"])
    assert [r[0][1]["first"] for r in results] == [{rank * E // 4} for rank in range(4)]
    assert {n for r in results for n in r[0][1]["rows"]} == {E // 4}
    assert {r[0][1]["vocab_rows"] for r in results} == {K3Config.preset("tiny").vocab_size // 2}


def test_two_torchrun_nodes_equal_one_process(model_dir, single, tmp_path):
    port, out = free_port(), tmp_path / "res"
    env = {**os.environ, "K3_CPU_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "tests"),
                                                                                 os.environ.get("PYTHONPATH", "")])}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(REPO / "tests" / "serve_distributed_job.py"), str(model_dir), str(out), "2", "1"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [n.communicate(timeout=180)[0].decode() for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    got, held = torch.load(f"{out}.0", weights_only=False)[0]
    assert_same_serving(got, single["f32"])
    assert held["first"] == {0} and torch.load(f"{out}.1", weights_only=False)[0][1]["first"] == {E // 2}


def test_shard_partials_sum_to_the_full_combine(model_dir):
    """Each rank's share (sparse: only its slots; masked: every slot, others' weighted 0) sums to the one-process
    routed output, for float and packed MXFP4 experts."""
    from k3.checkpoint.sharded import RankLayout
    from k3.serve.expert_shard import load_rank_model

    g = torch.Generator().manual_seed(3)
    full = K3ForCausalLM.from_pretrained(model_dir / "mxfp4").eval()
    moe = next(m for m in full.modules() if isinstance(m, LatentMoE))
    z = torch.randn(5, moe.routed_expert_down_proj.out_features, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:moe.top_k] for _ in range(5)])
    w = torch.rand(5, moe.top_k, generator=g)
    want = moe.combine_experts(z, idx, w)
    for ep in (2, 4):
        ranks = [next(m for m in load_rank_model(model_dir / "mxfp4", RankLayout(r, ep)).modules()
                      if isinstance(m, LatentMoE)) for r in range(ep)]
        for mode in ("sparse", "masked"):
            parts = [ExpertShardCombine(m, m.combine_experts.first, None, mode).partial(z, idx, w) for m in ranks]
            assert all(p.abs().sum() > 0 for p in parts)  # every rank contributes
            torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-6)


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                   json={"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_http_nproc2_equals_nproc1(model_dir, tmp_path):
    answers = {}
    for n in (1, 2):
        one = ["--no-engine-process"] if n == 1 else []  # one process: no engine process beside it either
        with k3_serve(model_dir / "f32", "k", "m", tmp_path / f"log{n}", "--nproc", str(n), *one) as url:
            answers[n] = [complete(url, p) for p in ("ROMEO:", "To be, or not to be")]
            workers = children_of(_serving_pid(url))
            assert len(workers) == n - 1
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers)  # a stopped server leaves no rank behind
        assert "error" not in (tmp_path / f"log{n}").read_text()  # the worker was released, not cut off
    with torchrun_serve(model_dir / "f32", tmp_path) as url:  # `k3 serve` as two torchrun nodes
        answers["nodes"] = [complete(url, p) for p in ("ROMEO:", "To be, or not to be")]
    for key in (2, "nodes"):
        for a, b in zip(answers[1], answers[key]):
            assert a["text"] == b["text"] and len(a["text"]) > 0
            torch.testing.assert_close(torch.tensor(a["logprobs"]["token_logprobs"]),
                                       torch.tensor(b["logprobs"]["token_logprobs"]), rtol=1e-4, atol=1e-4)


@contextmanager
def torchrun_serve(model: Path, log_dir: Path, timeout: float = 180.0):
    """`torchrun --nnodes 2 --node-rank r ... -m k3.cli serve` for r = 0, 1 on this machine; yields rank 0's URL."""
    port, http = free_port(), free_port()
    env = {**os.environ, "K3_CPU_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "k3.cli", "serve", "--model", str(model), "--port", str(http), "--api-key", "k",
                               "--served-model-name", "m", *SERVE_FLAGS],
                              env=env, stdout=open(log_dir / f"node{r}.log", "wb"), stderr=subprocess.STDOUT)
             for r in range(2)]
    url = f"http://127.0.0.1:{http}"
    try:
        wait_until_healthy(url, lambda: all(n.poll() is None for n in nodes), timeout,
                           lambda: "".join((log_dir / f"node{r}.log").read_text()[-2000:] for r in range(2)))
        yield url
    finally:
        for n in nodes:
            n.terminate()  # torchrun's agent stops its worker
        for n in nodes:
            try:
                n.wait(30)
            except subprocess.TimeoutExpired:
                n.kill()
                n.wait()


def test_killed_worker_stops_rank_0_with_an_error(model_dir, tmp_path):
    log = tmp_path / "log"
    with k3_serve(model_dir / "f32", "k", "m", log, "--nproc", "2") as url:
        server = _serving_pid(url)  # rank 0: the process `k3 serve --nproc 2` started as
        workers = children_of(server)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        try:  # the request fails, or finds the server gone; it never hangs
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                           json={"model": "m", "prompt": "ROMEO:", "max_tokens": 5})
            assert r.status_code >= 500 or "error" in r.text, r.text
        except httpx.TransportError:
            pass
        while _alive(server) and time.monotonic() - start < 30:
            time.sleep(0.2)
        assert not _alive(server), "rank 0 kept running after its worker died"
    text = log.read_text()
    assert "k3 serve: error: a serving rank failed: rank 1 was killed by SIGKILL" in text, text[-2000:]


def test_killed_rank_0_stops_its_worker(model_dir, tmp_path):
    """The other way round: rank 0 (the HTTP server) dies at once; its worker must not linger. First, the
    distributed server keeps one process's request-head deadline: a connection that sends nothing is closed."""
    with k3_serve(model_dir / "f32", "k", "m", tmp_path / "log", "--nproc", "2", "--header-timeout", "1") as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.settimeout(10)
            start = time.monotonic()
            assert s.recv(100) == b"" and time.monotonic() - start < 3  # closed after ~1 s, not held
        server = _serving_pid(url)
        worker, = children_of(server)
        os.kill(server, signal.SIGKILL)
        start = time.monotonic()
        while _alive(worker) and time.monotonic() - start < 30:
            time.sleep(0.2)
        assert not _alive(worker), "the worker outlived rank 0"
    assert "rank 1: lost the serving group" in (tmp_path / "log").read_text()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serving_pid(url: str) -> int:
    """The pid listening on url's port (the k3 serve process that is rank 0)."""
    port = int(url.rsplit(":", 1)[1])
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inode = fields[9]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if any(os.readlink(fd) == f"socket:[{inode}]" for fd in (d / "fd").iterdir()):
                    return int(d.name)
            except OSError:
                pass
    raise AssertionError(f"no process listens on {port}")


def test_a_failed_rank_slow_to_exit_is_still_named_as_the_cause():
    """Rank 0 learns of a failed local rank as a lost connection, while that rank may still be tearing down: the
    report waits for its exit (here 3 s, which the old 2 s wait missed, leaving only rank 0's gloo error), and
    returns at once with no local ranks to wait for (torchrun nodes)."""
    from k3.serve.distributed import describe_exits
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3); raise SystemExit(2)"])
    healthy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert describe_exits([healthy, slow]) == "rank 2 exited with status 2"
        start = time.monotonic()
        assert describe_exits([]) == "" and time.monotonic() - start < 0.5
    finally:
        healthy.kill()
        healthy.wait()

def test_a_rank_failing_to_load_stops_the_launch(tmp_path):
    """A shard only rank 1 reads is truncated (a bad disk on one node): rank 1 fails loading, and rank 0, which
    loaded fine and waits for it, exits with an error naming it instead of waiting out the load timeout."""
    import json

    from k3.checkpoint.names import parse_name
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.save_pretrained(tmp_path, dtype=None, max_shard_bytes=60_000)
    Tokenizer.from_file().save_pretrained(tmp_path)
    experts_of: dict[str, set] = {}
    for raw, f in json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].items():
        experts_of.setdefault(f, set()).add(parse_name(raw)[1])
    only_rank_1 = next(f for f, es in experts_of.items() if None not in es and min(es) >= E // 2)
    shard = tmp_path / only_rank_1
    shard.write_bytes(shard.read_bytes()[:100])
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "k3.cli", "serve", "--model", str(tmp_path), "--nproc", "2", "--port",
                        str(free_port())], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "K3_CPU_THREADS": "1"})
    assert r.returncode == 2 and time.monotonic() - start < 100
    assert "rank 1 exited with status 2" in r.stderr and only_rank_1 in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "4", "--ep", "3"], "--ep 3 must divide --nproc 4"),
    (["--nproc", "32"], "--ep 32 must divide the model's 16 routed experts"),
    (["--nproc", "3", "--ep", "3"], "--ep 3 must divide the model's 16 routed experts"),
    (["--nproc", "1", "--ep", "2"], "--ep 2 must divide --nproc 1"),
    (["--nproc", "4", "--tp", "3"], "--tp 3 must divide --nproc 4"),
    (["--nproc", "8", "--ep", "8", "--tp", "8"], "--tp 8: tensor parallel size 8 must divide the attention heads"),
])
def test_bad_layouts_are_refused_by_flag(model_dir, capsys, flags, message):
    rc = main(["serve", "--model", str(model_dir / "f32"), "--port", str(free_port()), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_nproc_must_match_the_launchers_world(model_dir, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc = main(["serve", "--model", str(model_dir / "f32"), "--nproc", "3"])
    assert rc == 2 and "--nproc 3 does not match the launcher's WORLD_SIZE 2" in capsys.readouterr().err
