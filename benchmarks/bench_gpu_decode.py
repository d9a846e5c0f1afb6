"""Decode of the `small` preset on one GPU through the model's own cache path (K3Cache), bf16.

Batch 1, 8, 64 at context 4K and 32K. The cache is built by a real 16-token prefill and then its MLA
latents are replaced by random ones of the full context length (decode speed does not depend on their
values; a real 32K x 64 prefill would only cost device time). KDA states are the prefill's.
Memory roofline per step = bytes that must be read: every dense weight once (embedding row only), the
routed experts the batch touches (expected distinct experts E·(1-(1-k/E)^B) per MoE layer), lm_head,
each KDA state read and written (fp32), each MLA layer's cached latent+k_extra read once. Fraction =
(bytes / measured copy bandwidth) / measured step time. Target (issue 6): batch-1 >= 60%.
Run: PYTHONPATH=src python benchmarks/bench_gpu_decode.py [--quick]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import COPY_BW, save, table, time_ms  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.cache import MLAState  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402


def weight_bytes(model, cfg, batch) -> float:
    E, k = cfg.num_experts, cfg.num_experts_per_token
    touched = E * (1 - (1 - k / E) ** batch) / E
    total = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        elif ".experts.w" in name:
            total += p.numel() * p.element_size() * touched
        else:
            total += p.numel() * p.element_size()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    cfg = K3Config.preset("small" if not a.quick else "tiny")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    R, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    la = cfg.linear_attn_config
    n_kda, n_mla = cfg.num_hidden_layers - len(cfg.mla_layer_ids), len(cfg.mla_layer_ids)
    rows = []
    for ctx in ([4096, 32768] if not a.quick else [512]):
        for B in ([1, 8, 64] if not a.quick else [1, 4]):
            with torch.no_grad():
                cache = model.new_cache()
                model(torch.randint(0, cfg.vocab_size, (B, 16), device="cuda"), cache=cache)
                for i, st in enumerate(cache.layers):
                    if isinstance(st, MLAState):
                        cache.layers[i] = MLAState(torch.randn(B, ctx - 1, R, device="cuda", dtype=torch.bfloat16),
                                                   torch.randn(B, ctx - 1, rope, device="cuda", dtype=torch.bfloat16))
                cache.seq_len = ctx - 1
                tok = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
                snapshot = list(cache.layers)
                mla = [(i, st.latent, st.k_extra) for i, st in enumerate(snapshot) if isinstance(st, MLAState)]

                def step():
                    # decode one token at context `ctx`; restore the cache so every rep sees the same length
                    model(tok, cache=cache)
                    cache.layers[:] = snapshot
                    for i, lat, kx in mla:
                        cache.layers[i].latent, cache.layers[i].k_extra = lat, kx
                ms = time_ms(step, warmup=3, reps=10)
            state_bytes = n_kda * B * la.num_heads * la.head_dim ** 2 * 4 * 2
            kv_bytes = n_mla * B * ctx * (R + rope) * 2
            nbytes = weight_bytes(model, cfg, B) + state_bytes + kv_bytes
            floor_ms = nbytes / COPY_BW * 1e3
            rows.append(dict(batch=B, context=ctx, step_ms=ms, tokens_per_s=B / ms * 1e3, bytes_MB=nbytes / 1e6,
                             floor_ms=floor_ms, roofline_frac=floor_ms / ms))
            print(rows[-1], flush=True)
            cache = snapshot = mla = None
    print(table(rows, ["batch", "context", "step_ms", "tokens_per_s", "bytes_MB", "floor_ms", "roofline_frac"]))
    save("decode" + ("_quick" if a.quick else ""), {"rows": rows})


if __name__ == "__main__":
    main()
