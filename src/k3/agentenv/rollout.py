"""Agent rollouts in sandboxes: OpenAI tool schemas (bash, read_file, write_file, str_replace, submit), a
token-level multi-turn loop, rewards from hidden tests run in a separate grader sandbox, and partial rollouts:
once a fraction λ of trajectories finished, the rest are parked (sandbox frozen; tokens so far, each token's
log-prob and policy version kept) and later resumed as a raw-token continuation, never re-tokenised.

Policies: `ScriptedPolicy` (deterministic tool calls, for tests and smoke runs), `EnginePolicy` (an in-process
k3 LLMEngine, greedy or sampled), `ServePolicy` (a running `k3 serve`, through its OpenAI /v1/completions API
with the `return_token_ids` extension). Both real policies tag every request with their policy version, which
the engine's prefix-cache hashes carry, so no cache entry of an older version is ever hit; and both ask for
KDA checkpoints at the tool-turn boundaries, so a resumed turn restores state instead of re-reading history."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from k3.agentenv.api import Backend, Sandbox, SandboxError, SandboxSpec

TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command in /workspace.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Create or overwrite a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "str_replace", "description": "Replace one exact occurrence.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                     "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish; the hidden tests are run.",
     "parameters": {"type": "object", "properties": {}}}},
]
TOOL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
MAX_TOOL_OUTPUT = 2000  # characters of a tool result fed back to the model


def python_test(script: str) -> str:
    """A test command that runs `script` in a clean interpreter: isolated mode (-I: no PYTHON* variables, no
    user site-packages, no script directory first on sys.path), the workspace appended after the standard
    library (the agent's files can be imported but cannot shadow a stdlib module the test uses)."""
    boot = f"import runpy, sys; sys.path.append('/workspace'); runpy.run_path({script!r}, run_name='__main__')"
    return f'python3 -I -c "{boot}"'


# the grader's environment: an empty HOME the agent never wrote to, and no user site even for commands
# that are not `python3 -I`
GRADER_ENV = {"HOME": "/tmp/grader-home", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass
class Task:
    name: str
    prompt: str
    files: dict[str, str]           # the agent's workspace
    hidden_tests: dict[str, str]    # only ever written into the grader sandbox
    test_cmd: str


BUILTIN_TASKS = {
    "fix_add": Task("fix_add", "Fix add() in app.py so the tests pass, then submit.",
                    {"app.py": "def add(a, b):\n    return a - b\n"},
                    {"test_hidden.py": "from app import add\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\n"},
                    python_test("test_hidden.py")),
    "fix_greet": Task("fix_greet", "Make greet('x') return 'hello x', then submit.",
                      {"greet.py": "def greet(name):\n    return 'hi ' + name\n"},
                      {"test_hidden.py": "from greet import greet\nassert greet('x') == 'hello x'\n"},
                      python_test("test_hidden.py")),
}


def tool_call_text(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


SCRIPTS = {  # a correct solution per built-in task, one assistant turn each
    "fix_add": [tool_call_text("bash", command="cat app.py"),
                tool_call_text("str_replace", path="app.py", old="a - b", new="a + b"),
                tool_call_text("bash", command="python3 -c 'from app import add; print(add(2, 3))'"),
                tool_call_text("submit")],
    "fix_greet": [tool_call_text("read_file", path="greet.py"),
                  tool_call_text("write_file", path="greet.py", content="def greet(name):\n    return 'hello ' + name\n"),
                  tool_call_text("submit")],
}


def run_tool(sb: Sandbox, name: str, args: dict) -> str:
    """Execute one tool call in the sandbox; every failure becomes text for the model, never an exception."""
    try:
        if name == "bash":
            r = sb.exec(str(args["command"]), timeout=20)
            out = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
            return f"{out}[exit {r.exit_code if r.exit_code is not None else 'signal %s' % r.signal}]"
        if name == "read_file":
            return sb.read_file(str(args["path"])).decode(errors="replace")
        if name == "write_file":
            sb.write_file(str(args["path"]), str(args["content"]).encode())
            return "ok"
        if name == "str_replace":
            text = sb.read_file(str(args["path"])).decode()
            if text.count(args["old"]) != 1:
                return f"error: 'old' occurs {text.count(args['old'])} times (need exactly 1)"
            sb.write_file(str(args["path"]), text.replace(args["old"], args["new"]).encode())
            return "ok"
        return f"error: unknown tool {name!r}"
    except (SandboxError, KeyError, TypeError, UnicodeDecodeError) as e:
        return f"error: {e}"


@dataclass
class Trajectory:
    task: Task
    ids: list[int]                      # everything so far: prompt, completed turns, tool results
    prompt_len: int
    sandbox: Sandbox | None = None
    partial: list[int] = field(default_factory=list)      # tokens of the assistant turn in progress
    partial_logprobs: list[float] = field(default_factory=list)
    partial_versions: list[int] = field(default_factory=list)
    gen_mask: list[bool] = field(default_factory=list)     # per token after the prompt: generated (True) or tool
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)     # KDA checkpoint positions (tool-turn boundaries)
    tool_outputs: list[str] = field(default_factory=list)
    turn: int = 0
    status: str = "running"             # running | parked | finished
    reward: float | None = None

    @property
    def generated(self) -> list[int]:
        return [t for t, g in zip(self.ids[self.prompt_len:], self.gen_mask) if g]


class ScriptedPolicy:
    """Emits the task's scripted turns token by token (log-prob 0); knows nothing but the trajectory's turn
    and how much of the turn it already produced, so parking mid-turn and resuming is exercised."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]] | None = None, version: int = 0):
        self.tok, self.scripts, self.version = tokenizer, scripts or SCRIPTS, version

    def generate(self, traj: Trajectory, max_new: int) -> tuple[list[int], list[float]]:
        script = self.scripts[traj.task.name]
        text = script[traj.turn] if traj.turn < len(script) else tool_call_text("submit")
        full = self.tok.encode(text) + [self.tok.eos_id]
        new = full[len(traj.partial):len(traj.partial) + max_new]
        return new, [0.0] * len(new)


class EnginePolicy:
    """A k3 LLMEngine in this process. The context goes in as token ids (raw continuation of `ids + partial`).
    `set_version` swaps weights (optional) and changes the version every request is tagged with: the engine's
    prefix cache keys carry it, so entries of older versions stay but can never be hit again (they age out
    by LRU); `cache_reports` records (version, CacheReport) per call."""

    def __init__(self, model, tokenizer, engine_config, version: int = 0, temperature: float = 0.0):
        self.model, self.tok, self.engine_config = model, tokenizer, engine_config
        self.temperature, self.version = temperature, version
        self.cache_reports: list[tuple[int, object]] = []
        self._build()

    def _build(self):
        from k3.serve import LLMEngine
        self.engine = LLMEngine(self.model, self.tok, self.engine_config)

    def set_version(self, version: int, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            self.model.load_state_dict(state_dict)
        self.version = version

    def generate(self, traj: Trajectory, max_new: int) -> tuple[list[int], list[float]]:
        from k3.serve.sampling import SamplingParams
        prompt = traj.ids + traj.partial
        sp = SamplingParams(max_tokens=max_new, temperature=self.temperature, logprobs=0)
        rid = self.engine.add_request(prompt, sp, checkpoint_at=list(traj.turn_ends), policy_version=self.version)
        lps, final = [], None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == rid:
                    lps += [lp.logprob for lp in out.new_logprobs]
                    final = out if out.finished else final
        self.cache_reports.append((self.version, final.cache))
        ids = list(final.output_ids)
        if final.finish_reason == "stop" and self.tok.eos_id not in ids and len(ids) < max_new:
            ids.append(self.tok.eos_id)  # the engine ended on EOS without returning it: the turn is over
            lps.append(0.0)
        return ids, lps[:len(ids)]


class ServePolicy:
    """A running `k3 serve` through /v1/completions: the prompt goes as token ids and the generated ids come
    back as ids (`return_token_ids`), so the continuation is raw tokens end to end, never re-tokenised.
    Requests carry `policy_version` (the server's prefix-cache namespace) and `checkpoint_at` (turn ends)."""

    def __init__(self, base_url: str, model: str, tokenizer, api_key: str | None = None, version: int = 0):
        import httpx
        self.http = httpx.Client(base_url=base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.model, self.tok, self.version = model, tokenizer, version
        self.cache_reports: list[tuple[int, dict | None]] = []

    def set_version(self, version: int) -> None:
        """New weights were loaded into the server: tag later requests with `version`."""
        self.version = version

    def close(self) -> None:
        self.http.close()

    def generate(self, traj: Trajectory, max_new: int) -> tuple[list[int], list[float]]:
        r = self.http.post("/v1/completions", json={
            "model": self.model, "prompt": traj.ids + traj.partial, "max_tokens": max_new, "temperature": 0,
            "logprobs": 0, "return_token_ids": True, "policy_version": self.version,
            "checkpoint_at": list(traj.turn_ends)})
        if r.status_code != 200:
            raise SandboxError(f"k3 serve answered {r.status_code}: {r.text[:300]}")
        choice = r.json()["choices"][0]
        ids, lps = list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])
        self.cache_reports.append((self.version, r.json().get("k3_cache")))
        if choice["finish_reason"] == "stop" and self.tok.eos_id not in ids and len(ids) < max_new:
            ids.append(self.tok.eos_id)  # ended on a stop string: the turn is over (as EnginePolicy does)
            lps.append(0.0)
        return ids, lps[:len(ids)]


class RolloutRunner:
    """Drives trajectories: `start` (sandbox from the task files), `step` (one chunk of generation and, at a
    turn's end, the tool call), `run_partial` (λ-fraction stop with parking), `resume`, `grade`."""

    def __init__(self, backend: Backend, tokenizer, max_turns: int = 8, max_turn_tokens: int = 256,
                 chunk: int = 16, spec: SandboxSpec | None = None):
        if not 1 <= chunk <= max_turn_tokens:
            raise ValueError(f"chunk must be in [1, max_turn_tokens={max_turn_tokens}], got {chunk}")
        self.backend, self.tok = backend, tokenizer
        self.max_turns, self.max_turn_tokens, self.chunk = max_turns, max_turn_tokens, chunk
        self.spec = spec or SandboxSpec()

    def _template(self, files: dict[str, str]) -> str:
        d = Path(tempfile.mkdtemp(prefix="k3task-"))
        for name, text in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
        return str(d)

    def start(self, task: Task, with_sandbox: bool = True) -> Trajectory:
        prompt = (f"<system>Tools: {', '.join(t['function']['name'] for t in TOOLS)}. Call one per turn as "
                  f"<tool_call>{{json}}</tool_call>.</system>\n<user>{task.prompt}</user>\n<assistant>")
        ids = self.tok.encode(prompt)
        sb = None
        if with_sandbox:
            tpl = self._template(task.files)
            try:
                sb = self.backend.create(SandboxSpec(template=tpl, limits=self.spec.limits, env=self.spec.env))
            finally:
                shutil.rmtree(tpl, ignore_errors=True)
        return Trajectory(task, ids, len(ids), sb, turn_ends=[len(ids)])

    def _append(self, traj: Trajectory, toks, generated: bool, lps=None, versions=None) -> None:
        traj.ids += toks
        traj.gen_mask += [generated] * len(toks)
        traj.logprobs += list(lps) if lps is not None else [None] * len(toks)
        traj.versions += list(versions) if versions is not None else [None] * len(toks)

    def step(self, traj: Trajectory, policy) -> None:
        """One chunk of generation; if the turn ended (EOS, a complete tool call, or the cap), run the tool."""
        if traj.status != "running":
            raise ValueError(f"trajectory is {traj.status}; resume() a parked one first")
        budget = min(self.chunk, self.max_turn_tokens - len(traj.partial))
        new, lps = policy.generate(traj, budget)
        new, lps = new[:budget], lps[:budget]
        traj.partial += new
        traj.partial_logprobs += lps
        traj.partial_versions += [policy.version] * len(new)
        text = self.tok.decode([t for t in traj.partial if t != self.tok.eos_id])
        ended = (not new or self.tok.eos_id in new or "</tool_call>" in text
                 or len(traj.partial) >= self.max_turn_tokens)
        if not ended:
            return
        self._append(traj, traj.partial, True, traj.partial_logprobs, traj.partial_versions)
        traj.partial, traj.partial_logprobs, traj.partial_versions = [], [], []
        traj.turn += 1
        m = TOOL_RE.search(text)
        call = None
        if m:
            try:
                call = json.loads(m.group(1))
            except ValueError:
                call = None
        if call is None or call.get("name") == "submit" or traj.turn >= self.max_turns:
            traj.status = "finished"
            return
        out = run_tool(traj.sandbox, str(call.get("name")), call.get("arguments") or {})[:MAX_TOOL_OUTPUT]
        traj.tool_outputs.append(out)
        # only the new tool turn is encoded: the history stays exactly the tokens it already was
        self._append(traj, self.tok.encode(f"\n<tool_result>{out}</tool_result>\n<assistant>"), False)
        traj.turn_ends.append(len(traj.ids))

    def run(self, trajs: list[Trajectory], policy, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            active = [t for t in trajs if t.status == "running"]
            if not active:
                return
            for t in active:
                self.step(t, policy)
        raise RuntimeError(f"rollouts did not finish within {max_steps} steps")

    def run_partial(self, trajs: list[Trajectory], policy, lam: float, max_steps: int = 10_000):
        """Step all until a fraction `lam` finished, then park the rest. Returns (finished, parked)."""
        if not 0 < lam <= 1:
            raise ValueError(f"lam must be in (0, 1], got {lam}")
        need = max(1, int(round(lam * len(trajs))))
        for _ in range(max_steps):
            done = [t for t in trajs if t.status == "finished"]
            if len(done) >= need:
                break
            for t in trajs:
                if t.status == "running":
                    self.step(t, policy)
        for t in trajs:
            if t.status == "running":
                self.park(t)
        return [t for t in trajs if t.status == "finished"], [t for t in trajs if t.status == "parked"]

    def park(self, traj: Trajectory) -> None:
        if traj.sandbox is not None:
            traj.sandbox.pause()
        traj.status = "parked"

    def resume(self, traj: Trajectory) -> None:
        if traj.status != "parked":
            raise ValueError(f"only a parked trajectory can resume, this one is {traj.status}")
        if traj.sandbox is not None:
            traj.sandbox.resume()
        traj.status = "running"

    def grade(self, traj: Trajectory) -> float:
        """Copy the agent's workspace into a fresh grader sandbox (no process of the agent's runs there), add
        the hidden tests as new files (whatever the agent left under their names, a symlink, FIFO or
        directory, is replaced, never followed), run the test command with GRADER_ENV."""
        snap = traj.sandbox.snapshot("fs")
        try:
            grader = self.backend.restore(snap)
        finally:
            if hasattr(self.backend, "delete_snapshot"):
                self.backend.delete_snapshot(snap)  # the grader holds the layers it needs
        try:
            for name, text in traj.task.hidden_tests.items():
                grader.write_file(name, text.encode(), fresh=True)
            r = grader.exec(traj.task.test_cmd, env=GRADER_ENV, timeout=30)
            traj.reward = 1.0 if r.ok else 0.0
        finally:
            grader.close()
        return traj.reward

    def close(self, traj: Trajectory) -> None:
        if traj.sandbox is not None:
            traj.sandbox.close()
