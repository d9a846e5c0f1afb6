"""Programmatic dependent launch in decode's kernels (k3.ops._pdl_triton, K3_PDL).

With the switch on, every launch decode's kernel modules make asks for PDL and hands its kernel PDL=True; each
such kernel, compiled for sm_90 by ptxas (no GPU needed), waits (`griddepcontrol.wait`) before its first global
load, store or atomic, lets the next kernel launch only after that wait, and prefetches into L2 only before it.
Without CUDA the launches are recorded, not run (the interpreter cannot run the wait), and, with the wait a no-op and
each bulk prefetch recorded instead of issued, run under the interpreter: outputs as without PDL, every prefetch
aligned and inside a tensor its kernel was given. On a GPU (CUDA tests), each kernel's outputs with PDL (or the
LAUNCH prefetch opt-ins) equal those without, bit for bit, and so do a graphed decode step's logits."""
import inspect
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from graphed_decode import bf16_tiny, graphed_decode_logits  # noqa: E402
from k3 import envs  # noqa: E402
from k3.ops import _pdl_triton as pdl  # noqa: E402
from k3.ops.kda_decode import force_fused_decode, kda_decode_step  # noqa: E402
from k3.ops.triton_dispatch import triton_module  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
bf16 = torch.bfloat16


def _rand(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, dtype=bf16, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


# Each case: decode's kernel module function on `small`'s widths at one or a few rows, returning what it writes.
def _gemv_split_k():  # o_proj at one row: K split, then the reduce kernel
    r = _rand(1)
    return [triton_module("_gemv_triton").decode_gemv(r(1, 1536), r(1536, 1536, scale=0.03), None, r(1, 1536))]


def _gemv_norm():  # MLA's q_b with the q_a norm in its prologue
    r = _rand(2)
    return [triton_module("_gemv_triton").decode_gemv(r(1, 384), r(2304, 384, scale=0.05), None, None,
                                                       norm_weight=r(384), norm_eps=1e-6)]


def _gemv_pair():  # the shared experts' down (GLU) + the routed up (norm), split
    r = _rand(3)
    return [triton_module("_gemv_triton").decode_gemv_pair(r(1, 1024), r(1536, 1024, scale=0.03), r(1, 1024), 4.0,
                                                            25.0, r(1, 768), r(1536, 768, scale=0.03), r(768), 1e-6)]


def _gemv_odd_widths():  # rows of 258 bytes: not aligned for a bulk prefetch, so none is made
    r = _rand(12)
    return [triton_module("_gemv_triton").decode_gemv(r(3, 129), r(37, 129), None, None)]


def _router():
    r = _rand(4)
    return list(triton_module("_router_triton").route_tokens(r(2, 1536), r(64, 1536, dtype=torch.float32, scale=0.03),
                                                             r(64, dtype=torch.float32, scale=0.01), 8, True, 2.5))


def _router_odd_widths():  # 37 experts (the last program's rows masked), 200 columns
    r = _rand(13)
    return list(triton_module("_router_triton").route_tokens(r(1, 200), r(37, 200, dtype=torch.float32),
                                                             r(37, dtype=torch.float32), 5, False, 1.0))


def _mix_norm():
    r = _rand(5)
    out = triton_module("_attn_res_norm_triton").mix_norm_forward(
        r(1536), r(1, 1536), 1e-6, tuple(r(1, 1, 1536) for _ in range(4)), r(1536), 1e-6, add=r(1, 1, 1536))
    return [t for t in out if t is not None]


def _experts(tokens):
    r = _rand(6 + tokens)
    idx = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(t))[:8] for t in range(tokens)])
    return (r(tokens, 768), idx.to(DEVICE), r(tokens, 8, dtype=torch.float32).abs(), r(64, 512, 768, scale=0.03),
            r(64, 512, 768, scale=0.03), r(64, 768, 512, scale=0.03), 4.0, 25.0)


def _slot_major():
    return [triton_module("_moe_decode_triton").selected_experts_situ_mlp(*_experts(1))]


def _expert_major():
    return [triton_module("_moe_expert_major_triton").expert_major_situ_mlp(*_experts(24))]


def _kda():
    from test_kda_decode_triton import step_case
    feats, weights, state, tails = step_case(7, 2, 4, 128, 128, 32, 4, 3, dtype=bf16)
    with force_fused_decode(True):
        out = kda_decode_step(*feats, weights, state, *tails, torch.tensor([2, 0], device=DEVICE))
    return [out, state, *tails]


def _mla():
    from test_mla_static_decode_triton import case
    args = case(2, 12, 256, 64, 640, 630, bf16, 8)  # near the capacity: a look-ahead past it would show
    tickets = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    out = triton_module("_mla_static_decode_triton").static_decode_attention(*args, 0.07, tickets)
    return [out, args[4], args[5], tickets]


def _mxfp4_selected():  # packed MXFP4 experts at decode (issue 22's kernel), 2 tokens of top-4 of 16
    g = torch.Generator().manual_seed(10)
    E, L, I = 16, 256, 256
    packed = lambda out, inp: (torch.randint(0, 256, (E, out, inp // 2), generator=g, dtype=torch.uint8).to(DEVICE),  # noqa: E731
                               torch.randint(120, 126, (E, out, inp // 32), generator=g, dtype=torch.uint8).to(DEVICE))
    idx = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(2)]).to(DEVICE)
    return [triton_module("_mxfp4_triton").selected_situ_mlp(_rand(11)(2, L), idx, packed(I, L), packed(I, L),
                                                              packed(L, I), 4.0, 25.0)]


CASES = {"gemv_split_k": _gemv_split_k, "gemv_norm": _gemv_norm, "gemv_pair": _gemv_pair,
         "gemv_odd_widths": _gemv_odd_widths, "router": _router, "router_odd_widths": _router_odd_widths,
         "mix_norm": _mix_norm, "slot_major": _slot_major, "expert_major": _expert_major, "kda": _kda, "mla": _mla,
         "mxfp4_selected": _mxfp4_selected}


def test_the_switch_is_off_by_default_and_never_on_off_the_gpu(monkeypatch):
    assert not envs.parse({}).pdl and envs.parse({"K3_PDL": "1"}).pdl and not envs.parse({"K3_PDL": "0"}).pdl
    with envs.override(pdl=True):
        cpu = torch.zeros(1)
        assert pdl.launch(cpu) == {"PDL": False}  # a CPU tensor: the interpreter
        assert not pdl.prefetching(pdl.launch(cpu), cpu, cpu, opted_in=True)  # a LAUNCH's opt-in: CUDA only
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        with envs.override(pdl=False):
            assert pdl.launch(x) == {"PDL": False}
        with envs.override(pdl=True):
            on = torch.cuda.get_device_capability() >= (9, 0)
            assert pdl.launch(x) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})


def test_prefetch_needs_16_byte_rows():
    w = torch.zeros(8, 24, dtype=bf16)
    assert pdl.prefetchable(w)  # rows of 48 bytes
    assert not pdl.prefetchable(torch.zeros(8, 20, dtype=bf16))  # rows of 40 bytes
    assert not pdl.prefetchable(w.view(-1)[1:].view(-1)[:184].view(8, 23))  # a base off by 2 bytes


_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32", torch.uint8: "u8"}


def _triton_type(value):
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, (tuple, list)):
        return [_triton_type(v) for v in value]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _divisible(args: dict, signature: dict) -> tuple[str, ...]:
    """The integer arguments a launch specialises as multiples of 16."""
    return tuple(k for k, t in signature.items() if t in ("i32", "i64") and args[k] % 16 == 0)


def _unaligned(args: dict, signature: dict) -> tuple[str, ...]:
    """The tensor arguments a launch does not specialise as 16-byte aligned (column slices off a boundary)."""
    return tuple(k for k, t in signature.items() if isinstance(t, str) and t.startswith("*")
                 and args[k].data_ptr() % 16)


def recorded_launches(case, monkeypatch) -> list[tuple]:
    """(the @triton.jit function, its arguments by name, launch options) of every launch `case` makes with PDL
    switched on; the kernels are not run."""
    from k3.ops import _gemv_triton
    kernel_type = type(_gemv_triton._gemv_kernel)  # the interpreter's function, or Triton's JITFunction on a GPU
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        named = dict(zip(inspect.signature(fn).parameters, args))
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in inspect.signature(fn).parameters}
        launches.append((fn, {**named, **kwargs}, options))

    monkeypatch.setattr(kernel_type, "run", record)
    monkeypatch.setattr(pdl, "launch", lambda t: dict(PDL=True, launch_pdl=True))
    case()
    return launches


_STORE = re.compile(r"\b(st\.global|atom\.|red\.global)")
_LOAD = re.compile(r"\b(ld\.global|cp\.async\.(?!bulk\.prefetch))")
# Kernels that read something before the wait, for their prefetch's addresses alone (see each kernel).
READS_BEFORE_WAIT = {"k3.ops._moe_decode_triton._gate_up_kernel", "k3.ops._moe_decode_triton._down_kernel",
                     "k3.ops._kda_decode_triton.kda_decode_kernel", "k3.ops._mxfp4_triton._expert_gemm_kernel"}


def assert_waits_first(ptx: str, plain_ptx: str, prefetch: bool, reads_before: bool) -> None:
    """The PTX of a PDL kernel against the same kernel's without PDL (`plain_ptx`): the wait before any global
    store or atomic and before every load the plain kernel makes (as many after the wait as there; with
    `reads_before`, the prefetch's own reads may come before it, never in place of a later one); the next kernel
    let go after the wait; bulk L2 prefetches (where it makes them) before the wait (and in its loops, ahead)."""
    lines = ptx.splitlines()
    at = lambda pattern: [i for i, line in enumerate(lines) if re.search(pattern, line)]  # noqa: E731
    wait, go = at("griddepcontrol\\.wait"), at("griddepcontrol\\.launch_dependents")
    assert len(wait) == 1 and len(go) == 1 and wait[0] < go[0], (wait, go)
    stores, loads, prefetches = at(_STORE), at(_LOAD), at("cp\\.async\\.bulk\\.prefetch\\.L2")
    assert stores and min(stores) > wait[0], lines[min(stores)]
    assert sum(i > wait[0] for i in loads) == len(_LOAD.findall(plain_ptx))
    assert reads_before or not any(i < wait[0] for i in loads), [lines[i] for i in loads if i < wait[0]]
    assert bool(prefetches) == prefetch and (not prefetch or min(prefetches) < wait[0])


@pytest.mark.parametrize("name", CASES)
def test_every_launch_waits_before_it_touches_memory_on_the_h200(name, monkeypatch):
    from sm90_compile import ptx_for_sm90

    launches = recorded_launches(CASES[name], monkeypatch)
    assert launches
    for fn, args, options in launches:
        params = inspect.signature(fn).parameters
        constexpr = {k for k, p in params.items() if p.annotation is not inspect.Parameter.empty}
        assert args.get("PDL") is True and options.get("launch_pdl") is True, (fn.__name__, options)
        signature = {k: _triton_type(v) for k, v in args.items() if k not in constexpr}
        constexprs = {k: v for k, v in args.items() if k in constexpr}
        if "DOT_IN_FP32" in constexprs:  # the card's launch: its bf16 tiles go in as they are (fp32: the interpreter)
            constexprs["DOT_IN_FP32"] = False
        if "USE_ASM" in constexprs:  # the card's launch: the MXFP4 kernels' inline PTX (none under the interpreter)
            constexprs["USE_ASM"] = True
        ptx, plain = (ptx_for_sm90(fn.__module__, fn.__name__, signature, num_warps=options.get("num_warps", 4),
                                   divisible=_divisible(args, signature), unaligned=_unaligned(args, signature),
                                   **{**constexprs, **off})
                      for off in ({}, {k: False for k in ("PDL", "PREFETCH") if k in constexprs}))
        assert "griddepcontrol" not in plain
        assert_waits_first(ptx, plain, prefetch=bool(constexprs.get("PREFETCH")),
                           reads_before=f"{fn.__module__}.{fn.__name__}" in READS_BEFORE_WAIT)
    # the kernels that stream weights, states or cache rows prefetch them (not the mix, the split-K reduce or the
    # combine, whose inputs the kernel before writes)
    prefetching = {fn.__name__ for fn, args, _ in launches if args.get("PREFETCH")}
    wanted = {"gemv_split_k": {"_gemv_kernel"}, "gemv_norm": {"_gemv_kernel"}, "gemv_pair": {"_gemv_pair_kernel"},
              "router": {"_router_kernel"}, "router_odd_widths": {"_router_kernel"},
              "expert_major": {"_gate_up_kernel", "_down_kernel"},
              "slot_major": {"_gate_up_kernel", "_down_kernel"}, "kda": {"kda_decode_kernel"},
              "mla": {"_static_decode_kernel"}, "mxfp4_selected": {"_expert_gemm_kernel"}}
    assert prefetching == wanted.get(name, set())


@pytest.mark.parametrize("name", ["gemv_norm", "router", "slot_major", "expert_major", "kda", "mla"])
def test_pdl_without_prefetch_keeps_the_launches_and_drops_every_prefetch(name, monkeypatch):
    """K3_NO_PDL_PREFETCH: every launch still asks for PDL (its wait and early launch), none prefetches, and the
    LAUNCH opt-ins of the kernels that have one still prefetch on their own (they are not PDL's)."""
    with envs.override(no_pdl_prefetch=True):
        launches = recorded_launches(CASES[name], monkeypatch)
    assert launches and all(args.get("PDL") is True and options.get("launch_pdl") is True
                            for _, args, options in launches)
    assert not any(args.get("PREFETCH") for _, args, _ in launches), [fn.__name__ for fn, a, _ in launches
                                                                     if a.get("PREFETCH")]
    with envs.override(no_pdl_prefetch=False):  # the same cases prefetch with it off (what the switch removes)
        assert any(args.get("PREFETCH") for _, args, _ in recorded_launches(CASES[name], monkeypatch))


PREFETCH_OPT_IN = ("_kda_decode_triton", "_mla_static_decode_triton", "_moe_expert_major_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the kernels: CUDA only (the interpreter has no wait)")
@pytest.mark.parametrize("name", CASES)
def test_outputs_with_pdl_or_prefetch_equal_those_without(name, monkeypatch):
    """Each case plain, under PDL, and with the LAUNCH prefetch opt-ins alone: the same bits."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    results = []
    for mode in ("plain", "pdl", "prefetch"):
        with monkeypatch.context() as m, envs.override(pdl=mode == "pdl"):
            for module in PREFETCH_OPT_IN:
                m.setitem(triton_module(module).LAUNCH, "prefetch", mode == "prefetch")
            results.append(CASES[name]())
        torch.cuda.synchronize()
    for plain, *others in zip(*results):
        assert all(torch.equal(plain, other) for other in others)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: CUDA only")
@pytest.mark.parametrize("batch", [1, 8])
def test_a_graphed_decode_step_with_pdl_equals_one_without(batch):
    """The decode step captured in one CUDA graph with every decode kernel launched under PDL (programmatic edges
    in the graph) gives the logits the step without PDL gives, bit for bit, over several steps (a kernel that read
    its predecessor's output before the wait would read it stale)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    model = bf16_tiny(2)
    T, n = 24, 6
    ids = torch.randint(0, model.config.vocab_size, (batch, T + n), device="cuda")
    logits = []
    for on in (False, False, True):  # two captures without PDL first: the step must be deterministic for the check
        with envs.override(pdl=on):
            logits.append(graphed_decode_logits(model, ids, T))
    assert torch.equal(logits[0], logits[1]), "two captures without PDL differ: the comparison below means nothing"
    assert torch.equal(logits[0], logits[2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels under the CPU interpreter")
@pytest.mark.parametrize("name", CASES)
def test_prefetches_stay_inside_their_tensors_and_change_nothing(name, monkeypatch):
    """Each case run under the interpreter with PDL on (the wait a no-op, each bulk prefetch recorded instead of
    issued, `launch_pdl` dropped), against the case with it off: the same outputs bit for bit (the prefetch
    branches and the reads before the wait change nothing), and every prefetch 16-byte aligned, a multiple of 16
    bytes, and inside the storage of a tensor its kernel was given (never memory a launch does not own)."""
    from k3.ops import _gemv_triton

    plain = CASES[name]()
    prefetches, owned = [], []

    def record(ptrs, nbytes):  # in place of the PTX (called with the interpreter's tensors)
        for p, n in zip(ptrs.handle.data.reshape(-1).tolist(), nbytes.handle.data.reshape(-1).tolist()):
            if n:
                prefetches.append((int(p), int(n)))

    kernel_type = type(_gemv_triton._gemv_kernel)
    run = kernel_type.run

    def run_and_note(self, *args, **kwargs):  # the storage of every tensor a launch is given
        for a in [*args, *kwargs.values()]:
            for t in (a if isinstance(a, (tuple, list)) else [a]):
                if isinstance(t, torch.Tensor):
                    owned.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(kernel_type, "run", run_and_note)
    monkeypatch.setattr(pdl, "_prefetch_l2", record)
    monkeypatch.setattr(pdl, "gdc_wait", lambda: None)
    monkeypatch.setattr(pdl, "gdc_launch_dependents", lambda: None)
    monkeypatch.setattr(pdl, "launch", lambda t: dict(PDL=True, launch_pdl=True))
    for a, b in zip(plain, CASES[name]()):
        assert torch.equal(a, b)
    assert bool(prefetches) == (name not in ("mix_norm", "gemv_odd_widths"))  # waits only / rows unaligned
    for p, n in prefetches:
        assert p % 16 == 0 and n % 16 == 0, (p, n)
        assert any(start <= p and p + n <= start + size for start, size in owned), (p, n)
