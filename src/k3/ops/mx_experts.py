"""Routed experts through MX formats: the QAT forward (fake-quantized) and inference from packed MXFP4.

Both follow `k3.ops.grouped_mm.expert_situ_mlp`'s contract: rows of x sorted by expert, `counts[e]` rows for
expert e, `y = W2_e SiTU(W1_e x, W3_e x)` with weights in checkpoint `[out, in]` layout. Packed experts run on
CUDA through k3's Triton MXFP4 kernels (`k3.ops._mxfp4_triton`: dequantised in registers, counts never read on
the host, so decode steps are CUDA graphs), grouped or, at decode, one slot per (token, choice) with no sort;
`packed_expert_situ_mlp_reference` (dequantise, then matmul, expert by expert) is the definition they are
tested against, and what runs elsewhere.

Serving on a GPU may rearrange the packed bytes once into the kernels' decode layout (`use_decode_layout_`,
k3.ops.mxfp4_layout: fewer instructions a weight); the module then still saves and loads the released layout
(its state_dict hooks convert), and the reference reads it back through `to_released_layout`.
"""
import torch

from k3 import envs
from k3.ops.grouped_mm import grouped_linear
from k3.ops.lazy_dynamo import compile_disabled
from k3.ops.mx import BLOCK, mxfp4_fake_quant, mxfp4_pack, mxfp4_unpack, mxfp8_fake_quant
from k3.ops.mxfp4_layout import DecodeLayoutWeight, scale_bias, to_decode_layout, to_released_layout
from k3.ops.situ import situ_glu
from k3.ops.triton_dispatch import on_device, triton_module

EXPERT_WEIGHTS = ("w1", "w2", "w3")
EXPERT_ORDER = ("w1", "w3", "w2")  # gate, up, down: the kernels' argument order
_KERNELS = "_mxfp4_triton"


def qat_expert_situ_mlp(x, counts, w1, w3, w2, beta_gate=4.0, beta_up=25.0) -> torch.Tensor:
    """QAT forward: MXFP4 fake-quantized weights (blocks along `in`), MXFP8 fake-quantized inputs of every
    expert GEMM (blocks along the contracted dim); straight-through gradients. x: [S, L] → [S, L]."""
    q1, q3, q2 = (mxfp4_fake_quant(w) for w in (w1, w3, w2))
    xq = mxfp8_fake_quant(x)
    h = situ_glu(grouped_linear(xq, counts, q1), grouped_linear(xq, counts, q3), beta_gate, beta_up)
    return grouped_linear(mxfp8_fake_quant(h), counts, q2)


def packed_kernels_enabled() -> bool:
    """Whether k3's Triton MXFP4 expert kernels can run (triton importable, not switched off by K3_NO_TRITON).
    Where they can, packed experts never read their counts on the host, so decode steps can be CUDA graphs."""
    return not envs.current().triton_off(_KERNELS) and triton_module(_KERNELS) is not None


def _kernels_take(x: torch.Tensor, quantize_activations: bool) -> bool:
    # also inside torch.compile: the kernels run eagerly behind a graph break (torch.compiler.disable below),
    # where the reference would read the counts on the host and break a CUDA-graph capture
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and not quantize_activations
            and packed_kernels_enabled())


def _packed(experts, name: str) -> tuple[torch.Tensor, torch.Tensor] | DecodeLayoutWeight:
    """What the kernels read: (packed, scale) in the released layout, or a DecodeLayoutWeight."""
    packed, scale = getattr(experts, f"{name}_packed"), getattr(experts, f"{name}_scale")
    if getattr(experts, "decode_bias", None) is not None:
        return DecodeLayoutWeight(packed, scale, experts.decode_bias[name])
    return packed, scale


def _released_packed(experts, name: str, e: int) -> torch.Tensor:
    """Expert e's packed bytes of matrix `name` in the released layout, whichever layout the module holds."""
    packed = getattr(experts, f"{name}_packed")[e]
    return to_released_layout(packed) if getattr(experts, "decode_bias", None) is not None else packed


def packed_expert_situ_mlp_reference(x, counts: torch.Tensor, experts, beta_gate=4.0, beta_up=25.0,
                                     quantize_activations: bool = False) -> torch.Tensor:
    """Inference from packed MXFP4 experts: each expert that received tokens is dequantized on the fly (one
    expert's three matrices at a time, so the float copy never exceeds one expert). x: [S, L] → [S, L].
    Never dispatches; reads `counts` on the host.

    quantize_activations: MXFP8-quantize the GEMM inputs as QAT does (emulated MXFP4 x MXFP8 inference)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the packed MXFP4 experts' reference reads the expert counts on the host and cannot be "
                           "captured in a CUDA graph (k3.model.cuda_graph.graph_blocker says when it would run)")
    act = mxfp8_fake_quant if quantize_activations else (lambda t: t)
    out = x.new_empty(x.shape[0], experts.w2_packed.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            w1, w3, w2 = (mxfp4_unpack(_released_packed(experts, w, e), getattr(experts, f"{w}_scale")[e], x.dtype)
                          for w in ("w1", "w3", "w2"))
            xe = act(x[start:start + n])
            out[start:start + n] = act(situ_glu(xe @ w1.t(), xe @ w3.t(), beta_gate, beta_up)) @ w2.t()
        start += n
    return out


@compile_disabled
def _grouped_kernels(x, counts, experts, beta_gate, beta_up):
    with on_device(x):
        return triton_module(_KERNELS).grouped_situ_mlp(x, counts, *(_packed(experts, w) for w in EXPERT_ORDER),
                                                        beta_gate, beta_up)


def packed_expert_situ_mlp(x, counts: torch.Tensor, experts, beta_gate=4.0, beta_up=25.0,
                           quantize_activations: bool = False) -> torch.Tensor:
    """`packed_expert_situ_mlp_reference`, by k3's Triton MXFP4 grouped GEMMs on CUDA (weights dequantized in
    registers, counts kept on the device: capturable in a CUDA graph); emulated MXFP8 activations take the
    reference."""
    if _kernels_take(x, quantize_activations):
        return _grouped_kernels(x, counts, experts, beta_gate, beta_up)
    return packed_expert_situ_mlp_reference(x, counts, experts, beta_gate, beta_up, quantize_activations)


def packed_selected_experts_take(z: torch.Tensor, quantize_activations: bool) -> bool:
    """Whether `packed_selected_experts_situ_mlp` can run for z (CUDA, Triton MXFP4 kernels, no MXFP8 emulation)."""
    return _kernels_take(z, quantize_activations)


@compile_disabled
def packed_selected_experts_situ_mlp(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts,
                                     beta_gate=4.0, beta_up=25.0) -> torch.Tensor:
    """Decode from packed MXFP4 experts: r[n] = Σ_j weights[n, j] · W2_e SiTU(W1_e z[n], W3_e z[n]),
    e = idx[n, j], each (token, choice) reading only its expert's bytes, with no sort (the contract of
    `k3.ops.moe_decode.selected_experts_situ_mlp_reference`; e < 0: held elsewhere, no work, adds nothing).
    Needs `packed_selected_experts_take(z, ...)`."""
    N, k = idx.shape
    with on_device(z):
        y = triton_module(_KERNELS).selected_situ_mlp(z, idx, *(_packed(experts, w) for w in EXPERT_ORDER),
                                                      beta_gate, beta_up)
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(N, k, -1)).squeeze(1)


def pack_experts_(experts: torch.nn.Module, empty: bool = False) -> torch.nn.Module:
    """Replaces the float parameters w1, w2, w3 [E, out, in] of an `Experts` module by uint8 buffers
    `w*_packed` [E, out, in/2] and `w*_scale` [E, out, in/32] (in place; inference only).

    empty: allocate the buffers without packing (for loading a checkpoint into a meta-built model)."""
    if getattr(experts, "packed", False):
        return experts
    for name in EXPERT_WEIGHTS:
        w = getattr(experts, name)
        if w.shape[-1] % BLOCK:
            raise ValueError(f"experts.{name}: input dimension {w.shape[-1]} is not a multiple of {BLOCK}, "
                             f"so it cannot be stored as MXFP4")
        if empty or w.is_meta:
            packed = torch.empty(*w.shape[:-1], w.shape[-1] // 2, dtype=torch.uint8, device=w.device)
            scale = torch.empty(*w.shape[:-1], w.shape[-1] // BLOCK, dtype=torch.uint8, device=w.device)
        else:
            packed, scale = mxfp4_pack(w.detach())
        delattr(experts, name)
        experts.register_buffer(f"{name}_packed", packed)
        experts.register_buffer(f"{name}_scale", scale)
    experts.packed = True
    return experts


_CHUNK_BYTES = 1 << 28  # experts converted at a time: the temporaries stay small on a full GPU


def _relayout_(experts, convert) -> None:
    for name in EXPERT_WEIGHTS:
        packed = getattr(experts, f"{name}_packed")
        step = max(1, _CHUNK_BYTES // max(1, packed[0].numel()))
        for a in range(0, packed.shape[0], step):
            packed[a:a + step] = convert(packed[a:a + step])


def _save_released(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of a module in the decode layout: what it saves is the released layout."""
    if getattr(module, "decode_bias", None) is not None:
        for name in EXPERT_WEIGHTS:
            key = f"{prefix}{name}_packed"
            if key in state_dict:
                state_dict[key] = to_released_layout(state_dict[key])


def _load_released(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: released bytes coming into a module in the decode layout are rearranged."""
    if getattr(module, "decode_bias", None) is not None:
        for name in EXPERT_WEIGHTS:
            key, scale = f"{prefix}{name}_packed", state_dict.get(f"{prefix}{name}_scale")
            if key in state_dict:
                state_dict[key] = to_decode_layout(state_dict[key])
            if scale is not None:
                module.decode_bias[name] = scale_bias(scale)


def wants_decode_layout(device: torch.device | str, setting: bool | None = None) -> bool:
    """Whether a served model on `device` should hold its packed experts in the decode layout. setting: None
    (default): on CUDA where k3's MXFP4 kernels run; True/False force it (True on the CPU: tests, as the
    reference reads either layout)."""
    if setting is not None:
        return bool(setting)
    return torch.device(device).type == "cuda" and packed_kernels_enabled()


def in_decode_layout(experts) -> bool:
    """Whether a packed expert module holds the decode layout (use_decode_layout_), not the released one."""
    return getattr(experts, "decode_bias", None) is not None


@torch.no_grad()
def use_decode_layout_(model: torch.nn.Module, group=None) -> int:
    """Rearranges the packed bytes of every packed expert module in model into the GPU kernels' decode layout, in
    place, a few experts at a time (k3.ops.mxfp4_layout; reads each scale stack's maximum on the host once).
    Saving and loading through state_dict/load_state_dict still use the released layout; call it after the
    weights are in place (k3's checkpoint loaders copy released bytes into the buffers directly), on every rank
    alike. Returns how many modules changed (a second call: 0).

    group: the expert-parallel process group (collective: one all-reduce). A module's `decode_bias` depends on
    the largest scale byte of each of its matrices and is baked into the kernels (a constant of captured decode
    graphs), so under expert parallelism each module takes the largest bias over the group's ranks: a replica of
    another rank's expert (its bytes moved as they are, k3.serve.expert_shard) then decodes with the same bias."""
    todo = [m for m in model.modules() if getattr(m, "packed", False) is True and hasattr(m, "w1_packed")
            and not in_decode_layout(m)]
    if not todo:
        return 0
    bias = torch.tensor([[scale_bias(getattr(m, f"{name}_scale")) for name in EXPERT_WEIGHTS] for m in todo],
                        dtype=torch.int64)
    if group is not None:
        import torch.distributed as dist

        device = todo[0].w1_scale.device  # NCCL reduces device tensors only
        reduced = bias.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        bias = reduced.cpu()
    for m, b in zip(todo, bias.tolist()):
        _relayout_(m, to_decode_layout)
        m.decode_bias = dict(zip(EXPERT_WEIGHTS, b))
        if not getattr(m, "_decode_layout_hooks", False):
            m.register_state_dict_post_hook(_save_released)
            m.register_load_state_dict_pre_hook(_load_released)
            m._decode_layout_hooks = True
    return len(todo)


@torch.no_grad()
def use_released_layout_(model: torch.nn.Module) -> int:
    """Undoes `use_decode_layout_` in place (for code that reads the packed bytes themselves)."""
    changed = 0
    for m in model.modules():
        if getattr(m, "decode_bias", None) is not None:
            _relayout_(m, to_released_layout)
            m.decode_bias = None
            changed += 1
    return changed


def enable_qat(model: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """Turns MXFP4/MXFP8 quantization-aware training of the routed experts on (or off) in every LatentMoE.

    Raises ValueError when an expert dimension is not a multiple of 32 (no MX block structure)."""
    from k3.model.moe import LatentMoE

    for name, m in model.named_modules():
        if isinstance(m, LatentMoE):
            if enabled and not m.experts.packed:  # packed experts already have 32-multiple dimensions
                for w in EXPERT_WEIGHTS:
                    shape = tuple(getattr(m.experts, w).shape)
                    if shape[-1] % BLOCK or shape[-2] % BLOCK:
                        raise ValueError(f"QAT needs expert dimensions that are multiples of {BLOCK}; "
                                         f"{name}.experts.{w} is {shape}")
            m.qat = enabled
    return model
