"""Agent rollouts: the built-in tasks solved end to end by a scripted policy in real sandboxes (reward from
hidden tests that exist only in the grader sandbox); parked-and-resumed trajectories reproduce uninterrupted
ones token for token (scripted policy with tool outputs; the tiny K3 greedy through the serving engine); a new
policy version never hits a cache entry of an older one."""

import time

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.agentenv import get_backend
from k3.agentenv.rollout import (BUILTIN_TASKS, SCRIPTS, TOOLS, EnginePolicy, RolloutRunner, ScriptedPolicy,
                                 ServePolicy, Task, python_test, tool_call_text)
from k3.data import Tokenizer
from k3.serve import EngineConfig, LLMEngine
from k3.serve.api import create_app
from k3.serve.local_server import local_server


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


@pytest.fixture(scope="module")
def backend():
    b = get_backend("bwrap")
    ok, reason = b.available()
    if not ok:
        pytest.skip(f"backend unavailable: bwrap: {reason}")
    return b


def test_tool_schemas_are_openai_shaped():
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["bash", "read_file", "write_file", "str_replace", "submit"]
    for t in TOOLS:
        p = t["function"]["parameters"]
        assert t["type"] == "function" and p["type"] == "object"
        assert set(p.get("required", [])) <= set(p["properties"])


@pytest.mark.parametrize("task", list(BUILTIN_TASKS))
def test_scripted_policy_solves_task_and_hidden_tests_stay_hidden(backend, tok, task):
    runner = RolloutRunner(backend, tok, chunk=8)
    traj = runner.start(BUILTIN_TASKS[task])
    try:
        assert runner.grade(traj) == 0.0  # the bug is real before the agent acts
        listing = traj.sandbox.exec("find / -name 'test_hidden*' 2>/dev/null; ls -a").text
        assert "test_hidden" not in listing and ".git" not in listing
        runner.run([traj], ScriptedPolicy(tok))
        assert traj.status == "finished" and traj.turn == len(SCRIPTS[task])
        assert runner.grade(traj) == 1.0
        assert "test_hidden" not in traj.sandbox.exec("ls -a").text  # grading left the agent's box alone
    finally:
        runner.close(traj)


def test_wrong_fix_gets_zero(backend, tok):
    bad = {"fix_add": [tool_call_text("str_replace", path="app.py", old="a - b", new="a * b"),
                       tool_call_text("submit")]}
    runner = RolloutRunner(backend, tok)
    traj = runner.start(BUILTIN_TASKS["fix_add"])
    try:
        runner.run([traj], ScriptedPolicy(tok, bad))
        assert runner.grade(traj) == 0.0
    finally:
        runner.close(traj)


# Reward hacks: each plants something in the agent's workspace with the bug left unfixed; the naive way to
# run the hidden test is shown to pass (the hack is real), and grade() must still give 0.0.
HACKS = {
    # imported by every interpreter that has HOME=/workspace and the user site on
    "usercustomize": ("d=$(HOME=/workspace python3 -m site --user-site) && mkdir -p $d && "
                      "echo 'import os; os._exit(0)' > $d/usercustomize.py",
                      "echo 'raise SystemExit(1)' > x.py && HOME=/workspace python3 x.py"),
    # a .pth in the user site runs code at start-up too
    "user .pth": ("d=$(HOME=/workspace python3 -m site --user-site) && mkdir -p $d && "
                  "echo 'import os; os._exit(0)' > $d/zz.pth",
                  "echo 'raise SystemExit(1)' > x.py && HOME=/workspace python3 x.py"),
    # the hidden test written through the agent's symlink lands in /dev/null; running the link runs nothing
    "symlink to /dev/null": ("ln -s /dev/null test_hidden.py",
                             "echo 'assert 0' > test_hidden.py && python3 test_hidden.py"),
    # python3 DIR runs DIR/__main__.py: a directory named like the test
    "directory with __main__": ("mkdir test_hidden.py && echo 'pass' > test_hidden.py/__main__.py",
                                "python3 test_hidden.py"),
    # a stdlib module the hidden test imports, shadowed from the workspace
    "shadowed stdlib": ("echo 'import os; os._exit(0)' > fractions.py",
                        "printf 'import fractions\\nassert 0\\n' > test_hidden.py && python3 test_hidden.py"),
}
# fix_add whose hidden test also imports a standard-library module
FIX_ADD_STDLIB = Task("fix_add", BUILTIN_TASKS["fix_add"].prompt, BUILTIN_TASKS["fix_add"].files,
                      {"test_hidden.py": "import fractions\nfrom app import add\nassert add(2, 3) == 5\n"},
                      python_test("test_hidden.py"))


@pytest.mark.parametrize("hack", list(HACKS))
def test_reward_hack_without_the_fix_gets_zero(backend, tok, hack):
    plant, naive = HACKS[hack]
    runner = RolloutRunner(backend, tok)
    traj = runner.start(FIX_ADD_STDLIB)
    try:
        r = traj.sandbox.exec(plant)
        assert r.exit_code == 0, r
        snap = traj.sandbox.snapshot("fs")
        try:
            with backend.restore(snap) as probe:  # the hack works on a naive grader
                assert probe.exec(naive).exit_code == 0, hack
        finally:
            backend.delete_snapshot(snap)
        assert runner.grade(traj) == 0.0
        traj.sandbox.exec("rm -rf .local test_hidden.py fractions.py x.py")
        traj.sandbox.write_file("app.py", b"def add(a, b):\n    return a + b\n")
        assert runner.grade(traj) == 1.0  # and the grader still grades: the real fix passes
    finally:
        runner.close(traj)


def test_fifo_named_like_the_hidden_test_neither_hangs_nor_passes(backend, tok):
    runner = RolloutRunner(backend, tok)
    traj = runner.start(BUILTIN_TASKS["fix_add"])
    try:
        assert traj.sandbox.exec("mkfifo test_hidden.py").exit_code == 0
        t0 = time.monotonic()
        assert runner.grade(traj) == 0.0
        assert time.monotonic() - t0 < 10
    finally:
        runner.close(traj)


def test_symlinked_parent_of_a_hidden_test_is_replaced_not_followed(backend, tok):
    task = Task("nested", "", {"app.py": "def add(a, b):\n    return a - b\n"},
                {"tests/test_hidden.py": "from app import add\nassert add(2, 3) == 5\n"},
                python_test("tests/test_hidden.py"))
    runner = RolloutRunner(backend, tok)
    traj = runner.start(task)
    try:
        # the agent points tests/ at a directory of its own holding a passing file of the same name
        traj.sandbox.exec("mkdir decoy && echo pass > decoy/test_hidden.py && ln -s decoy tests")
        assert runner.grade(traj) == 0.0
        assert traj.sandbox.read_file("decoy/test_hidden.py") == b"pass\n"
    finally:
        runner.close(traj)


def test_partial_rollout_park_resume_matches_uninterrupted_scripted(backend, tok):
    tasks = [BUILTIN_TASKS["fix_greet"], BUILTIN_TASKS["fix_add"]]  # fix_greet is shorter: finishes first
    ref_runner = RolloutRunner(backend, tok, chunk=5)
    refs = [ref_runner.start(t) for t in tasks]
    ref_runner.run(refs, ScriptedPolicy(tok))
    runner = RolloutRunner(backend, tok, chunk=5)
    trajs = [runner.start(t) for t in tasks]
    try:
        done, parked = runner.run_partial(trajs, ScriptedPolicy(tok, version=1), lam=0.5)
        assert [t.task.name for t in done] == ["fix_greet"] and [t.task.name for t in parked] == ["fix_add"]
        p = parked[0]
        assert p.sandbox.state == "paused" and p.partial  # parked mid-turn, tokens so far kept
        kept = list(p.ids) + list(p.partial)
        runner.resume(p)
        runner.run([p], ScriptedPolicy(tok, version=2))
        assert p.ids[:len(kept)] == kept  # never re-tokenised: the old tokens are a prefix of the new ones
        for t, r in zip(trajs, refs):
            assert t.ids == r.ids and t.tool_outputs == r.tool_outputs and t.gen_mask == r.gen_mask
        gen_versions = [v for v, g in zip(p.versions, p.gen_mask) if g]
        assert set(gen_versions) == {1, 2} and gen_versions == sorted(gen_versions)
        assert all(v is None for v, g in zip(p.versions, p.gen_mask) if not g)
        assert runner.grade(p) == 1.0
    finally:
        for t in trajs + refs:
            runner.close(t)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny"))
    m.reset_parameters(seed=3)
    return m.eval()


def engine_cfg():
    return EngineConfig(memory_bytes=32 << 20, block_size=16, match_unit=4, max_batch_tokens=256, max_num_seqs=4,
                        max_model_len=400)


def test_tiny_model_greedy_park_resume_same_tokens_and_versions(tok, tiny):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = BUILTIN_TASKS["fix_add"]
        ref_runner = RolloutRunner(None, tok, max_turns=1, max_turn_tokens=24, chunk=24)
        ref = ref_runner.start(task, with_sandbox=False)
        ref_pol = EnginePolicy(tiny, tok, engine_cfg(), version=1)
        ref_runner.run([ref], ref_pol)
        runner = RolloutRunner(None, tok, max_turns=1, max_turn_tokens=24, chunk=8)
        traj = runner.start(task, with_sandbox=False)
        pol = EnginePolicy(tiny, tok, engine_cfg(), version=1)
        runner.step(traj, pol)
        assert traj.status == "running" and len(traj.partial) == 8  # parked mid-turn
        runner.park(traj)
        pol.set_version(2)  # same weights, new version: the resumed turn cannot use the parked turn's cache
        runner.resume(traj)
        runner.run([traj], pol)
        assert traj.generated == ref.generated and len(ref.generated) > 0
        a = [x for x, g in zip(traj.logprobs, traj.gen_mask) if g]
        b = [x for x, g in zip(ref.logprobs, ref.gen_mask) if g]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    finally:
        torch.set_num_threads(n)


def test_new_policy_version_never_hits_old_cache(tok, tiny):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = RolloutRunner(None, tok, max_turns=1, max_turn_tokens=16, chunk=4)
        pol = EnginePolicy(tiny, tok, engine_cfg(), version=1)
        t1 = runner.start(BUILTIN_TASKS["fix_add"], with_sandbox=False)
        runner.step(t1, pol)
        runner.step(t1, pol)
        assert any(rep.restored_tokens > 0 for v, rep in pol.cache_reports if v == 1)  # the cache does work
        pol.set_version(2)
        runner.step(t1, pol)
        reps = [rep for v, rep in pol.cache_reports if v == 2]
        assert reps and reps[0].restored_tokens == 0 and reps[0].matched_tokens == 0
        versions = list(t1.partial_versions)
        assert versions == [1] * 8 + [2] * (len(versions) - 8)
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def live_serve(tok, tiny):
    """`k3 serve`'s app on uvicorn, 127.0.0.1, a free port, in a thread (the tiny random model)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with local_server(create_app(LLMEngine(tiny, tok, engine_cfg()), tok, "k3-tiny", api_key="k")) as url:
        yield url
    torch.set_num_threads(n)


def test_serve_policy_park_resume_over_http_equals_uninterrupted(tok, tiny, live_serve):
    """Raw-token continuation over HTTP (token ids in, token ids out): parking mid-turn and resuming, under the
    same or a new policy version, gives the uninterrupted run's tokens, and those equal the in-process engine's."""
    task = BUILTIN_TASKS["fix_add"]
    ref_runner = RolloutRunner(None, tok, max_turns=1, max_turn_tokens=24, chunk=24)
    ref = ref_runner.start(task, with_sandbox=False)
    ref_pol = ServePolicy(live_serve, "k3-tiny", tok, api_key="k", version=10)
    ref_runner.run([ref], ref_pol)
    eng_ref = ref_runner.start(task, with_sandbox=False)
    ref_runner.run([eng_ref], EnginePolicy(tiny, tok, engine_cfg(), version=0))
    assert ref.generated == eng_ref.generated and len(ref.generated) > 8
    for resume_version in (11, 12):
        runner = RolloutRunner(None, tok, max_turns=1, max_turn_tokens=24, chunk=8)
        traj = runner.start(task, with_sandbox=False)
        pol = ServePolicy(live_serve, "k3-tiny", tok, api_key="k", version=11)
        runner.step(traj, pol)
        assert traj.status == "running" and len(traj.partial) == 8
        kept = traj.ids + traj.partial
        runner.park(traj)
        pol.set_version(resume_version)
        runner.resume(traj)
        runner.run([traj], pol)
        assert traj.ids[:len(kept)] == kept and traj.generated == ref.generated
        a = [x for x, g in zip(traj.logprobs, traj.gen_mask) if g]
        b = [x for x, g in zip(ref.logprobs, ref.gen_mask) if g]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
        resumed = pol.cache_reports[1][1]
        if resume_version == 11:  # same version: the resumed turn restores state, not re-reading the prompt
            assert resumed["restored_tokens"] >= (traj.prompt_len // 4) * 4 > 0
        else:  # new version: nothing of version 11 is hit
            assert resumed["matched_tokens"] == 0
        assert [v for v, g in zip(traj.versions, traj.gen_mask) if g] == [11] * 8 + [resume_version] * (len(a) - 8)
        pol.close()
    ref_pol.close()
