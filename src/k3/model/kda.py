"""The KDA mixer (SPEC §3.2): short convs, L2-normalised q/k, bounded decay gate, delta rule, gated output."""
import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import KDAState
from k3.model.norm import RMSNorm
from k3.ops.conv import short_conv
from k3.ops.kda import kda_chunk, kda_gate, kda_recurrent
from k3.ops.norm import l2_norm


def doc_ids_to_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows [B, T] → cu_seqlens over the flattened B·T tokens (a new segment at each row and doc start)."""
    B, T = doc_ids.shape
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = start.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int64)


class ShortConv(nn.Module):
    """Depthwise causal conv weight [C, 1, W], kept in fp32 like the released checkpoint."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=torch.float32))

    def forward(self, x, tail=None, doc_ids=None):
        return short_conv(x, self.weight, tail, doc_ids)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        la = config.linear_attn_config
        D, H, K = config.hidden_size, la.num_heads, la.head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.lower_bound = la.gate_lower_bound
        W = la.short_conv_kernel_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv1d = ShortConv(H * K, W)
        self.k_conv1d = ShortConv(H * K, W)
        self.v_conv1d = ShortConv(H * K, W)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)
        self.o_norm.weight.data = self.o_norm.weight.data.float()
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D] (already normalised). `cache` is the model's K3Cache (state read and written in place)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        st = cache.layers[self.layer_idx] if cache is not None else None
        q, tq = self.q_conv1d(self.q_proj(x), st and st.conv_q, doc_ids)
        k, tk = self.k_conv1d(self.k_proj(x), st and st.conv_k, doc_ids)
        v, tv = self.v_conv1d(self.v_proj(x), st and st.conv_v, doc_ids)
        q = l2_norm(F.silu(q).view(B, T, H, K))
        k = l2_norm(F.silu(k).view(B, T, H, K))
        v = F.silu(v).view(B, T, H, K)
        beta = torch.sigmoid(self.b_proj(x).float() if x.dtype != torch.float64 else self.b_proj(x))
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log, self.dt_bias, self.lower_bound)

        if doc_ids is not None:  # packed rows: one flat batch of documents
            cu = doc_ids_to_cu_seqlens(doc_ids)
            flat = lambda t: t.reshape(1, B * T, *t.shape[2:])
            o, _ = kda_chunk(flat(q), flat(k), flat(v), flat(g), flat(beta), cu_seqlens=cu)
            o = o.view(B, T, H, K)
        else:
            init = st.state if st is not None else None
            op = kda_recurrent if (cache is not None and T == 1) else kda_chunk
            o, state = op(q, k, v, g, beta, initial_state=init, output_final_state=cache is not None)
            if cache is not None:
                cache.layers[self.layer_idx] = KDAState(state, tq, tk, tv)

        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x).view(B, T, H, K).to(o.dtype))
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))
