"""Stable LatentMoE (SPEC §3.4): sigmoid router, bias-only selection, experts in a latent space, shared MLP."""
import torch
from torch import nn

from k3.config import K3Config
from k3.model.mlp import SiTUMLP
from k3.model.norm import RMSNorm
from k3.ops.fused_linear import FusedLinears
from k3.ops.fused_situ import situ_glu_fast
from k3.ops.gemv import DecodeLinear, linear_pair, use_gemv_pair
from k3.ops.grouped_mm import expert_situ_mlp
from k3.ops.moe_decode import (selected_experts_situ_mlp, selected_experts_tail, use_expert_major,
                               use_selected_experts)
from k3.ops.router import KERNEL_MAX_ROWS, route, route_tokens, router_scores  # noqa: F401  (route: imported here)
from k3.ops.mx_experts import (packed_expert_situ_mlp, packed_selected_experts_situ_mlp,
                               packed_selected_experts_take, qat_expert_situ_mlp)
from k3.ops.slot_sum import combine_rows
from k3.ops.token_permute import dispatch_rows, inverse_permutation


def _shared_experts(shared: SiTUMLP, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`down(SiTU-GLU(gate, up))` of the shared experts from their fused projections' outputs: the GLU in the down
    projection's GEMV prologue where decode takes it (k3.ops.gemv); a replaced down projection (tensor
    parallelism's row-parallel linear) gets the GLU's output."""
    if isinstance(shared.down_proj, DecodeLinear):
        return shared.down_proj(gate, glu_up=up, glu_betas=shared.betas)
    return shared.down_proj(situ_glu_fast(gate, up, *shared.betas))


class Router(nn.Module):
    """`weight` [E, D] and the selection-only bias `e_score_correction_bias` [E] (fp32 buffer, set by balancing)."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        # the decode kernel's workspaces (k3.ops._router_triton), every one ever handed out: a captured CUDA graph
        # keeps writing the one it was captured with, so none may be freed and its memory reused
        self._tickets: list[torch.Tensor] = []

    def tickets(self, rows: int, device: torch.device) -> torch.Tensor:
        """An int32 zero workspace of at least `rows` entries on `device` for the router kernel, which leaves it
        zero; one per router, so layers never share one."""
        for t in reversed(self._tickets):
            if t.device == device and t.numel() >= rows:
                return t
        self._tickets.append(torch.zeros(max(rows, KERNEL_MAX_ROWS), dtype=torch.int32, device=device))
        return self._tickets[-1]


class Experts(nn.Module):
    """Stacked routed experts in checkpoint `[out, in]` layout: w1 (gate), w3 (up): [E, I, L]; w2 (down): [E, L, I]."""

    def __init__(self, num_experts: int, latent: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, intermediate))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, latent))
        # True after k3.ops.mx_experts.pack_experts_: uint8 buffers w*_packed, w*_scale replace w1..w3 (MXFP4).
        self.packed = False


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.renormalize, self.scale = config.moe_renormalize, config.routed_scaling_factor
        self.betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        self.gate = Router(config.num_experts, D)
        self.experts = Experts(config.num_experts, L, config.moe_intermediate_size)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.routed_expert_norm = RMSNorm(L, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.routed_expert_up_proj = DecodeLinear(L, D, bias=False)
        self.shared_experts = (SiTUMLP(config, D, config.shared_intermediate_size, join_inputs=False)
                               if config.num_shared_experts > 0 else None)
        # Router scores of the last training forward, for the load balancer (k3.balance); never used at inference.
        self.last_scores: torch.Tensor | None = None
        self.last_mask: torch.Tensor | None = None
        # MXFP4 weights / MXFP8 activations fake-quantized in the expert GEMMs (k3.ops.mx_experts.enable_qat).
        self.qat = False
        # the projections that read x besides the fp32 router, one GEMM at inference (names unchanged)
        shared = self.shared_experts
        self.in_proj = FusedLinears(self.routed_expert_down_proj,
                                    *((shared.gate_proj, shared.up_proj) if shared is not None else ()))

    def router_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Sigmoid router in fp32 (fp64 stays fp64). x: [N, D] → [N, E]."""
        return router_scores(x, self.gate.weight)

    def route(self, x: torch.Tensor):
        """(expert ids [N, k], their weights [N, k], scores [N, E]) of x [N, D] (k3.ops.router.route_tokens)."""
        g = self.gate
        return route_tokens(x, g.weight, g.e_score_correction_bias, self.top_k, self.renormalize, self.scale,
                            tickets=g.tickets)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, routing: tuple | None = None) -> torch.Tensor:
        """x: [B, T, D]; mask: [B, T] bool, False for padding (excluded from balancing statistics); routing: x's
        (idx, weights, scores) as `route` gives them, where the caller has them already (decode's AttnRes mix,
        k3.model.attn_res.attn_res_mix_norm_route)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w, scores = self.route(x) if routing is None else routing
        if self.training:
            self.last_scores = scores.detach()
            self.last_mask = None if mask is None else mask.reshape(-1)
        z, *shared_in = self.in_proj(x)
        shared = self.shared_experts
        # (expert parallelism replaces the seam on the instance; a bound method's __func__ is not what
        # torch.compile traces it to be)
        own_seam = "combine_experts" not in self.__dict__
        # the router's fp32 weights as they are to the layer's own seam (its decode kernels read fp32; its grouped
        # product casts them), in z's dtype to a replaced one
        w = w if own_seam else w.to(z.dtype)
        if shared is None:
            r, s = self.combine_experts(z, idx, w), None
        elif not own_seam:
            # a replaced seam (expert parallelism): SiTUMLP's forward from the fused gate and up projections, run
            # while the experts' rows travel
            r, s = self.combine_experts(z, idx, w, meanwhile=lambda: _shared_experts(shared, *shared_in))
        else:  # one device: nothing to overlap, and decode's GEMV may take the shared down and routed up at once
            tail = self._experts_with_tail(z, idx, w, *shared_in)
            if tail is not None:  # the routed norm and the shared GLU came with the experts' last launch
                r, h = tail
                s = shared.down_proj(h)
                return self.routed_expert_up_proj(r, residual=s, into_residual=True).view(shape)
            r = self.combine_experts(z, idx, w)
            y = self._shared_down_and_routed_up(r, *shared_in)
            if y is not None:
                return y.view(shape)
            s = _shared_experts(shared, *shared_in)
        # the routed norm before and + the shared experts' output after: in the GEMV kernel's prologue and epilogue
        # where decode takes it (k3.ops.gemv), else the sum in the GEMM (s is this call's own scratch)
        return self.routed_expert_up_proj(r, residual=s, norm=self.routed_expert_norm, into_residual=True).view(shape)

    def _experts_with_tail(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate: torch.Tensor,
                           up: torch.Tensor):
        """(routed_norm(r), SiTU-GLU(gate, up)) from the expert-major kernels, the norm and the GLU in their last
        launch (k3.ops.moe_decode.selected_experts_tail), where they take this call and decode's GEMV does not take
        the shared down and routed up as a pair (which reads r and the GLU's inputs itself); else None."""
        e, shared, norm = self.experts, self.shared_experts, self.routed_expert_norm
        norm_weight, norm_eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        if e.packed or self.qat or (torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (z, gate, up, e.w1, e.w2, e.w3, norm_weight))):
            return None
        if isinstance(shared.down_proj, DecodeLinear) and use_gemv_pair(
                gate, shared.down_proj.weight, z, self.routed_expert_up_proj.weight, up, norm_weight):
            return None  # (z stands in for r: the same rows, width and dtype)
        return selected_experts_tail(z, idx, w, e.w1, e.w3, e.w2, self.betas, norm_weight, norm_eps, gate, up,
                                     shared.betas)

    def _shared_down_and_routed_up(self, r: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
        """`down(SiTU-GLU(gate, up)) + routed_up(norm(r))` as one two-segment GEMV (k3.ops.gemv.linear_pair: one
        launch for two, or for four where K is split) where decode's GEMV takes both linears; else None (the
        caller runs them apart)."""
        shared, routed_up, norm = self.shared_experts, self.routed_expert_up_proj, self.routed_expert_norm
        if not (isinstance(shared.down_proj, DecodeLinear) and isinstance(routed_up, DecodeLinear)
                and shared.down_proj.bias is None and routed_up.bias is None):
            return None
        norm_weight, norm_eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        if not use_gemv_pair(gate, shared.down_proj.weight, r, routed_up.weight, up, norm_weight):
            return None
        return linear_pair(gate, shared.down_proj.weight, r, routed_up.weight, up, shared.betas, norm_weight,
                           norm_eps)

    def combine_experts(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, meanwhile=None):
        """`r = Σ_e w_e · W2_e SiTU(W1_e z, W3_e z)` over each token's selected experts. z: [N, L]; w: [N, k] in
        any float dtype (the decode kernels read it as it is, the grouped product in z's dtype).
        (The seam expert parallelism replaces: k3.parallel.expert_parallel, k3.serve.expert_shard.)
        meanwhile: work to overlap with the experts' communication where there is any (the shared experts);
        with it, (r, meanwhile()) is returned."""
        if meanwhile is not None:  # one device: nothing travels, so nothing to overlap
            return LatentMoE.combine_experts(self, z, idx, w), meanwhile()
        N, k = idx.shape
        e = self.experts
        needs_grad = torch.is_grad_enabled() and (z.requires_grad or (not e.packed and e.w1.requires_grad))
        if use_selected_experts(N, k, self.num_experts, needs_grad):
            # decode: each token reads its k experts in place, no sort, scatter or grouped offsets
            if not (e.packed or self.qat):
                return selected_experts_situ_mlp(z, idx, w, e.w1, e.w3, e.w2, *self.betas)
            if e.packed and packed_selected_experts_take(z, self.qat):
                return packed_selected_experts_situ_mlp(z, idx, w, e, *self.betas)
        elif not (e.packed or self.qat) and use_expert_major(z, k, self.num_experts, e.w1.dtype, needs_grad):
            # decode batches: each expert reads the rows routed to it, its weights once, no sort or scatter
            return selected_experts_situ_mlp(z, idx, w, e.w1, e.w3, e.w2, *self.betas)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # the N·k (token, choice) slots sorted by expert
        slot = inverse_permutation(order)
        # not bincount: on CUDA it reads the max back to the host, which stalls (and breaks graph capture)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        x = dispatch_rows(z, order, slot, k)
        if e.packed:
            y = packed_expert_situ_mlp(x, counts, e, *self.betas, quantize_activations=self.qat)
        elif self.qat:
            y = qat_expert_situ_mlp(x, counts, e.w1, e.w3, e.w2, *self.betas)
        else:
            y = expert_situ_mlp(x, counts, e.w1, e.w3, e.w2, *self.betas)
        # the weighted sum over each token's k rows, read in expert order (k3.ops.slot_sum: one kernel each way where
        # it runs, else a gather back to slot order and a batched [1, k] @ [k, L] product)
        return combine_rows(y, w, slot, order)
