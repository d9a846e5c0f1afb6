"""Distributed serving: one engine run by N ranks in lockstep (`k3 serve --nproc N`, or under torchrun across
machines), gloo on CPU, NCCL on GPU. Rank 0 serves HTTP and schedules; every rank executes every step.

Why lockstep rather than a coordinator shipping batches: every rank runs the same `LLMEngine` (scheduler,
prefix cache, pool metadata: plain host code, deterministic given the same inputs), so the only things that
must cross between ranks are what rank 0 alone learns: the requests that arrived or were aborted since the last
step (one broadcast over a gloo group before each step: host objects, no device sync), and the
sampled ids (rank 0's, broadcast before any sampler state advances, so grammar matchers, penalties and outputs
can never drift apart even if two ranks' floats did). Block tables, KV pages, KDA slots, preemption and prefix
hits then come out the same on every rank, and each rank's decode steps are its own CUDA graphs.

Images: every rank holds the vision tower and projector whole and encodes a request's images itself; rank 0
sends the preprocessed pixels with the request. Not rank 0 encoding and sending image rows: the pixels are the
smaller message (3·14² float32 per patch, 4 patches per image token: 9.4 KB a token, against one 7168-wide
row, 14 KB in bf16), they ride the one events broadcast there already is (no device collective of a
per-request shape), and the tower (~0.4 B parameters, under 1 GB) is small beside a rank's share of the
experts.

Layout: N ranks, routed experts sharded over EP groups of `ep` consecutive ranks (`owned_experts`, loaded by
`load_rank_shard`, MXFP4 kept packed; the ranks' shares are summed by one all-reduce: k3.serve.expert_shard).
Attention and the dense parts are replicated, or split over TP groups of `tp` consecutive ranks where
k3.parallel.tensor_parallel is available. With `replicas` (`--ep-replicas`) each rank also holds that many of
other ranks' experts per MoE layer, re-placed from the routed load every `rebalance_steps` steps, and a hot
expert's slots are split between its holders (MoonEP's balanced plan, served: k3.serve.expert_balance).
Why TP + EP and not data-parallel attention with MoonEP's all-to-all: `k3 plan --serve` finds that with every
GPU keeping all of attention the released model does not fit 16 H200s, and the all-reduce of [tokens, latent]
needs no host planning, so decode steps stay capturable.

Failure: an idle rank 0 still steps every HEARTBEAT_S, so the other ranks never wait longer than a step; every
serving collective has a timeout (STEP_TIMEOUT_S); a rank that dies closes its sockets, the next collective on
rank 0 fails, and rank 0 reports it and exits (its HTTP server stopped, its local workers ended).
"""
from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from k3.checkpoint.sharded import RankLayout
from k3.serve import gc_freeze
from k3.serve.engine import EngineConfig, EngineThread, LLMEngine, fit_engine_config
from k3.serve.local_server import free_port

HEARTBEAT_S = 1.0         # an idle rank 0 steps this often (the other ranks wait in its broadcast meanwhile)
REBALANCE_STEPS = 256    # engine steps between replica placements (--ep-rebalance-steps)
STEP_TIMEOUT_S = 300.0    # a serving collective that waits longer than this fails (a hung rank)
LOAD_TIMEOUT_S = 3600.0   # joining and loading: ranks read their shards at their own pace
_STOP = "stop"


class RankFailure(RuntimeError):
    """A rank of the serving group failed or vanished; the message says which and why."""


@dataclass(frozen=True)
class ServeLayout:
    """N ranks; experts sharded over EP groups of `ep` consecutive ranks, attention over TP groups of `tp`
    consecutive ranks (tp=1: replicated). Both divide N."""
    world: int
    ep: int
    tp: int = 1
    replicas: int = 0
    rebalance_steps: int = REBALANCE_STEPS

    def validate(self, num_experts: int | None = None) -> "ServeLayout":
        """ValueError naming the flag for a layout that cannot be served."""
        for flag, v in (("--nproc", self.world), ("--ep", self.ep), ("--tp", self.tp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.world % self.ep:
            raise ValueError(f"--ep {self.ep} must divide --nproc {self.world} (expert groups are cut from "
                             f"consecutive ranks)")
        if num_experts is not None and num_experts % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the model's {num_experts} routed experts")
        if self.world % self.tp:
            raise ValueError(f"--tp {self.tp} must divide --nproc {self.world}")
        for flag, v, least in (("--ep-replicas", self.replicas, 0), ("--ep-rebalance-steps", self.rebalance_steps, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{flag} must be an integer >= {least}, got {v!r}")
        if self.replicas and self.ep == 1:
            raise ValueError(f"--ep-replicas {self.replicas}: replicas balance expert parallelism, and this layout "
                             f"has one rank per expert group (--ep 1); give --nproc N --ep E with E >= 2")
        if self.replicas and num_experts is not None and self.replicas > num_experts // self.ep:
            raise ValueError(f"--ep-replicas {self.replicas} exceeds the {num_experts // self.ep} experts each rank "
                             f"owns: a balanced plan never gives a rank more replicas than that")
        return self

    def rank_layout(self, rank: int) -> RankLayout:
        return RankLayout(ep_rank=rank % self.ep, ep=self.ep, tp_rank=rank % self.tp, tp=self.tp)

    def blocks(self, size: int) -> list[list[int]]:
        return [list(range(g, g + size)) for g in range(0, self.world, size)]


@dataclass
class RankGroups:
    """The process groups one serving rank uses (created collectively, in the same order on every rank)."""
    control: object  # gloo: rank 0's events, host objects
    tokens: object   # the device backend: rank 0's sampled ids
    ep: object
    tp: object


def make_groups(layout: ServeLayout, rank: int, timeout_s: float = STEP_TIMEOUT_S) -> RankGroups:
    timeout = timedelta(seconds=timeout_s)
    control = dist.new_group(backend="gloo", timeout=timeout)
    tokens = dist.new_group(timeout=timeout)
    mine = {}
    for kind, size in (("ep", layout.ep), ("tp", layout.tp)):
        for ranks in layout.blocks(size):
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = g
    return RankGroups(control, tokens, mine["ep"], mine["tp"])


class Lockstep:
    """The per-step channel: rank 0 publishes, every other rank receives the same list. A step with nothing new
    (every decode step) costs one broadcast of its length, 0; otherwise the pickled events follow (the ranks
    trust rank 0 as broadcast_object_list would, which takes two broadcasts every time)."""

    def __init__(self, groups: RankGroups):
        self.groups = groups
        self.rank = dist.get_rank()

    def publish(self, events) -> None:
        payload = pickle.dumps(events) if events else b""
        dist.broadcast(torch.tensor([len(payload)]), src=0, group=self.groups.control)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.groups.control)

    def receive(self):
        size = torch.zeros(1, dtype=torch.long)
        dist.broadcast(size, src=0, group=self.groups.control)
        if not size.item():
            return []
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.groups.control)
        return pickle.loads(payload.numpy().tobytes())

    def agree(self, picked: torch.Tensor) -> torch.Tensor:
        """Every rank's sampled ids become rank 0's (in place, on the device: no host read)."""
        dist.broadcast(picked, src=0, group=self.groups.tokens)
        return picked


class _GrammarText:
    """A request's compiled grammar as it crosses to another rank (llguidance objects do not pickle)."""

    def __init__(self, grammar):
        self.text, self.eos = grammar.text, grammar.eos

    def rebuild(self, tokenizer):
        from k3.serve.grammar import Grammar, ll_tokenizer
        g = Grammar.__new__(Grammar)  # already validated on rank 0: skip recompiling the Lark source
        g.ll, g.text, g.eos = ll_tokenizer(tokenizer), self.text, self.eos
        return g


class DistributedEngine(LLMEngine):
    """An LLMEngine on one rank of a lockstep group. On rank 0, add_request/abort/step are the engine's own
    (the EngineThread and `generate` drive it unchanged); each step first publishes what changed. Every other
    rank calls `follow()`, which replays rank 0's changes and steps until rank 0 closes."""

    def __init__(self, model, tokenizer, config: EngineConfig | None, channel: Lockstep, metrics=None):
        super().__init__(model, tokenizer, config, metrics)
        self.channel = channel
        self.is_leader = channel.rank == 0
        self.idle_step_s = HEARTBEAT_S if self.is_leader else None
        self._events: list[tuple] = []
        self.balancer = None  # a k3.serve.expert_shard.ReplicaBalancer with --ep-replicas: runs after each step

    def agree_tokens(self, picked: torch.Tensor) -> torch.Tensor:
        return self.channel.agree(picked)

    def add_request(self, prompt, params, request_id=None, checkpoint_at=None, images=None,
                    policy_version=None) -> str:
        rid = super().add_request(prompt, params, request_id, checkpoint_at, images, policy_version)
        if self.is_leader:
            sent = params
            if params.grammar is not None:
                sent = copy.copy(params)
                sent.grammar = _GrammarText(params.grammar)
            self._events.append(("add", prompt, sent, rid, checkpoint_at, policy_version, images))
        return rid

    def abort(self, request_id: str) -> bool:
        found = super().abort(request_id)
        if found and self.is_leader:
            self._events.append(("abort", request_id))
        return found

    def step(self):
        if not self.is_leader:
            raise RuntimeError("only rank 0 steps the engine; the other ranks call follow()")
        events, self._events = self._events, []
        self.channel.publish(events)
        out = super().step()
        if self.balancer is not None:
            self.balancer.after_step()
        return out

    def follow(self) -> None:
        """The loop of a rank other than 0: apply rank 0's events, run the same step, until rank 0 closes."""
        while True:
            events = self.channel.receive()
            if events == _STOP:
                break
            for event in events:
                if event[0] == "add":
                    _, prompt, params, rid, checkpoint_at, version, images = event
                    if isinstance(params.grammar, _GrammarText):
                        params.grammar = params.grammar.rebuild(self.tokenizer)
                    super().add_request(prompt, params, rid, checkpoint_at, images, version)
                else:
                    super().abort(event[1])
            with torch.inference_mode():
                super().step()
            if self.balancer is not None:
                self.balancer.after_step()
        super().close()

    def close(self) -> None:
        """On rank 0: release the other ranks (their follow() returns), then this engine."""
        if self.is_leader and self.pool is not None:
            self.channel.publish(_STOP)
        super().close()


class LockstepEngineThread(EngineThread):
    """Rank 0's engine thread: a failed step (a rank gone, a timeout) is reported once and stops the server;
    a clean shutdown releases the other ranks."""

    def __init__(self, engine: DistributedEngine, on_failure=None):
        super().__init__(engine)
        self.on_failure = on_failure

    def _loop(self) -> None:
        try:
            super()._loop()
        except BaseException as e:  # the requests waiting were told by EngineThread; now stop serving
            if self.on_failure is not None:
                self.on_failure(e)

    def shutdown(self, timeout: float = 10.0) -> None:
        super().shutdown(timeout)
        if not self._thread.is_alive() and self.error is None and self.engine.pool is not None:
            self.engine.close()


def build_rank_engine(model_dir, layout: ServeLayout, engine_config: EngineConfig | None = None,
                      device: str = "cpu", step_timeout_s: float = STEP_TIMEOUT_S) -> DistributedEngine:
    """This rank's engine, in an initialised process group of layout.world ranks: its groups, its part of the
    checkpoint (rank-sharded), the tokenizer. Collective: every rank calls it."""
    from k3.config import K3Config
    from k3.data import model_tokenizer
    from k3.ops.mx_experts import use_decode_layout_, wants_decode_layout
    from k3.serve.expert_shard import ReplicaBalancer, load_rank_model

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world:
        raise ValueError(f"--nproc {layout.world} does not match the process group's {world} ranks")
    d = Path(model_dir)
    config = K3Config.from_pretrained(d)
    layout.validate(config.num_experts)
    groups = make_groups(layout, rank, step_timeout_s)
    model = load_rank_model(d, layout.rank_layout(rank), device=device, ep_group=groups.ep, tp_group=groups.tp,
                            replicas=layout.replicas)
    engine_config = fit_engine_config(config, engine_config)
    if engine_config.prefill_graphs is None:  # one process's default only (see serve_from_cli)
        engine_config = replace(engine_config, prefill_graphs=False)
    if wants_decode_layout(device, engine_config.decode_layout):  # before the engine: its biases agree over EP
        use_decode_layout_(model, groups.ep)
    engine = DistributedEngine(model, model_tokenizer(d), engine_config, Lockstep(groups))
    if layout.replicas:
        engine.balancer = ReplicaBalancer(model, groups.ep, layout.rebalance_steps)
    dist.barrier()  # every rank has loaded (the load timeout); from here on the step timeout bounds each wait
    return engine


# ---- processes -----------------------------------------------------------------------------------------------
def spawn_local_ranks(nproc: int, serve_args: list[str]) -> list[subprocess.Popen]:
    """Start ranks 1..nproc-1 as `k3 serve` processes on this machine and make this process rank 0 (the
    torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port())}
    children = []
    for r in range(1, nproc):
        env = {**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)}
        children.append(subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", *serve_args], env=env))
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    return children


def describe_exits(children: list[subprocess.Popen], wait_s: float = 6.0) -> str:
    """'rank 1 was killed by SIGKILL; ...' for the local ranks that have ended with a failure ('' for none),
    waiting up to wait_s for one to end: the rank whose failure closed the group may still be tearing down (torch's
    exit took over 2 s on a loaded 2-core machine), and its exit, not rank 0's lost connection, is the cause."""
    deadline = time.monotonic() + wait_s
    while children and time.monotonic() < deadline and all(p.poll() is None for p in children):
        time.sleep(0.05)
    out = []
    for r, p in enumerate(children, start=1):
        code = p.poll()
        if code is not None and code != 0:
            out.append(f"rank {r} was killed by {signal.Signals(-code).name}" if code < 0
                       else f"rank {r} exited with status {code}")
    return "; ".join(out)


def stop_local_ranks(children: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for p in children:
        if p.poll() is None:
            p.terminate()
    for p in children:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def share_cpu_threads() -> None:
    """CPU ranks on one machine split its cores: each takes 1/LOCAL_WORLD_SIZE of what k3's policy gave one
    process (a count fixed by K3_CPU_THREADS or OMP_NUM_THREADS is left as it is)."""
    from k3.cpu_threads import configure_torch_threads

    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    policy = configure_torch_threads()
    if policy.mode == "auto" and local > 1:
        torch.set_num_threads(max(1, policy.threads // local))


class StartupWatch:
    """Until every rank has loaded, a local rank that fails ends rank 0 too: rank 0 may be waiting for it in the
    process group's rendezvous, which no Python exception interrupts (it would wait out LOAD_TIMEOUT_S)."""

    def __init__(self, children: list[subprocess.Popen], poll_s: float = 0.5):
        self.children, self.poll_s, self.armed = children, poll_s, True
        if children:
            threading.Thread(target=self._watch, name="k3-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while self.armed:
            failed = describe_exits(self.children, wait_s=0)
            if failed and self.armed:
                print(f"k3 serve: error: {failed} while the ranks were starting", file=sys.stderr, flush=True)
                stop_local_ranks(self.children)
                os._exit(2)
            time.sleep(self.poll_s)

    def disarm(self) -> None:
        self.armed = False


def serve_rank(model_dir, layout: ServeLayout, engine_config: EngineConfig | None = None, device: str = "cpu",
               host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, model_name: str | None = None,
               max_request_bytes: int | None = None, timeout_keep_alive: float = 5.0,
               header_timeout: float | None = None, limit_concurrency: int | None = None,
               children: list[subprocess.Popen] | None = None) -> None:
    """Join the process group the environment describes, load this rank's part and serve: rank 0 over HTTP
    until stopped, the others following it. Raises RankFailure when another rank fails."""
    from k3.parallel.mesh import init_distributed

    children = children or []
    watch = StartupWatch(children)
    device_type = torch.device(device).type
    rank, _ = init_distributed(LOAD_TIMEOUT_S, device_type)
    if device_type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    else:
        share_cpu_threads()
    try:
        engine = build_rank_engine(model_dir, layout, engine_config, device)
        watch.disarm()  # every rank is up: from here a lost rank fails rank 0's next collective
        if rank == 0:
            _serve_http(engine, Path(model_dir), host, port, api_key, model_name, max_request_bytes,
                        timeout_keep_alive, header_timeout, limit_concurrency, children)
        else:
            gc_freeze.freeze()  # the model and the engine: out of every later full collection (k3.serve.gc_freeze)
            try:
                engine.follow()
            except Exception as e:
                raise RankFailure(f"rank {rank}: lost the serving group ({_one_line(e)})") from None
    except RuntimeError as e:
        if isinstance(e, RankFailure):
            raise
        exits = describe_exits(children)
        raise RankFailure(f"rank {rank}: {exits or _one_line(e)}") from None
    finally:
        watch.disarm()
        stop_local_ranks(children)
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve_http(engine: DistributedEngine, d: Path, host, port, api_key, model_name, max_request_bytes,
                timeout_keep_alive, header_timeout, limit_concurrency, children) -> None:
    import uvicorn

    from k3.serve.api import HEADER_TIMEOUT_S, LIMIT_CONCURRENCY, MAX_REQUEST_BYTES, create_app, uvicorn_settings

    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_failure(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    runner = LockstepEngineThread(engine, on_failure)
    balancer = engine.balancer
    replicas = "" if balancer is None or not balancer.combines else \
        f", expert replicas {balancer.combines[0].replicas} a rank per MoE layer, re-placed every " \
        f"{balancer.every} steps"
    print(f"k3 serve: {engine.describe_capacity()}; {dist.get_world_size()} ranks{replicas}", flush=True)
    app = create_app(engine, engine.tokenizer, model_name or d.name, api_key,
                     max_request_bytes=max_request_bytes or MAX_REQUEST_BYTES, runner=runner)
    # the same guards as one process: keep-alive, the request-head deadline, the connection limit
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_settings(
        host, port, timeout_keep_alive, header_timeout or HEADER_TIMEOUT_S, limit_concurrency or LIMIT_CONCURRENCY)))
    gc_freeze.freeze()  # the model, the engine and the app (k3.serve.gc_freeze)
    server.run()
    if failure:
        exits = describe_exits(children)
        raise RankFailure(f"a serving rank failed: {exits or _one_line(failure[0])}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500] or type(e).__name__


def is_torchrun_rank() -> bool:
    """Whether this process is one rank of a launched group (torchrun, or `k3 serve --nproc`'s own)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def serve_from_cli(a, engine_config: EngineConfig, api_key: str | None) -> None:
    """`k3 serve --nproc N [--ep E] [--tp T]`, or `k3 serve` as one rank under torchrun: check the layout
    (ValueError naming the flag), start the local ranks (outside torchrun), then serve as this rank."""
    from k3.config import K3Config

    if engine_config.prefill_graphs:  # captured pieces would hold the experts' and TP's collectives: not yet tried
        raise ValueError("--prefill-graphs serves from one process only; leave it off with --nproc, --ep, --tp or "
                         "--ep-replicas")
    inside = is_torchrun_rank()
    world = int(os.environ["WORLD_SIZE"]) if inside else (a.nproc or 1)
    if inside and a.nproc is not None and a.nproc != world:
        raise ValueError(f"--nproc {a.nproc} does not match the launcher's WORLD_SIZE {world}")
    d = Path(a.model)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json there")
    config = K3Config.from_pretrained(d)
    replicas = getattr(a, "ep_replicas", None) or 0
    every = getattr(a, "ep_rebalance_steps", None)
    if every is not None and not replicas:
        raise ValueError(f"--ep-rebalance-steps {every}: there are no replicas to re-place without --ep-replicas")
    layout = ServeLayout(world, a.ep or world, a.tp, replicas, every or REBALANCE_STEPS).validate(config.num_experts)
    if layout.tp > 1:
        from k3.parallel.tensor_parallel import check_heads
        try:
            check_heads(config, layout.tp)
        except ValueError as e:
            raise ValueError(f"--tp {layout.tp}: {e}") from None
    if torch.device(a.device).index is not None and world > 1:
        raise ValueError(f"--device {a.device}: with several ranks give the type only (cuda); each rank "
                         f"takes the GPU of its LOCAL_RANK")
    children = [] if inside else spawn_local_ranks(world, a.argv[1:])
    serve_rank(d, layout, engine_config, a.device, a.host, a.port, api_key, a.served_model_name,
               a.max_request_bytes, a.timeout_keep_alive, a.header_timeout, a.limit_concurrency, children)
