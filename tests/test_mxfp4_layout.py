"""The decode layout of packed MXFP4 experts (k3.ops.mxfp4_layout): a bit-exact round trip to the released bytes,
the GPU kernel's inline PTX (`_DECODE_WORD_ASM`) run instruction by instruction on the CPU against
`mxfp4_unpack`, and the Triton expert kernels on both layouts against dequantise-then-matmul (on CUDA where
there is one, else under the Triton interpreter, which runs the plain-Triton decode beside the PTX; skipped
where triton is not installed)."""
import os
import re

import pytest
import torch

from k3.ops.mx import mxfp4_unpack
from k3.ops.mxfp4_layout import (DecodeLayoutWeight, decode_layout_weight, scale_bias, to_decode_layout,
                                 to_released_layout)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_bytes(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip_is_bit_exact():
    packed = random_bytes(3, 7, 64)
    decoded = to_decode_layout(packed)
    assert decoded.dtype == torch.uint8 and decoded.shape == packed.shape
    assert not torch.equal(decoded, packed)  # it does rearrange
    assert torch.equal(to_released_layout(decoded), packed)
    assert torch.equal(to_decode_layout(to_released_layout(packed)), packed)


def test_layout_is_a_permutation_of_each_words_bits():
    """Each of the 32 one-bit words maps to a one-bit word, all different; words never mix."""
    one_bit = torch.zeros(32, 2, 4, dtype=torch.uint8)  # row i: bit i set in word 1, word 0 empty
    for i in range(32):
        one_bit[i, 1, i // 8] = 1 << (i % 8)
    out = to_decode_layout(one_bit.reshape(32, 8))
    assert (out[:, :4] == 0).all()
    words = out[:, 4:].to(torch.int64)
    values = (words * torch.tensor([1, 1 << 8, 1 << 16, 1 << 24])).sum(1)
    assert sorted(int(v).bit_length() - 1 for v in values) == list(range(32))
    assert all(int(v) & (int(v) - 1) == 0 for v in values)


def test_layout_refuses_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        to_decode_layout(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        to_decode_layout(torch.zeros(2, 6, dtype=torch.uint8))


def test_scale_bias_keeps_every_factor_finite():
    assert scale_bias(torch.tensor([0, 100, 128], dtype=torch.uint8)) == 0
    assert scale_bias(torch.tensor([3, 200], dtype=torch.uint8)) == 72
    assert scale_bias(torch.tensor([254], dtype=torch.uint8)) == 126
    for s in (0, 128, 200, 254):  # the bf16 factor 2^(s - 1 - bias): exponent field s + 126 - bias in 1..254
        bias = scale_bias(torch.tensor([s, 0], dtype=torch.uint8))
        assert 0 < s + 126 - bias <= 254 or (s == 0 and bias == 0)


def _asm_text():
    """`_DECODE_WORD_ASM` read from the kernel module's source (the module itself needs triton)."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "src", "k3", "ops", "_mxfp4_triton.py")).read()
    return re.search(r'_DECODE_WORD_ASM = tl.constexpr\("""(.*?)"""\)', src, re.S).group(1)


def run_ptx(asm: str, word: torch.Tensor, factor: torch.Tensor) -> list[torch.Tensor]:
    """The asm's instructions on int64 tensors holding 32-bit registers: $4 = the word, $5.. = the bf16x2
    factor; returns $0..$3. Only what the routine uses: mov/and/or/shf.r.wrap and mul.rn.bf16x2."""
    regs = {"$4": word, "$5": factor, "$6": factor, "$7": factor, "$8": factor}
    mask = 0xFFFFFFFF

    def val(tok):
        return regs[tok] if tok in regs else torch.tensor(int(tok, 0), dtype=torch.int64)

    def bf16x2_mul(a, b):
        def halves(x):
            h = torch.stack(((x & 0xFFFF), (x >> 16) & 0xFFFF), -1).to(torch.int32)
            return torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16).view(torch.bfloat16)
        prod = (halves(a) * halves(b)).view(torch.int16).to(torch.int64) & 0xFFFF  # round to nearest even
        return prod[..., 0] | (prod[..., 1] << 16)

    for line in asm.strip().splitlines():
        m = re.match(r"\s*([a-z0-9.]+)\s+(.*);", line)
        if not m or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        dst, *src = args
        if op == "mov.b32":
            regs[dst] = val(src[0]) & mask
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "shf.r.wrap.b32":  # funnel shift right of src1:src0 by n; with src0 == src1 a rotation
            a, b, n = val(src[0]), val(src[1]), int(src[2]) % 32
            regs[dst] = ((a >> n) | (b << (32 - n))) & mask if n else a
        elif op == "mul.rn.bf16x2":
            regs[dst] = bf16x2_mul(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"the emulator lacks {op}")
    return [regs[f"${i}"] for i in range(4)]


def test_kernel_ptx_decodes_the_layout_exactly():
    """The GPU kernel's PTX routine, emulated on the CPU: decode-layout words (every nibble value, many times)
    and factors 2^(s - 1) → bf16 pairs equal to the released bytes' weights, bit for bit (signed zeros too);
    its outputs are columns (0, 2), (4, 6), (1, 3), (5, 7) of the word."""
    packed = random_bytes(512, 4, seed=1)
    scale = torch.randint(100, 129, (512, 1), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    scale[:8] = torch.tensor([0, 1, 60, 126, 127, 128, 110, 120], dtype=torch.uint8)[:, None]  # extremes
    want = mxfp4_unpack(packed.repeat(1, 4), scale, torch.bfloat16)[:, :8]  # (one scale covers 32 columns)
    b = to_decode_layout(packed).to(torch.int64)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    field = scale[:, 0].to(torch.int64) + 126  # 2^(s - 1) as bf16 bits, in both halves
    outs = run_ptx(_asm_text(), word, (field << 7) | (field << 23))
    got = torch.empty(512, 8, dtype=torch.bfloat16)
    for reg, cols in zip(outs, ((0, 2), (4, 6), (1, 3), (5, 7))):
        for half, col in enumerate(cols):
            got[:, col] = ((reg >> (16 * half)) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# ---- the kernels, on CUDA or under the Triton interpreter ------------------------------------------------------
@pytest.fixture(scope="module")
def kernels():
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import
    pytest.importorskip("triton")
    from k3.ops import _mxfp4_triton
    return _mxfp4_triton


class Experts(torch.nn.Module):
    """Random packed experts (every code, signed zeros) with scale bytes in [lo, hi); one E8M0 byte 0 block."""

    def __init__(self, E, L, I, lo, hi, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, (out, inp) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
            packed = torch.randint(0, 256, (E, out, inp // 2), dtype=torch.uint8, generator=g)
            scale = torch.randint(lo, hi, (E, out, inp // 32), dtype=torch.uint8, generator=g)
            scale[0, 0, 0] = 0  # 2^-127 on a block of nonzero codes
            self.register_buffer(f"{name}_packed", packed.to(DEVICE))
            self.register_buffer(f"{name}_scale", scale.to(DEVICE))

    def weights(self, decode: bool):
        pairs = [(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale")) for n in ("w1", "w3", "w2")]
        return [decode_layout_weight(*w) for w in pairs] if decode else pairs


def rel_err(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


# small tiles so that the interpreter stays quick; on CUDA tile_config's defaults are what the model runs
CONFIG = (16, 32, 64, 4, 1, False) if DEVICE == "cpu" else None


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("lo,hi", [(118, 124), (190, 200)])  # the second needs scale_bias > 0 (weights ~2^70)
def test_grouped_kernel_on_both_layouts(kernels, decode, lo, hi):
    from k3.ops.mx_experts import packed_expert_situ_mlp_reference

    experts = Experts(3, 96, 64, lo, hi, seed=3)
    w = experts.weights(decode)
    if decode:
        assert all(isinstance(x, DecodeLayoutWeight) for x in w) and (w[0].bias > 0) == (hi > 129)
    counts = torch.tensor([5, 0, 4], device=DEVICE)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 96, generator=g) * 2.0 ** (118 - lo)).to(DEVICE)  # outputs stay finite in bf16
    ref = packed_expert_situ_mlp_reference(x.double(), counts, experts, beta_gate=4.0, beta_up=25.0)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = kernels.grouped_situ_mlp(x.to(dt), counts, *w, 4.0, 25.0, config=CONFIG)
        assert out.dtype == dt and rel_err(out, ref) < tol, (dt, decode)


@pytest.mark.parametrize("decode", [False, True])
def test_selected_kernel_on_both_layouts(kernels, decode):
    """Decode: each (token, choice) slot reads its expert in place; the same answers from both layouts."""
    from k3.ops.mx_experts import packed_expert_situ_mlp_reference

    experts = Experts(4, 64, 96, 118, 124, seed=5)
    idx = torch.tensor([[3, 0], [0, 2]], device=DEVICE)
    z = torch.randn(2, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ref = torch.cat([packed_expert_situ_mlp_reference(
        z[n:n + 1].double(), torch.nn.functional.one_hot(idx[n, j], 4), experts) for n in range(2) for j in range(2)])
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = kernels.selected_situ_mlp(z.to(dt), idx, *experts.weights(decode), 4.0, 25.0, config=CONFIG)
        assert out.shape == (4, 64) and rel_err(out, ref) < tol, (dt, decode)


@pytest.mark.parametrize("L,I", [(512, 160), (384, 256)])
def test_default_tiles_per_reduction_width(kernels, L, I):
    """bf16 at decode takes 256-wide K blocks only in the launch whose reduction they divide (gate and up reduce
    over L, down over I); the other launch keeps 128 and masks its last block; the selected experts' launches
    take 64-wide N tiles (masked where the width is not a multiple): all equal the float64 reference, grouped and
    selected, in the decode layout."""
    from k3.ops.mx_experts import packed_expert_situ_mlp_reference

    x16 = torch.zeros(1, L, dtype=torch.bfloat16)
    up, down = kernels.launch_configs(1, x16, L, I)
    assert (up[:3], down[:3]) == ((16, 128, 256 if L % 256 == 0 else 128), (16, 128, 256 if I % 256 == 0 else 128))
    up_s, down_s = kernels.launch_configs(1, x16, L, I, selected=True)
    assert (up_s[:3], down_s[:3]) == ((16, 64, up[2]), (16, 64, down[2]))
    experts = Experts(3, L, I, 118, 124, seed=21)
    w = experts.weights(True)
    counts = torch.tensor([2, 0, 3], device=DEVICE)
    x = torch.randn(5, L, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    ref = packed_expert_situ_mlp_reference(x.double(), counts, experts, beta_gate=4.0, beta_up=25.0)
    assert rel_err(kernels.grouped_situ_mlp(x.bfloat16(), counts, *w, 4.0, 25.0), ref) < 2e-2
    idx = torch.tensor([[2, 0]], device=DEVICE)
    slots = torch.cat([packed_expert_situ_mlp_reference(x[:1].double(), torch.nn.functional.one_hot(idx[0, j], 3),
                                                        experts) for j in range(2)])
    assert rel_err(kernels.selected_situ_mlp(x[:1].bfloat16(), idx, *w, 4.0, 25.0), slots) < 2e-2


def test_kernels_refuse_mixed_layouts(kernels):
    experts = Experts(2, 64, 64, 118, 124, seed=7)
    released, decode = experts.weights(False), experts.weights(True)
    with pytest.raises(TypeError, match="one layout"):
        kernels.grouped_situ_mlp(torch.randn(2, 64, device=DEVICE), torch.tensor([1, 1], device=DEVICE),
                                 decode[0], released[1], decode[2], 4.0, 25.0, config=CONFIG)


# ---- a model's experts in the decode layout --------------------------------------------------------------------
def packed_tiny_model(seed):
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.ops.mx_experts import pack_experts_

    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    for m in model.modules():
        if getattr(m, "packed", None) is False and hasattr(m, "w1"):
            pack_experts_(m)
    return model


def test_model_in_decode_layout_saves_loads_and_runs_the_released_bytes():
    """use_decode_layout_ rearranges every expert stack in place; state_dict() still gives the released bytes,
    bit for bit; load_state_dict of released bytes lands rearranged; the forward (the reference on the CPU)
    is unchanged; use_released_layout_ restores the bytes exactly."""
    from k3.ops.mx_experts import use_decode_layout_, use_released_layout_

    model = packed_tiny_model(8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = model(ids).logits
    n = use_decode_layout_(model)
    assert n > 0 and use_decode_layout_(model) == 0
    packed_names = [k for k in before if k.endswith("_packed")]
    assert packed_names
    for k in packed_names:  # the module's own buffers hold the decode layout
        buf = model.get_buffer(k)
        assert torch.equal(buf, to_decode_layout(before[k])) and not torch.equal(buf, before[k])
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)

    other = packed_tiny_model(10)  # other random weights, converted, then given the first model's bytes
    assert not torch.equal(other.get_buffer(packed_names[0]), before[packed_names[0]])
    use_decode_layout_(other)
    other.load_state_dict(before)
    assert all(torch.equal(other.get_buffer(k), to_decode_layout(before[k])) for k in packed_names)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())

    assert use_released_layout_(model) == n
    assert all(torch.equal(model.get_buffer(k), before[k]) for k in packed_names)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_per_launch_tile_configs(kernels):
    """A pair of tile configs (gate and up, down), one with a register cap: the same answers; the two grouped
    launches must share BLOCK_M (one tile schedule), else a ValueError naming it."""
    from k3.ops.mx_experts import packed_expert_situ_mlp_reference

    experts = Experts(3, 64, 96, 118, 124, seed=11)
    counts = torch.tensor([2, 3, 0], device=DEVICE)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    ref = packed_expert_situ_mlp_reference(x.double(), counts, experts)
    pair = ((16, 32, 64, 4, 1, False), (16, 64, 32, 4, 1, False, 128))
    out = kernels.grouped_situ_mlp(x.bfloat16(), counts, *experts.weights(True), 4.0, 25.0, config=pair)
    assert rel_err(out, ref) < 2e-2
    with pytest.raises(ValueError, match="BLOCK_M"):
        kernels.grouped_situ_mlp(x.bfloat16(), counts, *experts.weights(True), 4.0, 25.0,
                                 config=((16, 32, 64, 4, 1, False), (32, 32, 64, 4, 1, False)))
