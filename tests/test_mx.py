"""MX codecs (k3.ops.mx): every E2M1/E4M3/E8M0 code against independent formulas, the MXFP4 layout, the scale
rules and rounding, fake-quant with straight-through gradients, and cross-checks against compressed-tensors
(MXFP4 decoding) and torchao's MX reference (MXFP8 and MXFP4 encoding)."""
import math
import warnings

import pytest
import torch

from k3.ops.mx import (e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode, mxfp4_fake_quant,
                       mxfp4_pack, mxfp4_quantize_dequantize, mxfp4_unpack, mxfp8_dequantize, mxfp8_fake_quant,
                       mxfp8_quantize, mxfp8_quantize_dequantize, shared_exponent)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_formula(code: int) -> float:
    """E2M1 from its bit fields: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 subnormal."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def e2m1_nearest(v: float) -> float:
    """Brute-force round to the E2M1 grid (|v| clamped to 6), ties to the even code index."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - mag), i % 2))
    return math.copysign(GRID[best], v) if best else 0.0


def scaled_weights(rows=16, cols=128, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return (w * torch.exp2(torch.randint(-30, 30, (rows, cols // 32), generator=g)).repeat_interleave(32, 1)).to(dtype)


# ---- element and scale codes ---------------------------------------------------------------------------------------
def test_every_e2m1_code_decodes_per_its_bit_fields():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == [e2m1_formula(c) for c in range(16)]


def test_every_e8m0_byte_decodes_to_a_power_of_two():
    got = e8m0_decode(torch.arange(256, dtype=torch.uint8), torch.float64)
    assert got[:255].tolist() == [math.ldexp(1.0, b - 127) for b in range(255)]  # byte 0 is 2^-127, not 0
    assert math.isnan(got[255])
    assert e8m0_decode(torch.tensor([0], dtype=torch.uint8)).item() == 2.0 ** -127  # float32 subnormal, exact


def test_every_e4m3_code_matches_torch_float8():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float()
    got = e4m3_decode(codes)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got[~ref.isnan()], ref[~ref.isnan()])


def test_e4m3_encode_matches_torch_cast_including_ties_and_saturation():
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].sort().values
    x = torch.cat([torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4),
                   grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([500.0, -1e6, 449.0])])
    got = e4m3_decode(e4m3_encode(x))
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # saturate first: the fn cast has no inf
    assert torch.equal(got, ref)
    assert e4m3_encode(torch.tensor([0.0, -0.0])).tolist() == [0, 0]


def test_e2m1_rounding_is_nearest_with_ties_to_even():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    g = torch.Generator().manual_seed(1)
    vals = torch.tensor(mids + [-m for m in mids] + GRID + [7.0, -100.0, 1e-30], dtype=torch.float64)
    vals = torch.cat([vals, torch.rand(4000, generator=g, dtype=torch.float64) * 14 - 7])
    got = e2m1_decode(e2m1_encode(vals), torch.float64).tolist()
    assert got == [e2m1_nearest(v) for v in vals.tolist()]
    # the documented tie directions: 0.25, 1.25, 2.5, 5 go down; 0.75, 1.75, 3.5 go up
    assert e2m1_decode(e2m1_encode(torch.tensor(mids))).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


# ---- MXFP4 -------------------------------------------------------------------------------------------------------------
def test_pack_layout_from_hand_built_codes():
    # Build w from chosen codes and scales, so the expected bytes are known without the encoder.
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    codes[codes == 8] = 0  # -0 is written as +0
    codes[:, ::32] = 7  # each block's max is 6 * 2^e, so the ceil rule recovers the chosen scale exactly
    scale = torch.randint(100, 150, (4, 2), generator=g)
    w = torch.tensor([[e2m1_formula(int(c)) for c in row] for row in codes], dtype=torch.float64)
    w = w * torch.exp2(scale.double() - 127).repeat_interleave(32, 1)
    packed, sc = mxfp4_pack(w)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 32) and sc.shape == (4, 2)
    assert torch.equal(sc, scale.to(torch.uint8))
    for r in range(4):
        for j in range(32):  # even column in the low nibble, odd column in the high nibble
            assert packed[r, j].item() == int(codes[r, 2 * j]) | (int(codes[r, 2 * j + 1]) << 4)
    assert torch.equal(mxfp4_unpack(packed, sc, torch.float64), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pack_unpack_equals_fake_quant(dtype):
    w = scaled_weights(dtype=dtype)
    ref = mxfp4_quantize_dequantize(w)
    assert torch.equal(mxfp4_unpack(*mxfp4_pack(w), dtype=dtype), ref)
    assert torch.equal(mxfp4_fake_quant(w), ref)
    assert ref.dtype == dtype


def test_ceil_rule_scale_definition_and_no_overflow():
    w = scaled_weights(64, 256, seed=3, dtype=torch.float64)
    _, sc = mxfp4_pack(w)
    amax = w.abs().reshape(64, 8, 32).amax(-1)
    e = sc.double() - 127
    assert bool((amax <= 6 * torch.exp2(e)).all())  # never needs saturating
    assert bool((amax > 6 * torch.exp2(e - 1)).all())  # and the smallest such exponent
    q = mxfp4_quantize_dequantize(w)
    # per-element error at most half a grid step: ≤ 1 * 2^e (the widest step, 4 → 6, is 2)
    assert bool(((q - w).abs().reshape(64, 8, 32) <= torch.exp2(e)[..., None]).all())


def test_edge_scales_and_all_zero_blocks():
    rows = torch.zeros(6, 64, dtype=torch.float64)
    rows[0, :32] = 6 * 2.0 ** 5  # ±6·2^k decodes exactly with scale byte k + 127 and code 7
    rows[0, 32:] = -6 * 2.0 ** -20
    rows[1, :32] = 2.0 ** -130  # below 6 * 2^-127: exponent clamps to -127, values round to 0
    rows[2, :32] = 6 * 2.0 ** 130  # float64 beyond the E8M0 range: exponent clamps to 127 and saturates to ±6
    rows[3, 5] = 6 * 2.0 ** -127  # the smallest full-scale block: scale byte 0
    rows[4, :32] = torch.linspace(-3, 3, 32, dtype=torch.float64)  # amax 3 = 6 * 2^-1
    packed, sc = mxfp4_pack(rows)
    out = mxfp4_unpack(packed, sc, torch.float64)
    assert sc[0].tolist() == [132, 107] and torch.equal(out[0], rows[0])
    assert sc[1, 0] == 0 and torch.equal(out[1], torch.zeros(64, dtype=torch.float64))
    assert sc[2, 0] == 254 and torch.equal(out[2, :32], torch.full((32,), 6 * 2.0 ** 127, dtype=torch.float64))
    assert sc[3, 0] == 0 and out[3, 5] == rows[3, 5]
    assert sc[4, 0] == 126
    # all-zero blocks: zero bytes and, by the released tooling's rule (SPEC §4), scale byte 127
    assert torch.equal(packed[5], torch.zeros(32, dtype=torch.uint8)) and sc[5].tolist() == [127, 127]
    assert mxfp4_pack(rows, rule="floor")[1][5].tolist() == [0, 0]  # the OCP rule: log2(0) = -inf clamps to -127
    assert torch.equal(packed[0, 16:], torch.full((16,), 0xFF, dtype=torch.uint8))  # -6: code 15 twice a byte


def test_released_rule_ties_go_to_the_smaller_magnitude_and_keep_negative_zero_signs():
    """SPEC §4: a value moves up past a midpoint only when strictly greater; a negative value that rounds to zero
    keeps its sign bit; an all-zero block has scale byte 127. Expected bytes are written out by hand."""
    # block max 6 → exponent ceil(log2(6/6)) = 0, scale byte 127: the values below are already on the code scale
    block = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,  # every midpoint: down to codes 0, 1, 2, 3, 4, 5, 6
             -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0,  # the same with the sign bit (8): 8 ... 14, 8
             0.2500001, 0.7500001, 3.5000005, -5.000001,  # just above a midpoint: up to codes 1, 2, 6, 15
             -1e-9, 0.0, 0.5, -6.0] + [0.0] * 8  # a negative that rounds to 0 keeps its sign: 8
    w = torch.tensor([block, [x * 2.0 ** 10 for x in block]], dtype=torch.float64)  # ×2^10: scale byte 137
    w = torch.cat([w, torch.zeros(2, 32, dtype=torch.float64)], 1)
    w[1, 32:] = -0.0  # an all-zero block of negative zeros: scale 127, sign bits kept
    packed, sc = mxfp4_pack(w)
    codes = [7, 0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 8, 1, 2, 6, 15, 8, 0, 1, 15] + [0] * 8
    want = [codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)]
    assert want[:8] == [0x07, 0x21, 0x43, 0x65, 0x98, 0xBA, 0xDC, 0x8E]  # the hand-packed bytes
    assert packed[0, :16].tolist() == want and packed[1, :16].tolist() == want
    assert packed[0, 16:].tolist() == [0] * 16 and packed[1, 16:].tolist() == [0x88] * 16
    assert sc.tolist() == [[127, 127], [137, 127]]
    # QAT's fake-quant takes the same decisions as the packed bytes `k3 convert` writes
    assert torch.equal(mxfp4_quantize_dequantize(w), mxfp4_unpack(packed, sc, torch.float64))
    assert torch.equal(torch.signbit(mxfp4_quantize_dequantize(w)), torch.signbit(mxfp4_unpack(packed, sc, torch.float64)))


def test_compressed_tensors_cast_rounds_midpoints_to_even_where_spec_rounds_down():
    """compressed-tensors' own E2M1 cast takes ties to even; the released tooling (SPEC §4, which k3 follows) takes
    them to the smaller magnitude. They differ exactly at the midpoints 0.75, 1.75 and 3.5."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install k3[dev])")
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    theirs = cast_to_fp4(mids.clone()).tolist()
    ours = e2m1_decode(e2m1_encode(mids, ties="down")).tolist()
    assert theirs == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0] == e2m1_decode(e2m1_encode(mids)).tolist()
    assert ours == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_floor_rule_agrees_with_ceil_when_mantissa_at_most_1_5_else_saturates():
    k = torch.arange(-10, 10, dtype=torch.float64)
    for mant, same in ((1.0, True), (1.25, True), (1.5, True), (1.8, False)):  # 1.75: a tie, rounded down to the same
        w = torch.zeros(20, 32, dtype=torch.float64)
        w[:, 0] = mant * torch.exp2(k)
        w[:, 1] = -0.3 * torch.exp2(k)
        a, b = mxfp4_quantize_dequantize(w, "ceil"), mxfp4_quantize_dequantize(w, "floor")
        assert torch.equal(a, b) == same, mant
        if not same:  # OCP rule: scale 2^(floor(log2 amax) - 2), the block max saturates to 6 * scale
            assert torch.equal(b[:, 0], 6 * torch.exp2(k - 2))


def test_shared_exponent_matches_float_log2_definition():
    g = torch.Generator().manual_seed(4)
    amax = torch.exp2(torch.rand(5000, generator=g, dtype=torch.float64) * 200 - 100)
    got = shared_exponent(amax, 6.0, "ceil")
    want = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    exact = (amax / 6 * torch.exp2(-want) - 1).abs() > 1e-9  # log2 may round only at exact powers of two
    assert torch.equal(got[exact].double(), want[exact])
    assert torch.equal(shared_exponent(amax, 448.0, "floor").double(), (torch.floor(torch.log2(amax)) - 8).clamp(-127, 127))


def test_fake_quant_gradients_are_straight_through():
    w = scaled_weights(4, 64).requires_grad_()
    up = torch.randn(4, 64)
    (mxfp4_fake_quant(w) * up).sum().backward()
    assert torch.equal(w.grad, up)
    x = torch.randn(3, 96, requires_grad=True)
    (mxfp8_fake_quant(x) * up[:3, :32].repeat(1, 3)).sum().backward()
    assert torch.equal(x.grad, up[:3, :32].repeat(1, 3))


def test_user_errors_are_clear():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_pack(torch.randn(4, 48))
    with pytest.raises(ValueError, match="NaN or inf"):
        mxfp4_pack(torch.full((1, 32), float("nan")))
    with pytest.raises(TypeError, match="uint8"):
        mxfp4_unpack(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_unpack(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rule"):
        mxfp4_pack(torch.randn(1, 32), rule="round")


# ---- MXFP8 -------------------------------------------------------------------------------------------------------------
def test_mxfp8_round_trip_properties():
    x = scaled_weights(8, 96, seed=5)
    codes, sc = mxfp8_quantize(x)
    amax = x.double().abs().reshape(8, 3, 32).amax(-1)
    assert torch.equal(sc.double() - 127, torch.floor(torch.log2(amax)) - 8)  # the OCP rule
    q = mxfp8_dequantize(codes, sc)
    assert torch.equal(q, mxfp8_quantize_dequantize(x))
    rel = ((q - x).abs() / x.abs().clamp(min=1e-30)).reshape(8, 3, 32)
    big = x.abs().reshape(8, 3, 32) >= amax[..., None] / 64  # normal range: 3 mantissa bits, ≤ 2^-4 relative
    assert bool((rel[big & (x.abs().reshape(8, 3, 32) <= 448 * torch.exp2(sc.double() - 127)[..., None])] <= 2 ** -4).all())


# ---- cross-checks against real libraries ----------------------------------------------------------------------------
def test_compressed_tensors_decompresses_k3_mxfp4_to_the_same_values():
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install k3[dev])")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = scaled_weights(32, 128, seed=6)
    packed, sc = mxfp4_pack(w)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8))
    out = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": sc}, scheme)
    assert torch.equal(out["weight"].float(), mxfp4_unpack(packed, sc))
    assert torch.equal(out["weight"].float(), mxfp4_quantize_dequantize(w))
    assert ct is not None


@pytest.fixture(scope="module")
def torchao_mx():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao", reason="torchao is not installed (pip install k3[dev])")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    return to_mx, to_dtype, ScaleCalculationMode


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_torchao_mxfp8_agrees(torchao_mx, rule):
    to_mx, to_dtype, mode = torchao_mx
    x = scaled_weights(16, 128, seed=7)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, mode.FLOOR if rule == "floor" else mode.RCEIL)
    codes, sc = mxfp8_quantize(x, rule)
    assert torch.equal(scale.view(torch.uint8).reshape(sc.shape), sc)
    assert torch.equal(e4m3_decode(data.view(torch.uint8)), e4m3_decode(codes))
    assert torch.equal(to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32), mxfp8_dequantize(codes, sc))


def test_torchao_mxfp4_floor_rule_agrees_bytewise(torchao_mx):
    to_mx, _, mode = torchao_mx
    x = scaled_weights(16, 128, seed=8)
    scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, mode.FLOOR)
    packed, sc = mxfp4_pack(x, rule="floor")
    ref = data.view(torch.uint8)
    lo, hi = ref & 0xF, ref >> 4  # torchao keeps -0 (code 8); k3 writes +0
    ref = torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)
    assert torch.equal(scale.view(torch.uint8).reshape(sc.shape), sc)
    assert torch.equal(ref, packed)
