"""GGUF's quantized tensors that are affine per 32 values, as MLX affine arrays, exactly.

The legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) store blocks of 32 values: a float16 scale ``d``,
for the ``_1`` types a float16 minimum ``m``, and unsigned codes ``q`` of 4, 5 or 8 bits (Q8_0
stores signed bytes, ``q + 128`` here).  A value is ``d * q + m``, where the ``_0`` types' minimum
is ``-d * 2^(bits - 1)``.  Q4_K and Q5_K store super-blocks of 256 values: eight groups of 32, each
with a 6-bit scale and a 6-bit minimum multiplied by the super-block's float16 ``d`` and ``dmin``; a
value is ``d * sc * q - dmin * mn``.  Both are MLX's affine quantization with group 32
(``w = scale * q + bias``), so :func:`affine` moves the codes into MLX's packing and keeps the
scales and minimums (products of a float16 and a 6-bit integer: exact in float32): no value
changes, and the tensor keeps its own bits (a Q5_0 tensor stays 5 bits, a Q4_K one 4).
``mx.load`` does the same for Q4_0, Q4_1 and Q8_0, but refuses a whole file that holds any other
type (every K-quant file does); this serves such files one tensor at a time.  ``mx.dequantize`` of
the result equals the ``gguf`` package's dequantization bit for bit
(``tests/mlx_lm/test_gguf_repack.py``).  Q6_K (groups of 16) and the smaller K-quants are not
affine per 32: the loader dequantizes them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# type: (bits, bytes per block of 32, whether the block stores its minimum)
_LAYOUT = {"Q4_0": (4, 18, False), "Q4_1": (4, 20, True), "Q5_0": (5, 22, False), "Q5_1": (5, 24, True),
           "Q8_0": (8, 34, False)}
# K-quants: (bits, bytes per super-block of 256): d, dmin (float16), 12 bytes of 6-bit scales and
# minimums, Q5_K's 32 bytes of fifth bits, then the low nibbles
_K_LAYOUT = {"Q4_K": (4, 144), "Q5_K": (5, 176)}
AFFINE_TYPES = frozenset(_LAYOUT) | frozenset(_K_LAYOUT)
GROUP_SIZE = 32


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)[:, 0]


def _codes(blocks: np.ndarray, kind: str, at: int) -> np.ndarray:
    """``(blocks, 32)`` unsigned codes; ``at``: where the block's code bytes start."""
    if kind == "Q8_0":
        return blocks[:, at:] ^ np.uint8(0x80)  # a signed byte plus 128 is its sign bit flipped
    high = None
    if kind in ("Q5_0", "Q5_1"):  # the fifth bit of value j is bit j of a little-endian uint32
        qh = np.ascontiguousarray(blocks[:, at : at + 4]).view("<u4")[:, 0]
        high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        at += 4
    qs = blocks[:, at : at + 16]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # values 0-15 in the low nibbles, 16-31 in the high
    return q if high is None else q | high


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of codes ``(..., d)``: value ``i`` in bits ``[i * bits, (i + 1) * bits)`` of
    the little-endian bit stream of the uint32 words ``(..., d * bits / 32)``.  The layout of
    ``core.codec.pack_codes``, in numpy bytes: that one holds ``bits`` uint32 per code while it
    packs (5 GB for Gemma 3's 168M-value embedding), which a load that peaks at its model's own
    size cannot afford."""
    lead, d = q.shape[:-1], q.shape[-1]
    if bits == 8:
        return np.ascontiguousarray(q).view("<u4")
    if bits == 4:
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)).view("<u4")
    # 5 bits: 8 codes fill 5 bytes (uint8 arithmetic drops the bits that go to the next byte)
    c = q.reshape(-1, 8).T
    five = np.empty((len(c[0]), 5), np.uint8)
    five[:, 0] = c[0] | (c[1] << 5)
    five[:, 1] = (c[1] >> 3) | (c[2] << 2) | (c[3] << 7)
    five[:, 2] = (c[3] >> 1) | (c[4] << 4)
    five[:, 3] = (c[4] >> 4) | (c[5] << 1) | (c[6] << 6)
    five[:, 4] = (c[6] >> 2) | (c[7] << 3)
    return five.reshape(*lead, d * 5 // 8).view("<u4")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums ``(blocks, 8)`` of a K-quant super-block's 12 bytes:
    bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 minimums 0-3; scales and minimums
    4-7 take their low 4 bits from bytes 8-11 (low and high nibble) and their top 2 bits from the
    top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    lo, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales, mins


def _k_affine(raw: np.ndarray, kind: str, shape: tuple) -> tuple:
    bits, size = _K_LAYOUT[kind]
    blocks = raw.reshape(-1, size)
    n = len(blocks)
    sc, mn = _k_scales(blocks[:, 4:16])
    scales = _half(blocks, 0).astype(np.float32)[:, None] * sc.astype(np.float32)
    biases = -(_half(blocks, 2).astype(np.float32)[:, None] * mn.astype(np.float32))
    # each 32 bytes of nibbles hold two groups: the low nibbles the first, the high the second
    qs = blocks[:, size - 128 :].reshape(n, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    if bits == 5:  # group g's fifth bits: bit g of each of the 32 bytes
        qh = blocks[:, 16:48].reshape(n, 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
    groups = (*shape[:-1], shape[-1] // GROUP_SIZE)
    return (mx.array(_pack(q.reshape(*shape), bits)), mx.array(scales.reshape(groups)),
            mx.array(biases.reshape(groups)), bits)


def affine(raw: np.ndarray, kind: str, shape: tuple) -> tuple:
    """``(weight uint32, scales float32, biases float32, bits)`` of a tensor of ``AFFINE_TYPES``,
    MLX affine with group 32, from its bytes ``raw`` (uint8) and numpy ``shape``."""
    if kind in _K_LAYOUT:
        return _k_affine(raw, kind, shape)
    bits, size, has_min = _LAYOUT[kind]
    blocks = raw.reshape(-1, size)
    scales = _half(blocks, 0).astype(np.float32)
    # the _0 types' minimum, -d * 2^(bits - 1): exact in float32 (a power of two times a float16)
    biases = _half(blocks, 2).astype(np.float32) if has_min else scales * -(1 << (bits - 1))
    q = _codes(blocks, kind, 4 if has_min else 2).reshape(*shape)
    # float32 (exact): a quantized layer computes in its scales' dtype, and this loader's other
    # tensors are float32 too; with float16 scales Gemma 3's quantized embedding would put its
    # residual stream in float16, which moved its logits by a tenth of their range
    groups = (*shape[:-1], shape[-1] // GROUP_SIZE)
    return mx.array(_pack(q, bits)), mx.array(scales.reshape(groups)), mx.array(biases.reshape(groups)), bits
