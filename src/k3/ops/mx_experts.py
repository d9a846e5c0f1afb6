"""Routed experts through MX formats: the QAT forward (fake-quantized) and inference from packed MXFP4.

Both follow `k3.ops.grouped_mm.expert_situ_mlp`'s contract: rows of x sorted by expert, `counts[e]` rows for
expert e, `y = W2_e SiTU(W1_e x, W3_e x)` with weights in checkpoint `[out, in]` layout.
"""
import torch

from k3.ops.grouped_mm import grouped_linear
from k3.ops.mx import BLOCK, mxfp4_fake_quant, mxfp4_pack, mxfp4_unpack, mxfp8_fake_quant
from k3.ops.situ import situ_glu

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def qat_expert_situ_mlp(x, counts, w1, w3, w2, beta_gate=4.0, beta_up=25.0) -> torch.Tensor:
    """QAT forward: MXFP4 fake-quantized weights (blocks along `in`), MXFP8 fake-quantized inputs of every
    expert GEMM (blocks along the contracted dim); straight-through gradients. x: [S, L] → [S, L]."""
    q1, q3, q2 = (mxfp4_fake_quant(w) for w in (w1, w3, w2))
    xq = mxfp8_fake_quant(x)
    h = situ_glu(grouped_linear(xq, counts, q1), grouped_linear(xq, counts, q3), beta_gate, beta_up)
    return grouped_linear(mxfp8_fake_quant(h), counts, q2)


def packed_expert_situ_mlp(x, counts: torch.Tensor, experts, beta_gate=4.0, beta_up=25.0,
                           quantize_activations: bool = False) -> torch.Tensor:
    """Inference from packed MXFP4 experts: each expert that received tokens is dequantized on the fly (one
    expert's three matrices at a time, so the float copy never exceeds one expert). x: [S, L] → [S, L].

    quantize_activations: MXFP8-quantize the GEMM inputs as QAT does (emulated MXFP4 x MXFP8 inference)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("packed MXFP4 experts read their expert counts on the host and cannot be captured in a "
                           "CUDA graph (decode graphs are off for such models: k3.model.cuda_graph.graph_blocker)")
    act = mxfp8_fake_quant if quantize_activations else (lambda t: t)
    out = x.new_empty(x.shape[0], experts.w2_packed.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            w1, w3, w2 = (mxfp4_unpack(getattr(experts, f"{w}_packed")[e], getattr(experts, f"{w}_scale")[e], x.dtype)
                          for w in ("w1", "w3", "w2"))
            xe = act(x[start:start + n])
            out[start:start + n] = act(situ_glu(xe @ w1.t(), xe @ w3.t(), beta_gate, beta_up)) @ w2.t()
        start += n
    return out


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
