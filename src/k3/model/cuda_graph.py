"""One decode step captured in a CUDA graph: the whole layer stack replays as one launch per token.

Eager decode of a hybrid model issues hundreds of small kernels per token, each paying launch latency on the
host; at batch 1 that overhead, not memory bandwidth, sets the speed. A graph needs fixed shapes and addresses
and no host syncs, which `StaticCache` provides (buffers written in place, the length on the device).
"""
from __future__ import annotations

import torch

from k3.model.cache import StaticCache
from k3.ops.fused_linear import fuse_projections
from k3.ops.mx_experts import packed_kernels_enabled


def graph_blocker(model) -> str | None:
    """Why the model's decode step cannot be captured in a CUDA graph, or None when it can: packed MXFP4
    experts are capturable through k3's Triton MXFP4 kernels only; without them (no triton, K3_NO_TRITON), or
    with QAT's emulated MXFP8 activations, they dequantize expert by expert after reading the counts on the host."""
    moes = [m for m in model.modules() if getattr(getattr(m, "experts", None), "packed", False)]
    if moes and not packed_kernels_enabled():
        return ("packed MXFP4 experts read their expert counts on the host without k3's Triton MXFP4 kernels "
                "(triton missing or switched off by K3_NO_TRITON), and no CUDA graph can hold that")
    if any(getattr(m, "qat", False) for m in moes):
        return "packed MXFP4 experts with QAT's emulated MXFP8 activations read their expert counts on the host"
    return None


def wants_graphs(model, device: torch.device, requested: bool | None) -> bool:
    """Whether to decode through CUDA graphs: as `requested`, by default on CUDA where the model allows; asking
    for them where `graph_blocker` objects raises."""
    blocker = graph_blocker(model) if device.type == "cuda" else None
    if requested and blocker is not None:
        raise ValueError(f"CUDA graphs were asked for, but {blocker}")
    return (device.type == "cuda" and blocker is None) if requested is None else requested


class GraphedDecodeStep:
    """`step(tokens [B]) -> logits [B, V]`: the model's forward of one token per row over `cache`, replayed
    from a CUDA graph captured at construction. The returned logits live in a static buffer that the next
    step overwrites."""

    def __init__(self, model, cache: StaticCache, warmup: int = 2, compile: bool = False):
        if not isinstance(cache, StaticCache):
            raise TypeError(f"a graphed decode step needs a StaticCache, got {type(cache).__name__}")
        device = cache.length.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, got device {device}")
        if (reason := graph_blocker(model)) is not None:
            raise ValueError(f"cannot capture this model's decode step: {reason}")
        self.model, self.cache, self.device = model, cache, device
        with torch.cuda.device(device):  # kernels, streams and the graph on the cache's device, not device 0
            self._capture(warmup, compile)

    def _capture(self, warmup: int, compile: bool) -> None:
        model, cache, device = self.model, self.cache, self.device
        self.tokens = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
        fuse_projections(model)  # the stacked projection weights exist before compiling and capture read them
        if compile:  # inductor fuses the elementwise chains (norms, AttnRes mixes, gates) before capture
            core = torch.compile(model.model)

            def forward(tokens):  # K3ForCausalLM.forward for one trusted token per row, without input checks
                h = core(tokens, cache=cache)
                cache.advance(1)
                return model.lm_head(h[:, -1])
        else:
            forward = lambda tokens: model(tokens, cache=cache).logits[:, -1]  # noqa: E731
        saved = cache.kda_snapshot()
        # Warm up on a side stream (kernel autotuning, cuBLAS workspaces) as capture requires; these steps
        # write the cache, so it is restored afterwards (the MLA slot they wrote is rewritten by the next step).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):  # the first also compiles, when asked
                forward(self.tokens)
                cache.restore(saved)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device)), torch.no_grad():
            self.logits = forward(self.tokens)
        cache.restore(saved)  # capture ran the host-side bookkeeping (seq_len) once without running kernels

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if cache.seq_len + 1 > cache.max_len:
            raise ValueError(f"StaticCache holds {cache.max_len} tokens and is full")
        self.tokens.copy_(tokens.reshape(cache.batch, 1))
        with torch.cuda.device(self.device):
            self.graph.replay()
        cache.seq_len += 1  # the graph advanced the device length; keep the host's copy in step
        return self.logits
