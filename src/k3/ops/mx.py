"""OCP microscaling (MX) codecs: E2M1 (FP4) and E4M3 (FP8) elements with one E8M0 scale per 32 values.

Storage layout of MXFP4 (SPEC §4, compressed-tensors `mxfp4-pack-quantized`):
  * an E2M1 code is 4 bits: bit 3 the sign, bits 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6};
  * two codes a byte along the input (last) dimension, the even column in the low nibble;
  * one E8M0 byte `s` per 32 consecutive input columns, value 2^(s - 127) (byte 255 is NaN, never written).

Encoding rules (decoding is the same for all of them):
  * scale exponent, `rule="ceil"` (the released tooling, the default for MXFP4): the smallest `e` with
    amax <= 6 * 2^e, i.e. ceil(log2(amax / 6)), so no element ever needs saturating;
    `rule="floor"` (the OCP MX spec, the default for MXFP8): floor(log2(amax)) - emax_elem (2 for E2M1,
    8 for E4M3), elements beyond the format's maximum saturate to it;
    the exponent is clamped to [-127, 127]; `shared_exponent` gives an all-zero block e = -127 (scale byte 0).
  * MXFP4 elements with `rule="ceil"` follow the released tooling exactly (SPEC §4, so that `k3 convert` and QAT
    write its bytes): round to nearest, an exact midpoint goes to the smaller magnitude, a negative value that
    rounds to zero keeps its sign bit (code 8), and an all-zero block gets scale byte 127 (2^0).
    With `rule="floor"` (and for the bare `e2m1_encode` default): ties to the even code (the IEEE rule, what a
    hardware cast does: the midpoints 0.25, 1.25, 2.5, 5 go down and 0.75, 1.75, 3.5 up), zero magnitudes are
    written as +0 (code 0), and an all-zero block gets scale byte 0, so it packs to zero bytes.
The exponent comes from `torch.frexp` (exact), scales are built from float32 exponent bits, and nibbles are
packed here: `.to(torch.float8_e8m0fnu)` rounds instead of flooring and fp4 has no cast kernel (SPEC §4).
"""
from __future__ import annotations

import torch

BLOCK = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring E2M1 magnitudes: crossing threshold i moves from code i to code i + 1.
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_RULES = ("ceil", "floor")
_TIES = ("even", "down")


def _e8m0_table() -> torch.Tensor:
    """float32 value of every E8M0 byte, from the exponent bits: byte b → 2^(b - 127); 0 → 2^-127; 255 → NaN."""
    bits = torch.arange(256, dtype=torch.int32) << 23  # the byte is exactly a float32 biased exponent
    bits[0] = 1 << 22  # 2^-127 is float32's largest subnormal power of two: mantissa bit 22
    bits[255] = 0x7FC00000
    return bits.view(torch.float32)


_E8M0 = _e8m0_table()


def e8m0_decode(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 bytes (uint8, any shape) → 2^(byte - 127) as `dtype` (exact in float32/float64/bf16)."""
    _check_uint8(scale, "scale")
    return _E8M0.to(scale.device)[scale.long()].to(dtype)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent for integer exponents in [-127, 127], as exact float32."""
    return _E8M0.to(exponent.device)[(exponent + 127).long()]


def _check_uint8(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise TypeError(f"{name} must be a uint8 tensor, got {getattr(t, 'dtype', type(t).__name__)}")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---- scales --------------------------------------------------------------------------------------------------
def shared_exponent(amax: torch.Tensor, elem_max: float, rule: str = "ceil") -> torch.Tensor:
    """Block exponent e (int32, clamped to [-127, 127]) for block maxima amax >= 0.

    ceil: the smallest e with amax <= elem_max * 2^e. floor: floor(log2(amax)) - floor(log2(elem_max)).
    Computed from frexp(amax) = m * 2^k, m in [0.5, 1), so there is no log2 rounding to worry about."""
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {_RULES}, got {rule!r}")
    m, k = torch.frexp(amax)
    k = k.to(torch.int32)
    em, ek = torch.frexp(torch.tensor(elem_max, dtype=amax.dtype))  # elem_max = em * 2^ek
    ek = int(ek)
    if rule == "floor":
        e = (k - 1) - (ek - 1)
    else:  # m * 2^k <= em * 2^(ek + e)  ⟺  e >= k - ek when m <= em, else e >= k - ek + 1
        e = k - ek + (m > float(em)).to(torch.int32)
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


def _blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name}: the last dimension must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


# ---- E2M1 ----------------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Already-scaled values → E2M1 codes (uint8 in 0..15, same shape); |x| > 6 saturates to ±6.

    ties="even": round to nearest, ties to the even code, zero magnitudes get code 0 (never -0).
    ties="down": the released tooling's rule: a value moves up past a midpoint only when strictly greater, and
    the sign bit is kept on values that round to zero (SPEC §4)."""
    if ties not in _TIES:
        raise ValueError(f"ties must be one of {_TIES}, got {ties!r}")
    mag = x.abs().clamp(max=E2M1_MAX)
    th = torch.tensor(_E2M1_THRESHOLDS, dtype=mag.dtype, device=mag.device)
    down = torch.bucketize(mag, th, right=False)  # ties resolve to the lower code
    if ties == "down":
        return down.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    up = torch.bucketize(mag, th, right=True)  # ties resolve to the upper code
    code = torch.where((up != down) & (down % 2 == 1), up, down).to(torch.uint8)
    sign = (torch.signbit(x) & (code != 0)).to(torch.uint8) << 3
    return code | sign


def _mxfp4_exponent(xb: torch.Tensor, rule: str) -> torch.Tensor:
    """Each block's exponent; under the released rule ("ceil") an all-zero block takes 0 (scale byte 127)."""
    amax = xb.abs().amax(-1)
    e = shared_exponent(amax, E2M1_MAX, rule)
    return torch.where(amax > 0, e, torch.zeros_like(e)) if rule == "ceil" else e


def _mxfp4_ties(rule: str) -> str:
    return "down" if rule == "ceil" else "even"


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) → values."""
    _check_uint8(codes, "codes")
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return table[(codes & 0xF).long()]


def mxfp4_pack(w: torch.Tensor, rule: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., in] float with in % 32 == 0 → (weight_packed uint8 [..., in/2], weight_scale uint8 [..., in/32]).

    Non-finite weights raise ValueError (they have no MXFP4 encoding)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a tensor, got {type(w).__name__}")
    xb = _blocks(w.detach().to(_work_dtype(w)), "mxfp4_pack(w)")
    if not torch.isfinite(xb).all():
        raise ValueError("mxfp4_pack(w): w holds NaN or inf, which MXFP4 cannot encode")
    e = _mxfp4_exponent(xb, rule)
    # x * 2^-e is exact (a power of two), so rounding decisions are made on the true quotient.
    codes = e2m1_encode(xb * _pow2(-e).to(xb.dtype)[..., None], _mxfp4_ties(rule)).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8)


def mxfp4_unpack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(weight_packed uint8 [..., in/2], weight_scale uint8 [..., in/32]) → w [..., in] as `dtype`.

    `w[r, c] = value(code[r, c]) * 2^(scale[r, c // 32] - 127)`; exact in float32 for every byte the encoder
    writes (a scale byte 254 with code ±6 exceeds float32 and gives ±inf, as it must)."""
    _check_uint8(weight_packed, "weight_packed")
    _check_uint8(weight_scale, "weight_scale")
    n = weight_packed.shape[-1] * 2
    if weight_packed.shape[:-1] != weight_scale.shape[:-1] or n != weight_scale.shape[-1] * BLOCK:
        raise ValueError(f"weight_packed {tuple(weight_packed.shape)} and weight_scale {tuple(weight_scale.shape)} "
                         f"do not match: expected [..., in/2] and [..., in/32] with the same leading dimensions")
    codes = torch.stack((weight_packed & 0xF, weight_packed >> 4), -1).reshape(*weight_packed.shape[:-1], n)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e2m1_decode(codes, work).reshape(*codes.shape[:-1], n // BLOCK, BLOCK)
    return (vals * e8m0_decode(weight_scale, work)[..., None]).reshape(codes.shape).to(dtype)


def mxfp4_quantize_dequantize(w: torch.Tensor, rule: str = "ceil") -> torch.Tensor:
    """The MXFP4 round trip without packing: equals `mxfp4_unpack(*mxfp4_pack(w))` in w's dtype. w: [..., in]."""
    work = _work_dtype(w)
    xb = _blocks(w.to(work), "mxfp4 fake-quant")
    scale = _pow2(_mxfp4_exponent(xb, rule)).to(work)[..., None]
    q = e2m1_decode(e2m1_encode(xb / scale, _mxfp4_ties(rule)), work) * scale
    return q.reshape(w.shape).to(w.dtype)


# ---- E4M3 ----------------------------------------------------------------------------------------------------
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Already-scaled values → E4M3 (float8_e4m3fn) bit patterns, uint8. Round to nearest even; |x| > 448
    saturates to ±448 (the fn variant has no inf; 0x7F/0xFF are NaN and never written); ±0 → 0x00."""
    work = _work_dtype(x)
    mag = x.to(work).abs().clamp(max=E4M3_MAX)
    _, k = torch.frexp(mag.clamp(min=2.0 ** -6))  # below 2^-6 (subnormals, zero) the spacing stays 2^-9
    exp = k.to(torch.int32) - 1  # unbiased exponent of the binade
    # Quantum 2^(exp-3); n in [8, 16] for normals (16 carries into the next binade), [0, 8] for subnormals.
    n = torch.round(mag * _pow2(3 - exp).to(work)).to(torch.int32)  # torch.round: ties to even
    code = ((exp + 6) << 3) + n  # linear in the value, so a carry n = 16 lands on the next exponent's code
    sign = (torch.signbit(x) & (code != 0)).to(torch.int32) << 7
    return (code | sign).to(torch.uint8)


def e4m3_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn bit patterns (uint8) → values; 0x7F and 0xFF decode to NaN."""
    _check_uint8(codes, "codes")
    c = codes.to(torch.int32)
    ex, mant = (c >> 3) & 0xF, c & 7
    work = torch.float64 if dtype == torch.float64 else torch.float32
    normal = (mant + 8).to(work) * _pow2(ex.clamp(min=1) - 10).to(work)
    sub = mant.to(work) * 2.0 ** -9
    v = torch.where(ex == 0, sub, normal)
    v = torch.where((c & 0x7F) == 0x7F, torch.full_like(v, float("nan")), v)
    return torch.where((c & 0x80) != 0, -v, v).to(dtype)


def mxfp8_quantize(x: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., n] float, n % 32 == 0 → (E4M3 codes uint8 [..., n], E8M0 scales uint8 [..., n/32]).

    Default `rule="floor"` is the OCP MX rule (elements above 448 after scaling saturate)."""
    xb = _blocks(x.detach().to(_work_dtype(x)), "mxfp8_quantize(x)")
    e = shared_exponent(xb.abs().amax(-1), E4M3_MAX, rule)
    codes = e4m3_encode(xb * _pow2(-e).to(xb.dtype)[..., None])
    return codes.reshape(x.shape), (e + 127).to(torch.uint8)


def mxfp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes uint8 [..., n], scale uint8 [..., n/32]) → values [..., n] as `dtype`."""
    _check_uint8(codes, "codes")
    _check_uint8(scale, "scale")
    if codes.shape[:-1] != scale.shape[:-1] or codes.shape[-1] != scale.shape[-1] * BLOCK:
        raise ValueError(f"codes {tuple(codes.shape)} and scale {tuple(scale.shape)} do not match: "
                         f"expected [..., n] and [..., n/32]")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e4m3_decode(codes, work).reshape(*scale.shape, BLOCK)
    return (vals * e8m0_decode(scale, work)[..., None]).reshape(codes.shape).to(dtype)


def mxfp8_quantize_dequantize(x: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """The MXFP8 round trip in x's dtype: equals `mxfp8_dequantize(*mxfp8_quantize(x))`. x: [..., n]."""
    return mxfp8_dequantize(*mxfp8_quantize(x, rule), dtype=x.dtype)


# ---- fake quantization with straight-through gradients ----------------------------------------------------------
class _StraightThrough(torch.autograd.Function):
    """Forward: the quantize-dequantize result exactly; backward: the identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def mxfp4_fake_quant(w: torch.Tensor, rule: str = "ceil") -> torch.Tensor:
    """MXFP4 quantize-dequantize of w [..., in] (blocks of 32 along `in`) with straight-through gradients."""
    return _StraightThrough.apply(w, lambda t: mxfp4_quantize_dequantize(t, rule))


def mxfp8_fake_quant(x: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """MXFP8 quantize-dequantize of x [..., n] (blocks of 32 along `n`) with straight-through gradients."""
    return _StraightThrough.apply(x, lambda t: mxfp8_quantize_dequantize(t, rule))
