"""Activation memory of one training forward, per component: the bytes autograd keeps for backward.

Every tensor saved for backward passes through `torch.autograd.graph.saved_tensors_hooks`; each storage is
counted once (views and re-saves share it), parameters are left out, and the bytes go to the component whose
forward saved the storage first. With activation checkpointing the inputs a checkpointed layer keeps for its
recomputation are counted as well (they are held by the checkpoint, not by a saved-tensor hook).

The CUDA training step takes paths a CPU lacks; by default the GPU kernels are stood in for, saving what they
save: fla's chunk_kda (l2-normed q/k with their rstd, v, the gate input, beta logits and sigmoid, Aqk and Akk in
the input dtype, no per-chunk state), the fused Triton SiTU-GLU of the routed experts, shared experts and dense
MLP (gate and up only) and MLA's CUDA SDPA call (v zero-padded to the qk head dim). The forward itself is
computed by the references.

Per-token bytes do not depend on the batch or sequence length (no [T, T] tensor is saved), nor on the number
of experts except the [tokens, experts] router scores, so the default is the `small` preset with 16 instead of
64 experts at 1 x 256 tokens in bf16 (the dtype of benchmarks/bench_gpu_train.py), ~15 s on one CPU core.

Run: python benchmarks/activation_memory.py [--checkpointing] [--tokens 256] [--experts 16] [--cpu-paths]
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import k3.model.attn_res as attn_res_mod
import k3.model.decoder as decoder_mod
import k3.model.kda as kda_mod
import k3.model.mla as mla_mod
import k3.model.mlp as mlp_mod
import k3.model.moe as moe_mod
import k3.ops.cross_entropy as ce_mod
import k3.ops.grouped_mm as grouped_mm_mod
import k3.ops.kda_core as kda_core_mod
from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM
from k3.model.mla import MultiHeadLatentAttention
from k3.model.moe import LatentMoE
from k3.ops.kda import kda_chunk, kda_gate
from k3.ops.norm import l2_norm, rms_norm
from k3.ops.situ import situ_glu

COMPONENTS = ("AttnRes mixes", "KDA (projections, convs, gates, o_norm)", "KDA delta-rule core", "MLA",
              "MoE routed (router, latent, experts)", "MoE shared experts", "dense MLP (layer 0)",
              "layer norms (input, post-attn, final)", "lm_head + loss", "embedding + residual adds",
              "checkpointed layer inputs")


class SavedTensorMeter:
    """Totals the unique storages saved for backward, per component label."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []

    def add(self, t: torch.Tensor, label: str | None = None) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.excluded or ptr in self.seen:
            return
        self.seen.add(ptr)
        self.bytes[label or (self.stack[-1] if self.stack else "other")] += storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @contextlib.contextmanager
    def label(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()


def _labelled(meter: SavedTensorMeter, name: str, fn):
    def wrapped(*args, **kwargs):
        with meter.label(name):
            return fn(*args, **kwargs)
    return wrapped


def component_modules(model: K3ForCausalLM):
    """(module, label) for every component whose forward is a module call; inner labels win."""
    yield model, "lm_head + loss"
    yield model.model, "embedding + residual adds"
    yield model.lm_head, "lm_head + loss"
    yield model.model.embed_tokens, "embedding + residual adds"
    yield model.model.norm, "layer norms (input, post-attn, final)"
    for layer in model.model.layers:
        yield layer.input_layernorm, "layer norms (input, post-attn, final)"
        yield layer.post_attention_layernorm, "layer norms (input, post-attn, final)"
        attn = layer.self_attn
        yield attn, "MLA" if isinstance(attn, MultiHeadLatentAttention) else "KDA (projections, convs, gates, o_norm)"
        if isinstance(getattr(layer, "block_sparse_moe", None), LatentMoE):
            yield layer.block_sparse_moe, "MoE routed (router, latent, experts)"
            if layer.block_sparse_moe.shared_experts is not None:
                yield layer.block_sparse_moe.shared_experts, "MoE shared experts"
        else:
            yield layer.mlp, "dense MLP (layer 0)"


# ---- stand-ins for the CUDA kernels: the reference forward, the kernels' saved tensors ----------------------
class _FlaKDASaves(torch.autograd.Function):
    """fla chunk_kda(use_gate_in_kernel, use_qk_l2norm_in_kernel unless qk_normalized, use_beta_sigmoid_in_kernel),
    recompute mode."""

    @staticmethod
    def forward(ctx, q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens, qk_normalized):
        B, T, H, K = q.shape
        # the norms' outputs and rstds; none where q and k come normalised (the conv kernels took the norms)
        qn, kn = (q, k) if qk_normalized else (l2_norm(q), l2_norm(k))
        beta = torch.sigmoid(beta_logits.float())
        g = kda_gate(f, A_log, dt_bias, lower_bound)
        o, _ = kda_chunk(qn, kn, v, g, beta, cu_seqlens=cu_seqlens)
        rstd = None if qk_normalized else q.new_empty(B, T, H, dtype=torch.float32)
        A = q.new_empty(B, T, H, 64)
        ctx.save_for_backward(qn, rstd, kn, None if rstd is None else rstd.clone(), v, f, beta_logits,
                              beta.to(q.dtype), A_log[:H].float(), dt_bias.float(), A, A.clone())
        return o.to(v.dtype)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("a stand-in for measuring saved bytes only")


def _fla_kda_gated_saves(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound=-5.0, scale=None,
                         initial_state=None, output_final_state=False, cu_seqlens=None, recurrent=None,
                         state_in_place=False, cu_seqlens_cpu=None, plan=None, qk_normalized=False):
    return _FlaKDASaves.apply(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens, qk_normalized), None


class _FlaOutputGateSaves(torch.autograd.Function):
    """fla's fused gated RMSNorm (`kda_fla.fla_output_gate`): keeps o, g and the per-row rstd."""

    @staticmethod
    def forward(ctx, o, g, weight, eps):
        ctx.save_for_backward(o, g, o.new_empty(o.shape[:-1], dtype=torch.float32))
        return (rms_norm(o, weight, eps) * torch.sigmoid(g.to(o.dtype))).to(o.dtype)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("a stand-in for measuring saved bytes only")


class _FusedSiTUSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta_gate, beta_up):
        ctx.save_for_backward(gate, up)
        return situ_glu(gate, up, beta_gate, beta_up)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("a stand-in for measuring saved bytes only")


mla_causal_attention = mla_mod.causal_attention


def _cuda_mla_attention(q, k, v, scale, doc_ids=None):
    """k3.ops.attention.causal_attention's CUDA branch: v zero-padded to q's head dim for FlashAttention."""
    o = mla_causal_attention(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), scale, doc_ids)
    return o[..., :v.shape[-1]]


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def gpu_path_stand_ins():
    """The CUDA step's KDA (fla), SiTU-GLU (Triton), MLA attention and loss, as far as saved bytes go."""
    with contextlib.ExitStack() as stack:
        # the KDA core's backend is picked in k3.ops.kda_core; the output gate follows that choice
        stack.enter_context(patched(kda_core_mod, "fla_usable", lambda x, head_dim=None: True))
        stack.enter_context(patched(kda_core_mod, "fla_kda_gated", _fla_kda_gated_saves))
        stack.enter_context(patched(kda_mod, "fla_output_gate", _FlaOutputGateSaves.apply))
        fused_situ = lambda g, u, b1=4.0, b2=25.0: _FusedSiTUSaves.apply(g, u, b1, b2)
        for mod in (grouped_mm_mod, mlp_mod, moe_mod):  # moe: the shared experts' SiTU
            stack.enter_context(patched(mod, "situ_glu_fast", fused_situ))
        stack.enter_context(patched(mla_mod, "causal_attention", _cuda_mla_attention))
        stack.enter_context(patched(decoder_mod, "cross_entropy", ce_mod.chunked_cross_entropy))
        yield


def measure(model: K3ForCausalLM, input_ids: torch.Tensor, gpu_paths: bool = True) -> dict[str, int]:
    """Bytes saved for backward by one training forward + loss, per component (COMPONENTS order)."""
    exclude = list(model.parameters()) + list(model.buffers())
    meter = SavedTensorMeter(exclude)
    def leave(module, args, output):
        meter.stack.pop()

    handles = []
    for module, name in component_modules(model):
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: meter.stack.append(name)))
        handles.append(module.register_forward_hook(leave))

    def keep_checkpoint_inputs(fn, *args, **kwargs):
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                meter.add(t, "checkpointed layer inputs")
        return real_checkpoint(fn, *args, **kwargs)

    real_checkpoint = decoder_mod.checkpoint
    with contextlib.ExitStack() as stack:
        if gpu_paths:
            stack.enter_context(gpu_path_stand_ins())
        for mod, fn, name in ((attn_res_mod, "attn_res_mix", "AttnRes mixes"),
                              (kda_core_mod, "kda_chunk", "KDA delta-rule core"),
                              (kda_core_mod, "fla_kda_gated", "KDA delta-rule core")):
            stack.enter_context(patched(mod, fn, _labelled(meter, name, getattr(mod, fn))))
        stack.enter_context(patched(decoder_mod, "checkpoint", keep_checkpoint_inputs))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t))
        try:
            model(input_ids, labels=input_ids)
        finally:
            for h in handles:
                h.remove()
    return {c: meter.bytes.get(c, 0) for c in COMPONENTS} | {k: b for k, b in meter.bytes.items() if k not in COMPONENTS}


def build_model(preset: str = "small", experts: int | None = 16, dtype=torch.bfloat16, seed: int = 0) -> K3ForCausalLM:
    """The preset (with `experts` routed experts) in `dtype`, randomly initialised, in training mode."""
    cfg = K3Config.preset(preset)
    if experts is not None:
        cfg = cfg.replace(num_experts=experts)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.reset_parameters(seed=seed)
    return model.train()


def table(saved: dict[str, int], tokens: int, scale_tokens: int) -> str:
    total = sum(saved.values())
    rows = [f"{'component':<42} {'MiB / 1K tokens':>16} {'share':>7} {f'GiB at {scale_tokens} tok':>16}"]
    for name, b in sorted(saved.items(), key=lambda kv: -kv[1]):
        rows.append(f"{name:<42} {b / tokens * 1024 / 2**20:>16.2f} {b / max(total, 1):>7.1%} "
                    f"{b / tokens * scale_tokens / 2**30:>16.2f}")
    rows.append(f"{'total':<42} {total / tokens * 1024 / 2**20:>16.2f} {1:>7.1%} "
                f"{total / tokens * scale_tokens / 2**30:>16.2f}")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--experts", type=int, default=16, help="routed experts (0: the preset's own)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256, help="sequence length")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--cpu-paths", action="store_true", help="measure the CPU reference paths, no GPU stand-ins")
    ap.add_argument("--scale-to", type=int, default=8 * 4096, help="tokens of the GiB column (8 x 4096)")
    a = ap.parse_args()
    t0 = time.time()
    model = build_model(a.preset, a.experts or None, getattr(torch, a.dtype))
    model.model.gradient_checkpointing = a.checkpointing
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.tokens), generator=torch.Generator().manual_seed(0))
    saved = measure(model, ids, gpu_paths=not a.cpu_paths)
    print(f"{a.preset} ({a.experts or model.config.num_experts} experts), {a.dtype}, {a.batch}x{a.tokens} tokens, "
          f"{'GPU-path stand-ins' if not a.cpu_paths else 'CPU reference paths'}, "
          f"checkpointing {'on' if a.checkpointing else 'off'} ({time.time() - t0:.0f} s)")
    print(table(saved, a.batch * a.tokens, a.scale_to))


if __name__ == "__main__":
    main()
