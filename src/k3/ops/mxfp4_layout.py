"""The decode layout of packed MXFP4 experts: a serving-time rearrangement of the released bytes (SPEC §4) for
k3's Triton expert kernels on the GPU (`k3.ops._mxfp4_triton`); checkpoints keep the released layout.

Released: each 4-byte word holds 8 consecutive input columns, column j in bits 4j..4j+3 (sign bit 3, magnitude
bits 0-2). The kernels turn two E2M1 codes into a bf16 pair (bf16x2, the operand register of an MMA) by placing
each code's sign at bf16 bit 15 and its magnitude at bits 6-8 (that bf16 is the E2M1 value times 2^-126; one
bf16x2 multiply by 2^126 · scale gives the weights, exactly). In the released layout that costs two shifts,
two masks and an or a pair. Here each word's 32 bits are permuted once, at load time, so that the 4 pairs of a
word come out of one rotation and one mask each (`DECODE_PAIRS`: pairs 0-2 rotated by 0, 6, 12 bits, all
three then masked by 0x81C081C0; pair 3 needs two rotations, since no four rotations of that mask tile 32 bits).

The pairs hold the word's even columns (0, 2), (4, 6) and odd columns (1, 3), (5, 7), so the kernels meet
the even and odd halves of the activations as before. Scales (E8M0 bytes) are not rearranged. `to_decode_layout`
and `to_released_layout` are exact inverses (a bit permutation), in plain PyTorch on any device.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# bf16 bit of each E2M1 code bit (m0, m1, m2, sign) in the low half of a bf16x2; the high half is +16
_BF16_BIT = (6, 7, 8, 15)
# (low-half column, high-half column) of pair k, columns 0..7 of the word; k = 0, 1: even, 2, 3: odd
DECODE_PAIRS = ((0, 2), (4, 6), (1, 3), (5, 7))
# right-rotation that brings each code bit (m0, m1, m2, sign) of pair k to its bf16 place
_ROTATION = ((0, 0, 0, 0), (6, 6, 6, 6), (12, 12, 12, 12), (10, 10, 2, 10))
PAIR_MASK = 0x81C081C0  # sign and magnitude bits of both halves


def _permutation() -> list[int]:
    """decode-layout bit (0..31) of each released-layout bit: released bit 4·col + b → its place in the word."""
    perm = [-1] * 32
    for k, cols in enumerate(DECODE_PAIRS):
        for half, col in enumerate(cols):
            for b in range(4):
                perm[4 * col + b] = (_BF16_BIT[b] + 16 * half + _ROTATION[k][b]) % 32
    assert sorted(perm) == list(range(32)), "the decode layout must be a permutation of the word's bits"
    return perm


_PERM = _permutation()


def _permute_bits(packed: torch.Tensor, perm: list[int]) -> torch.Tensor:
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed MXFP4 weights must be uint8, got {packed.dtype}")
    if packed.shape[-1] % 4:
        raise ValueError(f"packed MXFP4 weights need a multiple of 4 bytes a row (8 columns), got {packed.shape[-1]}")
    words = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 4, 4)
    out = torch.zeros_like(words)
    for src, dst in enumerate(perm):  # 32 passes over uint8 tensors: no wide temporaries on a full GPU
        bit = (words[..., src // 8] >> (src % 8)) & 1
        out[..., dst // 8] |= bit << (dst % 8)
    return out.reshape(packed.shape)


def to_decode_layout(packed: torch.Tensor) -> torch.Tensor:
    """Released packed bytes [..., in/2] (uint8) → the same bytes in the decode layout (a new tensor)."""
    return _permute_bits(packed, _PERM)


def to_released_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_decode_layout`: decode-layout bytes → the released (checkpoint) layout."""
    inverse = [0] * 32
    for src, dst in enumerate(_PERM):
        inverse[dst] = src
    return _permute_bits(packed, inverse)


def scale_bias(scale: torch.Tensor) -> int:
    """B ≥ 0 such that every E8M0 byte s of the matrix gives a finite bf16 factor 2^(s - 1 - B) (B = 0 unless a
    scale exceeds 2^1): the kernels multiply the decoded pairs by that factor and their fp32 sums by 2^B.
    Reads one byte on the host (once, at load time)."""
    if scale.numel() == 0:
        return 0
    return min(126, max(0, int(scale.max()) - 128))  # byte 255 (NaN, never written) stays NaN-like


class DecodeLayoutWeight(NamedTuple):
    """One stacked expert matrix as the GPU kernels read it: packed bytes in the decode layout [E, out, in/2],
    the released E8M0 scales [E, out, in/32] and their `scale_bias`."""
    packed: torch.Tensor
    scale: torch.Tensor
    bias: int


def decode_layout_weight(packed: torch.Tensor, scale: torch.Tensor) -> DecodeLayoutWeight:
    """A released (packed, scale) pair → its `DecodeLayoutWeight` (new bytes; the scales are shared)."""
    return DecodeLayoutWeight(to_decode_layout(packed), scale, scale_bias(scale))
