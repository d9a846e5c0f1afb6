"""k3.ops._conv_varlen_triton (serving's q/k/v short convs over a step's packed sequences, one kernel) against the
torch path it replaces (k3.model.kda.short_conv_varlen, then SiLU and the split into [3, N, C]), and against a
per-sequence loop of the dense reference: random lengths (decode rows of one token and chunks shorter than the
conv's width among them), strided inputs as the fused projections and the pool hand them over, fp32 and bf16.
On a CPU the kernel runs under Triton's interpreter; skipped where triton is not installed."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import

pytest.importorskip("triton")

from k3.model.kda import short_conv_varlen, short_conv_varlen_index  # noqa: E402
from k3.ops.conv import short_conv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed: int, dtype: torch.dtype, W: int = 4, C: int = 24):
    g = torch.Generator().manual_seed(seed)
    S = int(torch.randint(1, 6, (1,), generator=g))
    lens = [int(torch.randint(1, 9, (1,), generator=g)) if torch.rand(1, generator=g) < 0.7 else 1 for _ in range(S)]
    N = sum(lens)
    # x: the three parts as adjacent columns of a wider GEMM output (a strided view), as the fused projections give
    wide = torch.randn(N, 3 * C + 5, generator=g).to(dtype)
    x = wide[:, 2:2 + 3 * C]
    # tails: rows of the pool gathered by slot, a view with the channels contiguous
    pool = torch.randn(S + 2, W - 1, 3 * C, generator=g)
    tails = pool[torch.randperm(S + 2, generator=g)[:S]]
    weight = torch.randn(3 * C, 1, W, generator=g) * 0.5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), torch.tensor(lens))
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(x), to(weight), to(tails), to(cu), to(seg), lens, C


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_path_and_the_dense_reference(seed, dtype):
    from k3.ops._conv_varlen_triton import short_convs_varlen

    x, weight, tails, cu, seg, lens, C = _case(seed, dtype)
    N, W = x.shape[0], weight.shape[-1]
    y, new = short_convs_varlen(x, weight, tails, cu, seg)
    assert y.shape == (3, N, C) and y.dtype == dtype and new.shape == tails.shape and new.dtype == torch.float32

    index = short_conv_varlen_index(cu, N, W)
    want_y, want_tail = short_conv_varlen(x, weight, tails, index)
    want_y = F.silu(want_y.float()).to(dtype).view(N, 3, C).transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.float() - want_y.float()).abs().max() <= tol * (1 + want_y.float().abs().max())
    assert torch.allclose(new, want_tail, atol=1e-6)

    # each sequence alone through the dense reference (fp32), continuing from its tail
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref, ref_tail = short_conv_reference(x[a:b].float()[None], weight, tails[s][None].float(), silu=True)
        got = y[:, a:b].permute(1, 0, 2).reshape(b - a, 3 * C).float()
        assert (got - ref[0]).abs().max() <= tol * (1 + ref.abs().max()), s
        assert torch.allclose(new[s], ref_tail[0], atol=1e-5), s


def test_the_serving_layout_takes_the_kernel_and_keeps_its_outputs(monkeypatch):
    """VarlenLayout.short_convs with the kernel chosen gives the torch path's convs and tails (one engine step's
    layout: decode rows and prompt chunks in one row)."""
    import k3.model.kda as kda
    from k3 import K3Config, K3ForCausalLM
    from k3.serve import EngineConfig, LLMEngine, SamplingParams

    torch.manual_seed(0)
    with torch.device(DEVICE):  # where the kernel runs (the CPU: under the interpreter)
        model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    seen, outs = [], {}
    real = kda.VarlenLayout.short_convs

    def record(self, m, xs):
        convs, tails = real(self, m, xs)
        outs.setdefault(m.layer_idx, []).append((convs, tails))
        return convs, tails
    monkeypatch.setattr(kda.VarlenLayout, "short_convs", record)

    def run(kernel: bool):
        outs.clear()
        monkeypatch.setattr(kda, "use_triton", lambda t, name: kernel and name == "_conv_varlen_triton"
                            and not seen.append(name))
        eng = LLMEngine(model, None, EngineConfig(memory_bytes=16 << 20, block_size=16, match_unit=4,
                                                  max_batch_tokens=24, max_num_seqs=4, decode_graphs=False,
                                                  prefill_graphs=False))
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        with torch.inference_mode():
            for p in ([5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]):
                eng.add_request(p, params)
            tokens = []
            while eng.has_unfinished():
                tokens += [o.new_token_ids for o in eng.step()]  # (request ids differ between engines)
        return tokens, {k: v for k, v in outs.items()}

    want_tokens, want = run(False)
    got_tokens, got = run(True)
    assert seen and got_tokens == want_tokens
    for layer in want:
        for (wc, wt), (gc, gt) in zip(want[layer], got[layer]):
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(wc, gc))
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(wt, gt))


@pytest.mark.parametrize("kernel", ["conv_varlen_fwd_kernel", "conv_varlen_tails_kernel"])
def test_kernels_compile_for_sm90_without_spills(kernel):
    """Both kernels at `small`'s serving launch (bf16 x, fp32 weights and tails, W 4) compile for the H200 (no
    GPU: tests/sm90_compile.py), their integers specialised as that launch has them (the widths and the pool's
    strides multiples of 16, x's row stride in the fused projection, 6,284, not): no spills in ptxas's
    allocation. (Without the integers' specialisation, as session 26 compiled it, the forward spilled 88 B.)"""
    from sm90_compile import ptx_for_sm90, registers_for_sm90

    from k3.ops import _conv_varlen_triton as kv
    if kernel == "conv_varlen_fwd_kernel":
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "tail_ptr": "*fp32", "seg_ptr": "*i32", "cu_ptr": "*i64",
               "y_ptr": "*bf16", "N": "i32", "C3": "i32", "C": "i32", "stride_x": "i32", "stride_ts": "i32",
               "stride_tw": "i32"}
        consts = dict(W=4, BLOCK_T=kv.BLOCK_T, BLOCK_C=kv.BLOCK_C, divisible=("C3", "C", "stride_ts", "stride_tw"))
    else:
        sig = {"x_ptr": "*bf16", "tail_ptr": "*fp32", "cu_ptr": "*i64", "new_ptr": "*fp32", "C3": "i32",
               "stride_x": "i32", "stride_ts": "i32", "stride_tw": "i32"}
        consts = dict(W=4, BLOCK_W=4, BLOCK_C=kv.BLOCK_C, divisible=("C3", "stride_ts", "stride_tw"))
    ptx = ptx_for_sm90("k3.ops._conv_varlen_triton", kernel, sig, num_warps=kv.NUM_WARPS, **consts)
    assert "ld.global" in ptx and "st.global" in ptx
    assert registers_for_sm90("k3.ops._conv_varlen_triton", kernel, sig, num_warps=kv.NUM_WARPS,
                              **consts)["STACK"] == 0  # no spills


@pytest.mark.parametrize("lens", [[3, 0, 5, 0, 0], [0, 7], [1, 0, 1, 0]])
def test_empty_sequences_keep_their_tails(lens):
    """Empty documents, as the static KDA layout of the prefill graphs pads a step with (k3.serve.runner.
    StaticKDAView): the other sequences' outputs as without them, and each empty one's new tail its old tail."""
    from k3.ops._conv_varlen_triton import short_convs_varlen

    g = torch.Generator().manual_seed(sum(lens) + len(lens))
    W, C, S, N = 4, 16, len(lens), sum(lens)
    x = torch.randn(N, 3 * C, generator=g).to(DEVICE)
    tails = torch.randn(S, W - 1, 3 * C, generator=g).to(DEVICE)
    weight = (torch.randn(3 * C, 1, W, generator=g) * 0.5).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long, device=DEVICE)
    seg = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), torch.tensor(lens)).to(DEVICE)
    y, new = short_convs_varlen(x, weight, tails, cu, seg)
    want_y, want_tail = short_conv_varlen(x, weight, tails, short_conv_varlen_index(cu, N, W))
    want_y = F.silu(want_y.float()).view(N, 3, C).transpose(0, 1)
    assert torch.allclose(y, want_y, atol=1e-5) and torch.allclose(new, want_tail, atol=1e-6)
    real = [s for s, n in enumerate(lens) if n]
    empty = [s for s, n in enumerate(lens) if not n]
    assert torch.equal(new[empty], tails[empty])
    x_real = torch.cat([x[a:b] for a, b, n in zip(cu[:-1].tolist(), cu[1:].tolist(), lens) if n])
    cu_real = torch.tensor([0, *torch.tensor([lens[s] for s in real]).cumsum(0).tolist()], device=DEVICE)
    seg_real = torch.repeat_interleave(torch.arange(len(real), dtype=torch.int32),
                                       torch.tensor([lens[s] for s in real])).to(DEVICE)
    y_real, new_real = short_convs_varlen(x_real, weight, tails[real].contiguous(), cu_real, seg_real)
    assert torch.allclose(y, y_real, atol=1e-6) and torch.allclose(new[real], new_real, atol=1e-6)
