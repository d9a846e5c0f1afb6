"""Every `K3_*` environment switch of the model and its kernels, declared and parsed once, at import.

- K3_NO_FLA: unset, "" or "0" leaves fla on; anything else keeps KDA's core off flash-linear-attention.
- K3_NO_TRITON: "1" turns every k3 Triton kernel off; or a comma list of kernel modules ("_conv_triton,...").
- K3_TRITON: "all", or a comma list of opt-in kernel modules to switch on (k3.ops.triton_dispatch.OPT_IN).
- K3_FLA_LEAN: unset or "1" sends inference's chunked KDA and gated output norm through k3.ops.kda_fla_lean (fla's
  forward internals without its training entries' per-call host work; fla 0.6.x only, else its public functions);
  "0" keeps fla's public entries. On by default since an H200 run timed it (64 streams: 18-50% off a mixed step).
- K3_FLA_KEEP_FORWARD: unset or "1" makes a training call of fla's chunked KDA keep its forward's intermediates for
  the backward (fla's disable_recompute: the gate cumsum, w, u, the gated q and k, v_new and the chunk states)
  instead of recomputing them there; "0" recomputes them (the gate cumsum, the w/u kernel and the chunk-state pass
  run again). Keeping costs 0.84 GiB a KDA layer at small's 8 x 4096 (10 GiB for its 12); on by default since an
  H200 step timed it (with K3_KDA_BWD=wy: 345 ms against 359-388 at 8 x 4096, 417 against 434-437 at 2 x 16384).
  On an H100's 80 GB it fits at 8 x 4096 and 2 x 16384 since the AttnRes mixes take their norm (73.7-73.8 GiB peak;
  session 41 with documents of 512: 338, 339 and 340, 341 ms, steady, against 347-350 recomputing); at session 40's
  76.4 GiB its step time varied (343-388 ms over four runs).
- K3_KDA_BWD: which stages of fla's KDA chunk backward run k3's Triton kernels (k3.ops.kda_fla_backend, registered
  with fla's backend dispatcher): "wy" (default, or unset) chunk_kda_bwd_wy_dqkg_fused alone, "k3" it and
  chunk_kda_bwd_intra, "intra" that one alone, "fla" none. On an H200 at small's 8 x 4096 the WY stage takes
  1.0 ms a call against fla's 2.45 (on an H100 with packed documents, fla's varlen layout, 1.2 against 2.7);
  k3's intra stage 2.2 against fla's 1.56, so it stays opt-in.
- K3_REQUIRE_FLA: "1" makes the GPU tests fail, not skip, when fla does not import.
- K3_ROUTER_FP32: "1" computes the MoE router's GEMM on fp32 copies of a bf16/fp16 x and weight (the reference,
  k3.ops.router.router_scores_reference) instead of one GEMM of them as stored with fp32 output.
- K3_AUTOTUNE_TABLE: the autotune choices pinned before fla's kernels first run (k3.ops.tuning): unset, the shipped
  table; a path, that file; "off", none (Triton autotunes every kernel).
- K3_PRECOMPILE_WORKERS: processes that compile the table's kernels ahead of their first call (k3.ops.precompile);
  default half the cores, at most 8; 0: none.
- K3_NO_SHARED_INPUT_GRAD: "1" lets autograd sum the input gradients of a mixer's (or MoE's) input projections,
  one nn.Linear each, instead of one accumulating backward (k3.ops.fused_linear).
- K3_NO_BLOCK_GRAD_BUFFER: "1" lets autograd sum the gradients of the AttnRes blocks over the mixes that read them,
  instead of each mix's backward adding into one buffer per block (k3.model.attn_res).
- K3_NO_RESIDUAL_ADD_FOLD: "1" keeps each residual add before a training AttnRes mix as its own op, instead of in
  the mix kernel's forward launch (k3.model.attn_res._AttnResAddMixFused); for timing the fold against it.
- K3_NO_MIX_NORM_FOLD: "1" keeps the RMSNorm after a training AttnRes mix as its own op (a pass each way over
  the mix's output), instead of in the mix kernels (k3.model.attn_res: the forward writes the norm's output only,
  the backward recomputes the mix); for timing the fold against it.
- K3_NO_QK_NORM_FOLD: "1" keeps a training KDA layer's q/k L2 norms in its core (fla's l2norm kernels, a pass each
  way over q and over k), instead of in the q/k short convs' kernels (k3.model.kda.DenseLayout, k3.ops.conv
  `l2_head`: the forward normalises each head as it stores SiLU(conv), the backward takes the norm's gradient from
  the rows it recomputes); for timing the fold against it.
- K3_PDL: "1" launches decode's Triton kernels with programmatic dependent launch (Hopper and later: each may start
  while the kernel before it runs, prefetching its weights into L2, and waits for it before reading anything;
  k3.ops._pdl_triton). Off by default: slower on an H200 (session 29, `bench_gpu_decode.py --pdl`, small's graphed
  step at 4K context, batch 1 / 8 / 64: 1.16 / 2.13 / 4.20 ms against 1.08 / 1.91 / 3.57 without; the L2 prefetches
  it turns on slowed MLA's decode kernel 2x in its sweep).
- K3_NO_PDL_PREFETCH: "1" keeps K3_PDL's overlapped launches but makes no L2 prefetch under them (each kernel only
  waits for the one before and lets the next start): times the launch overlap apart from the prefetches.
- K3_COMMIT: a commit id the benchmarks stamp on their results (default: `git rev-parse`).
- K3_API_KEY: the key `k3 serve` requires ('Authorization: Bearer KEY') when --api-key is not given (as vLLM's
  VLLM_API_KEY): a key on the command line shows in `ps`, one in the environment does not.

Read elsewhere, by design, and listed here so that this page names every variable:
- K3_CPU_THREADS: "auto" (default), "off" or a thread count; read by k3.cpu_threads before torch is imported
  (OpenMP takes its settings once, at load), so it cannot wait for this module.
- K3_AGENTENV_ROOT, K3_AGENTENV_UID, K3_AGENTENV_UID_BASE, K3_AGENTENV_UID_COUNT, K3_AGENTENV_TOKEN, K3_FC_KERNEL,
  K3_FC_ROOTFS: the sandboxes' own, read by k3.agentenv where it starts a sandbox or its control plane.
- K3_KIMI_TOKENIZER: a directory of the released tokenizer files, for the test of SPEC's reference ids.

Code reads `k3.envs.current()`, never `os.environ`: a switch flipped in the environment after import has no
effect (the value is fixed for the process, as a kernel choice must be for a captured CUDA graph). Tests and
benchmarks that compare paths use `override(...)`, which sets the values explicitly for a `with` block.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping


ALL = "all"


@dataclasses.dataclass(frozen=True)
class Switches:
    no_fla: bool = False
    fla_lean: bool = True
    fla_keep_forward: bool = True
    kda_bwd: str = "wy"  # "fla", "k3", "wy" or "intra"
    no_triton: frozenset[str] | str = frozenset()  # ALL, or kernel module names
    triton_opt_in: frozenset[str] | str = frozenset()  # ALL, or kernel module names
    require_fla: bool = False
    router_fp32: bool = False
    no_shared_input_grad: bool = False
    no_block_grad_buffer: bool = False
    no_residual_add_fold: bool = False
    no_mix_norm_fold: bool = False
    no_qk_norm_fold: bool = False
    pdl: bool = False
    no_pdl_prefetch: bool = False
    commit: str | None = None
    autotune_table: str | None = None  # None: the shipped table; "off"; or a path
    precompile_workers: int | None = None  # None: automatic
    api_key: str | None = dataclasses.field(default=None, repr=False)  # a secret: never in a repr or a log

    def triton_off(self, name: str) -> bool:
        return self.no_triton == ALL or name in self.no_triton

    def triton_opted_in(self, name: str) -> bool:
        return self.triton_opt_in == ALL or name in self.triton_opt_in


def _flag(text: str) -> bool:
    return text not in ("", "0")


def _names(text: str, all_word: str) -> frozenset[str] | str:
    if text.strip() == all_word:
        return ALL
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def _count(name: str, text: str) -> int | None:
    if not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a count >= 0, got {text!r}")
    return value


KDA_BWD_CHOICES = ("fla", "k3", "wy", "intra")


def _kda_bwd(text: str) -> str:
    value = text.strip().lower() or "wy"
    if value not in KDA_BWD_CHOICES:
        raise ValueError(f"K3_KDA_BWD must be one of {KDA_BWD_CHOICES}, got {text!r}")
    return value


def parse(environ: Mapping[str, str]) -> Switches:
    """The switches an environment sets (unset variables take their defaults)."""
    get = lambda name: environ.get(name, "")  # noqa: E731
    return Switches(no_fla=_flag(get("K3_NO_FLA")), fla_lean=get("K3_FLA_LEAN") != "0",
                    fla_keep_forward=get("K3_FLA_KEEP_FORWARD") != "0", kda_bwd=_kda_bwd(get("K3_KDA_BWD")),
                    no_triton=_names(get("K3_NO_TRITON"), "1"),
                    triton_opt_in=_names(get("K3_TRITON"), ALL), require_fla=get("K3_REQUIRE_FLA") == "1",
                    router_fp32=get("K3_ROUTER_FP32") == "1",
                    no_shared_input_grad=_flag(get("K3_NO_SHARED_INPUT_GRAD")),
                    no_block_grad_buffer=_flag(get("K3_NO_BLOCK_GRAD_BUFFER")),
                    no_residual_add_fold=_flag(get("K3_NO_RESIDUAL_ADD_FOLD")),
                    no_mix_norm_fold=_flag(get("K3_NO_MIX_NORM_FOLD")),
                    no_qk_norm_fold=_flag(get("K3_NO_QK_NORM_FOLD")),
                    pdl=_flag(get("K3_PDL")), no_pdl_prefetch=_flag(get("K3_NO_PDL_PREFETCH")),
                    commit=get("K3_COMMIT") or None,
                    autotune_table=get("K3_AUTOTUNE_TABLE").strip() or None,
                    precompile_workers=_count("K3_PRECOMPILE_WORKERS", get("K3_PRECOMPILE_WORKERS")),
                    api_key=environ.get("K3_API_KEY"))  # set but empty stays "": `k3 serve` refuses it


_current = parse(os.environ)


def current() -> Switches:
    return _current


@contextlib.contextmanager
def override(**changes):
    """Within the block, the given fields replace the parsed values, e.g. `override(no_fla=True)` or
    `override(no_triton="all")`; a set of names may be given as a list or a comma-separated string."""
    global _current
    fields = {f.name for f in dataclasses.fields(Switches)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ValueError(f"unknown switch(es) {unknown}; known: {sorted(fields)}")
    for name in ("no_triton", "triton_opt_in"):
        value = changes.get(name)
        if isinstance(value, str) and value != ALL:
            changes[name] = _names(value, ALL)
        elif isinstance(value, (list, tuple, set)):
            changes[name] = frozenset(value)
    saved = _current
    _current = dataclasses.replace(saved, **changes)
    try:
        yield _current
    finally:
        _current = saved
