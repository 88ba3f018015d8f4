"""GGUF's legacy quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as MLX affine arrays, exactly.

Each legacy block holds 32 values: a float16 scale ``d``, for the ``_1`` types a float16 minimum
``m``, and unsigned codes ``q`` of 4, 5 or 8 bits (Q8_0 stores signed bytes, ``q + 128`` here).
A value is ``d * q + m``, where the ``_0`` types' minimum is ``-d * 2^(bits - 1)``.  That is MLX's
affine quantization with group 32 (``w = scale * q + bias``), so :func:`affine` moves the codes
into MLX's packing and keeps ``d`` and ``m`` as the scales and biases: no value changes, and the
tensor keeps its own bits (a Q5_0 tensor stays 5 bits).  ``mx.load`` does the same for Q4_0, Q4_1
and Q8_0, but refuses a whole file that holds any other type (every K-quant file does); this
serves such files one tensor at a time.  ``mx.dequantize`` of the result equals the ``gguf``
package's dequantization bit for bit (``tests/mlx_lm/test_gguf_repack.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# type: (bits, bytes per block of 32, whether the block stores its minimum)
_LAYOUT = {"Q4_0": (4, 18, False), "Q4_1": (4, 20, True), "Q5_0": (5, 22, False), "Q5_1": (5, 24, True),
           "Q8_0": (8, 34, False)}
LEGACY_TYPES = frozenset(_LAYOUT)
GROUP_SIZE = 32


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)[:, 0]


def _codes(blocks: np.ndarray, kind: str, at: int) -> np.ndarray:
    """``(blocks, 32)`` unsigned codes; ``at``: where the block's code bytes start."""
    if kind == "Q8_0":
        return (blocks[:, at:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
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
    the little-endian bit stream of the uint32 words ``(..., d * bits / 32)``."""
    lead, d = q.shape[:-1], q.shape[-1]
    if bits == 8:
        return np.ascontiguousarray(q).view("<u4")
    if bits == 4:
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)).view("<u4")
    # 5 bits: 8 codes fill 5 bytes
    eight = q.reshape(-1, 8).astype(np.uint64) << (np.arange(8, dtype=np.uint64) * 5)
    five = np.bitwise_or.reduce(eight, axis=1).view(np.uint8).reshape(-1, 8)[:, :5]
    return np.ascontiguousarray(five).reshape(*lead, d * 5 // 8).view("<u4")


def affine(raw: np.ndarray, kind: str, shape: tuple) -> tuple | None:
    """``(weight uint32, scales float32, biases float32, bits)`` of a legacy tensor, MLX affine
    with group 32, from its bytes ``raw`` (uint8) and numpy ``shape``; None when a ``_0`` type's
    minimum ``-d * 2^(bits - 1)`` overflows float16 (a scale past 511 for Q8_0: then the caller
    dequantizes the tensor instead)."""
    bits, size, has_min = _LAYOUT[kind]
    blocks = raw.reshape(-1, size)
    d = _half(blocks, 0)
    if has_min:
        bias = _half(blocks, 2)
    else:
        with np.errstate(over="ignore"):
            bias = (d.astype(np.float32) * -(1 << (bits - 1))).astype(np.float16)  # exact: a power of two
        if not np.isfinite(bias[np.isfinite(d)]).all():
            return None
    q = _codes(blocks, kind, 4 if has_min else 2).reshape(*shape)
    groups = (*shape[:-1], shape[-1] // GROUP_SIZE)
    # float32 (exact): a quantized layer computes in its scales' dtype, and this loader's other
    # tensors are float32 too; with float16 scales Gemma 3's quantized embedding would put its
    # residual stream in float16, which moved its logits by a tenth of their range
    scales, biases = (mx.array(a.reshape(groups).astype(np.float32)) for a in (d, bias))
    return mx.array(_pack(q, bits)), scales, biases, bits
