"""What one decode step launches: the ops of a `small` decode step that would each be a GPU kernel, counted on
any device and grouped by layer kind (KDA, MLA, MoE, dense MLP, AttnRes, head) and op.

The step is the one `generate` replays on CUDA (k3.model.cuda_graph.GraphedDecodeStep, its compiled form
without compile): projections fused, `model.model` over a StaticCache holding a short prefill, the cache's
length advanced, lm_head on the last position, and the greedy pick. It runs under a TorchDispatchMode that
counts every aten op except views and allocations (metadata only: no kernel), each k3::* custom op as one
(its insides are not seen), and every Triton kernel launched outside one. Reads of a value back to the host
are counted apart ("host reads"): not kernels, but each one stalls a GPU step.

On the CPU k3's Triton kernels run only under Triton's interpreter, so run this in a Python with triton and
TRITON_INTERPRET=1 (the lead's /work/tvenv): the kernels are then chosen as on CUDA, by the same switches
(K3_TRITON, K3_NO_TRITON; `--switches default,all` runs both), so the census reflects them. Without triton the
references run and are counted. fla never runs off CUDA: at the default switches KDA's core is counted as k3's
reference (fla's recurrent step is ~4 kernels there), with K3_TRITON=all it is k3's one-kernel step anyway.
The decode GEMV (k3.ops.gemv; on by default since session 26) is chosen by its shape rule as on CUDA
(`kernel_wins`: the narrow linears at <= 4 rows, <= 16 with a norm, GLU or gate before them, where it beat cuBLAS;
lm_head, the interpreter's slowest, is left to cuBLAS) and takes the MoE's routed norm, the shared experts'
SiTU-GLU and their `+ s` with it (3 ops fewer a MoE layer); its op counts as one, and is one kernel where K is split
too (session 31: the block's last split sums the splits). The float
decode experts' two kernels are counted as launched, their values from the reference (the interpreter's pace).
`--inside` also lists the tensor ops that k3's custom ops run in their bodies around the kernel: counted here
as part of one op, each is a kernel of its own on the GPU (in fp32, the default, a cast that bf16 weights would
launch is a no-op and not listed: `--dtype bf16` builds the model as the H200 decodes it, so such casts are counted,
as `_to_copy`, in the main table or inside).

Run: TRITON_INTERPRET=1 PYTHONPATH=src /work/tvenv/bin/python benchmarks/decode_op_census.py
     [--preset small] [--batch 1,64] [--layers N] [--switches default,all-_gemv_triton] [--ops 8] [--inside]
     [--dtype bf16]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from k3 import envs
from k3.config import K3Config, mla_layers_for
from k3.model.decoder import K3ForCausalLM
from k3.ops import triton_dispatch
from k3.ops.fused_linear import fuse_projections

sys.path.insert(0, os.path.dirname(__file__))
from op_census import HOST_READS, launches_kernel  # noqa: E402

_active_census: list = []  # the census running now (for launches counted without running them)
KINDS = ("embed", "KDA", "MLA", "MoE", "dense MLP", "AttnRes", "head", "cache")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Census(TorchDispatchMode):
    """Counts (kind, op) of every kernel-launching op under it; `kind` is set by the module hooks. With `inside`,
    also the tensor ops that k3's custom ops run around their kernels (`inside[kind, op, inner op]`): the census
    counts such an op as one, but on the GPU each of those is a kernel of its own."""

    def __init__(self, inside: bool = False):
        super().__init__()
        self.kinds = ["cache"]
        self.counts: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()
        self.inside: collections.Counter | None = collections.Counter() if inside else None
        self.in_custom_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name  # "aten::mm", "k3::route_tokens_decode"
        if name.split("::")[-1] in HOST_READS:
            self.host_reads[self.kinds[-1]] += 1
        if func.namespace == "k3":
            self.counts[self.kinds[-1], name] += 1
            self.in_custom_op += 1
            try:
                opdef = _maybe_get_opdef(func) if self.inside is not None else None
                if opdef is None:
                    return func(*args, **(kwargs or {}))
                with _InsideCustomOp(self, name):  # the op's Python body, its tensor ops seen
                    return opdef._init_fn(*args, **(kwargs or {}))
            finally:
                self.in_custom_op -= 1
        out = func(*args, **(kwargs or {}))
        if launches_kernel(func, args, out):
            self.counts[self.kinds[-1], name] += 1
        return out

    def triton_launch(self, kernel_name: str) -> None:
        if not self.in_custom_op:
            self.counts[self.kinds[-1], f"triton::{kernel_name}"] += 1

    @contextlib.contextmanager
    def kind(self, kind: str):
        self.kinds.append(kind)
        try:
            yield
        finally:
            self.kinds.pop()


class _InsideCustomOp(TorchDispatchMode):
    """Counts the kernel-launching tensor ops run in a k3 custom op's body into its census' `inside`; an op that
    returns one of its inputs (a `.contiguous()` or `.float()` that changes nothing) launches nothing."""

    def __init__(self, census: Census, op: str):
        super().__init__()
        self.census, self.op = census, op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {id(t) for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)}
        if launches_kernel(func, args, out) and not (isinstance(out, torch.Tensor) and id(out) in ins):
            self.census.inside[self.census.kinds[-1], self.op, func._schema.name] += 1
        return out


@contextlib.contextmanager
def kinds_from_modules(model: K3ForCausalLM, census: Census):
    """Module hooks that set the census' kind: the embedding, each mixer and FFN, the LM head; what runs between
    them inside the layer stack (the AttnRes mixes, the norms after them, the residual adds) is AttnRes."""
    kind_of = {model.model.embed_tokens: "embed", model.lm_head: "head"}
    for layer in model.model.layers:
        kind_of[layer.self_attn] = "MLA" if layer.is_mla else "KDA"
        kind_of[layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp] = (
            "MoE" if hasattr(layer, "block_sparse_moe") else "dense MLP")
    kind_of[model.model] = "AttnRes"
    handles = []
    for module, kind in kind_of.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, kind=kind: census.kinds.append(kind)))
        handles.append(module.register_forward_hook(lambda m, a, o: census.kinds.pop() and None))  # (None: o kept)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def counting_triton_launches(census: Census):
    """Every launch of a Triton kernel (a jit function's, an autotuner's or heuristics' outermost `run`) counted
    once, by kernel name. Only the interpreter's launches pass through `run` on the CPU; CUDA's too."""
    try:
        from triton.runtime import autotuner, interpreter, jit
    except ImportError:
        yield
        return
    classes = [jit.JITFunction, interpreter.InterpretedFunction, autotuner.Autotuner, autotuner.Heuristics]
    saved = {cls: cls.run for cls in classes}
    depth = 0

    def wrap(real):
        def run(self, *args, **kwargs):
            nonlocal depth
            if depth == 0:
                fn = self
                while hasattr(fn, "fn"):
                    fn = fn.fn
                census.triton_launch(getattr(fn, "__name__", type(fn).__name__))
            depth += 1
            try:  # the interpreter's own copies of the arguments are not the kernel's: outside the census
                with _disable_current_modes():
                    return real(self, *args, **kwargs)
            finally:
                depth -= 1
        return run

    for cls, real in saved.items():
        cls.run = wrap(real)
    try:
        yield
    finally:
        for cls, real in saved.items():
            cls.run = real


def _switched_on(name: str) -> bool:
    """Whether the switches choose kernel module `name` (not off, opted in where it must be) and it imports."""
    switches = envs.current()
    if switches.triton_off(name) or (name in triton_dispatch.OPT_IN and not switches.triton_opted_in(name)):
        return False
    return triton_dispatch.triton_module(name) is not None


def _use_triton_op_any_device(x, name: str) -> bool:
    """triton_dispatch.use_triton_op's rule without its CUDA test: a float tensor, triton there, the switches."""
    return (isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _switched_on(name))


@contextlib.contextmanager
def kernels_chosen_as_on_cuda():
    """k3's Triton kernels chosen on any device as on CUDA (the CPU runs them under TRITON_INTERPRET=1): the
    dispatch's device test is dropped where modules bound it, and the KDA decode step forced by its switches."""
    from k3.ops import kda_decode

    patched = [(mod, attr) for mod in list(sys.modules.values()) if getattr(mod, "__name__", "").startswith("k3.")
               for attr in ("use_triton_op",) if getattr(mod, attr, None) is triton_dispatch.use_triton_op]
    real = triton_dispatch.use_triton_op
    for mod, attr in patched:
        setattr(mod, attr, _use_triton_op_any_device)
    forced = contextlib.ExitStack()  # the selectors that test the device themselves, pinned by the switches
    forced.enter_context(kda_decode.force_fused_decode(_switched_on(kda_decode.KERNELS)))
    # (the decode GEMV needs no forcing: its selector's device test is use_triton_op's, patched above, and its
    # shape rule, gemv.kernel_wins, then chooses as on CUDA)
    experts = triton_dispatch.triton_module("_moe_decode_triton")
    real_experts = experts and experts.selected_experts_situ_mlp
    if experts is not None and os.environ.get("TRITON_INTERPRET") == "1":
        experts.selected_experts_situ_mlp = _experts_counted_not_interpreted
    try:
        with forced:
            yield
    finally:
        for mod, attr in patched:
            setattr(mod, attr, real)
        if experts is not None:
            experts.selected_experts_situ_mlp = real_experts


def _experts_counted_not_interpreted(z, idx, weights, w1, w3, w2, beta_gate, beta_up):
    """The float decode experts' two launches (gate+up, down), counted; their values from the reference, which the
    interpreter reaches much sooner than the kernels (tests/test_moe_slot_major_triton.py runs those)."""
    from k3.ops.moe_decode import selected_experts_situ_mlp_reference

    for census in _active_census[-1:]:
        census.triton_launch("_gate_up_kernel")
        census.triton_launch("_down_kernel")
    with _disable_current_modes():
        return selected_experts_situ_mlp_reference(z, idx, weights, w1, w3, w2, beta_gate, beta_up)


def model_for(preset: str, layers: int | None, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[K3Config, K3ForCausalLM]:
    """The preset (cut to `layers`) in `dtype` (bf16 as the H200 decodes: the casts its weights make are then
    ops of their own, counted), eval mode, seeded."""
    cfg = K3Config.preset(preset)
    if layers is not None and layers != cfg.num_hidden_layers:
        mla = mla_layers_for(layers)
        cfg = cfg.replace(num_hidden_layers=layers, linear_attn_config={
            "full_attn_layers": mla, "kda_layers": [l for l in range(1, layers + 1) if l not in mla]})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device, dtype).eval()
    with torch.no_grad():  # non-zero AttnRes queries: softmaxes that are not means (the counts do not care)
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
    return cfg, model


@torch.no_grad()
def census_of_step(model: K3ForCausalLM, batch: int, prompt: int = 8, inside: bool = False) -> Census:
    """The counts of one decode step at `batch` rows after a `prompt`-token prefill (not counted); with `inside`,
    the ops inside k3's custom ops too (Census.inside)."""
    cfg = model.config
    cache = model.new_cache(batch, prompt + 3)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=model.device)
    logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
    tokens = logits.argmax(-1)[:, None]
    fuse_projections(model)  # as GraphedDecodeStep does before capture
    # k3's kernels as on CUDA where they can run: on CUDA, or on the CPU under Triton's interpreter
    runnable = model.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    chosen = kernels_chosen_as_on_cuda if runnable else contextlib.nullcontext
    with chosen():  # a warm-up step, as before a capture: workspaces made once are not counted
        tokens = model(tokens, cache=cache).logits.argmax(-1)
    census = Census(inside)
    _active_census.append(census)
    with chosen(), kinds_from_modules(model, census), counting_triton_launches(census), census:
        h = model.model(tokens, cache=cache)  # GraphedDecodeStep's forward: the stack, advance, lm_head
        cache.advance(1)
        with census.kind("head"):
            model.lm_head(h[:, -1]).argmax(-1)
    _active_census.pop()
    return census


def layer_counts(cfg: K3Config) -> dict[str, int]:
    L = cfg.num_hidden_layers
    moe = sum(cfg.is_moe(l) for l in range(L))
    mla = sum(cfg.is_mla(l) for l in range(L))
    return {"KDA": L - mla, "MLA": mla, "MoE": moe, "dense MLP": L - moe}


def print_tables(cfg, results: dict, top_ops: int) -> None:
    """results[(switches, batch)] = Census. One table of kinds × runs, then each kind's largest ops."""
    runs = list(results)
    per = layer_counts(cfg)
    head = " | ".join(f"{s}, B={b}" for s, b in runs)
    print(f"\n| kind (layers) | {head} |\n|---|" + "---:|" * len(runs))
    for kind in KINDS:
        cells = []
        for run in runs:
            n = sum(c for (k, _), c in results[run].counts.items() if k == kind)
            cells.append(f"{n}" + (f" ({n / per[kind]:.1f}/layer)" if per.get(kind) else ""))
        if any(c != "0" for c in cells):
            print(f"| {kind}{f' ({per[kind]})' if kind in per else ''} | " + " | ".join(cells) + " |")
    totals = [sum(results[r].counts.values()) for r in runs]
    print("| **total kernels** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    print("| host reads | " + " | ".join(str(sum(results[r].host_reads.values())) for r in runs) + " |")
    for run in runs:
        print(f"\n{run[0]} switches, batch {run[1]}: the largest ops of each kind (count in the step)")
        for kind in KINDS:
            ops = sorted(((c, op) for (k, op), c in results[run].counts.items() if k == kind), reverse=True)
            if ops:
                shown = ", ".join(f"{op.removeprefix('aten::')} {c}" for c, op in ops[:top_ops])
                print(f"  {kind}: {shown}" + (", ..." if len(ops) > top_ops else ""))


def print_inside(results: dict) -> None:
    """The tensor ops run inside k3's custom ops, per run: kernels the main table counts as part of one op."""
    for run, census in results.items():
        if census.inside is None:
            continue
        total = sum(census.inside.values())
        print(f"\n{run[0]} switches, batch {run[1]}: {total} tensor ops inside k3 custom ops (each a kernel more)")
        for (kind, op, inner), c in sorted(census.inside.items(), key=lambda kv: -kv[1]):
            print(f"  {kind}: {op.removeprefix('k3::')} runs {inner.removeprefix('aten::')} x{c}")


def switch_values(spec: str) -> dict:
    """k3.envs fields of a run: 'default' (no opt-in kernels), 'all' (K3_TRITON=all), 'all-NAME[-NAME...]' (all
    but those kernel modules: the census before one), 'env' (the switches as set)."""
    if spec == "env":
        return {}
    if spec == "default":
        return dict(triton_opt_in=frozenset())
    if spec == "all":
        return dict(triton_opt_in="all")
    if spec.startswith("all-"):
        return dict(triton_opt_in="all", no_triton=spec.removeprefix("all-").split("-"))
    raise SystemExit(f"--switches: unknown run {spec!r} (default, all, all-KERNEL_MODULE or env)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers (same widths)")
    ap.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    ap.add_argument("--switches", default="default,all",
                    help="comma-separated runs: default, all, all-MODULE[-MODULE...] (all but those), env (as set)")
    ap.add_argument("--device", default="cpu", help="where the step runs: cpu (kernels interpreted) or cuda")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                    help="the model's dtype: bf16 as the H200 decodes (its hidden casts counted), fp32 by default")
    ap.add_argument("--ops", type=int, default=8, help="ops shown per kind")
    ap.add_argument("--inside", action="store_true",
                    help="also list the tensor ops k3's custom ops run around their kernels (each a GPU kernel)")
    args = ap.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if triton_dispatch.triton_module("_norm_triton") is None or not (interpreted or torch.cuda.is_available()):
        print("note: k3's Triton kernels cannot run here (no triton, or no TRITON_INTERPRET=1 on a CPU): the "
              "references are counted", file=sys.stderr)
    t0 = time.time()
    cfg, model = model_for(args.preset, args.layers, args.device, DTYPES[args.dtype])
    print(f"{args.preset} ({args.dtype}): {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_token}, vocab {cfg.vocab_size}; built in {time.time() - t0:.0f} s",
          file=sys.stderr)
    results = {}
    for switches in args.switches.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            t0 = time.time()
            with envs.override(**switch_values(switches)):
                results[switches, batch] = census_of_step(model, batch, inside=args.inside)
            print(f"{switches}, batch {batch}: {sum(results[switches, batch].counts.values())} kernels "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr)
    print_tables(cfg, results, args.ops)
    print_inside(results)


if __name__ == "__main__":
    main()
