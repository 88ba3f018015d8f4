"""fp4 microscaling storage of the packed segment (``OIQConfig.storage``): MXFP4 and NVFP4.

Both store each rotated coordinate as an E2M1 value (0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6;
denser near zero than the uniform int grid, which suits the near-Gaussian coordinates the
Hadamard rotation gives) with one 8-bit scale per group: MXFP4 an E8M0 power of two per 32
values, NVFP4 an E4M3 float per 16.  The codes and scales are what ``mx.quantize(..., mode=)``
writes, so ``mx.quantized_matmul`` and ``mx.dequantize`` with the same ``mode`` read them (on
every backend MLX has: no kernel of this package reads them).  The scale choice is MLX's: no
clip search, no aligned scales.  NVFP4 is used without MLX's optional per-tensor
``global_scale``: a group whose abs-max exceeds 6 x 448 = 2688 saturates there.

Storage.  Keys and values of one token share one joined row of uint32 words (both sides use
the same mode and dimension): the keys' code words, the values' code words, then the keys'
scale bytes followed by the values', padded with zero bytes to a whole word
(:func:`join_pair`).  At ``d`` = 64 MXFP4 costs 8 + 8 + 1 words = 68 bytes per token and KV
head, K+V (one row per side would pad each side's two scale bytes to a word: 72); NVFP4 costs
8 + 8 + 2 words = 72.

Non-finite input: a group holding NaN or Inf is stored with codes 0 and the mode's NaN scale
(E8M0 0xFF, E4M3 0x7F), so it decodes to NaN, as the int codec's groups do; ``mx.quantize``
itself would store such a group as zeros.
"""

from __future__ import annotations

import mlx.core as mx

# storage -> the group size its scales cover (fixed by the format)
FP4_GROUP = {"mxfp4": 32, "nvfp4": 16}
# the scale byte that decodes to NaN in each format
_NAN_SCALE = {"mxfp4": 0xFF, "nvfp4": 0x7F}
STORAGES = ("int", *FP4_GROUP)


def check_mode(mode) -> str:
    if mode not in FP4_GROUP:
        raise ValueError(f"fp4 storage {mode!r} is not one of {tuple(FP4_GROUP)}")
    return mode


def check_dim(dim: int, mode: str) -> int:
    """``dim`` if a ``mode`` row of that many coordinates is whole groups, else ValueError."""
    g = FP4_GROUP[check_mode(mode)]
    if dim % g:
        raise ValueError(f"storage={mode!r}: dimension {dim} is not a multiple of its group size {g}")
    return dim


def code_words(dim: int) -> int:
    """uint32 words of one side's E2M1 codes (8 per word)."""
    return dim // 8


def scale_bytes(dim: int, mode: str) -> int:
    """Scale bytes of one side's row."""
    return dim // FP4_GROUP[mode]


def pair_width(dim: int, mode: str) -> int:
    """uint32 words of one joined key + value row (:func:`join_pair`)."""
    check_dim(dim, mode)
    return 2 * code_words(dim) + -(-2 * scale_bytes(dim, mode) // 4)


def pair_bytes_per_token(dim: int, mode: str) -> int:
    """Bytes one token costs per KV head, keys and values together: 68 at d = 64 in MXFP4."""
    return 4 * pair_width(dim, mode)


def quantize(y: mx.array, mode: str):
    """``(codes uint32 (..., d / 8), scales uint8 (..., d / g))`` of ``y`` ``(..., d)``
    (``ndim >= 2``), non-finite groups as the module docstring says."""
    check_dim(y.shape[-1], mode)
    g = FP4_GROUP[mode]
    d = y.shape[-1]
    y = y.astype(mx.float32)
    groups = y.reshape(*y.shape[:-1], d // g, g)
    finite = mx.all(mx.isfinite(groups), axis=-1)
    clean = mx.where(finite[..., None], groups, 0.0).reshape(y.shape)
    codes, scales = mx.quantize(clean, group_size=g, bits=4, mode=mode)[:2]
    nan = mx.array(_NAN_SCALE[mode], mx.uint8)
    return codes, mx.where(finite, scales, nan)


def dequantize(codes: mx.array, scales: mx.array, mode: str, dtype=mx.float32) -> mx.array:
    """Values ``(..., d)`` in ``dtype`` of :func:`quantize` output (``mx.dequantize``)."""
    return mx.dequantize(codes, scales, group_size=FP4_GROUP[mode], bits=4, mode=mode, dtype=dtype)


def join_pair(k_codes, k_scales, v_codes, v_scales) -> mx.array:
    """One joined row per token (module docstring): ``(..., pair_width)`` uint32."""
    scales = mx.concatenate([k_scales, v_scales], axis=-1)
    pad = -scales.shape[-1] % 4
    if pad:
        scales = mx.pad(scales, [(0, 0)] * (scales.ndim - 1) + [(0, pad)])
    # a concatenation (or pad) is a new row-contiguous array: its bytes view as words in place
    return mx.concatenate([k_codes, v_codes, scales.view(mx.uint32)], axis=-1)


def split_pair(rows: mx.array, dim: int, mode: str, which: int):
    """``(codes, scales)`` of keys (``which`` 0) or values (1) in joined rows, as views: the scale
    bytes are a dtype view of the rows' contiguous last axis (no copy, as ``codec.split_rows``)."""
    w, n = code_words(dim), scale_bytes(dim, mode)
    codes = rows[..., which * w : (which + 1) * w]
    scales = rows[..., 2 * w :].view(mx.uint8)[..., which * n : (which + 1) * n]
    return codes, scales


def quantize_pair(y: mx.array, mode: str) -> mx.array:
    """Joined rows ``(..., n, pair_width)`` of rotated keys and values stacked on the first
    axis, ``y`` ``(2, ..., n, d)``."""
    codes, scales = quantize(y, mode)
    return join_pair(codes[0], scales[0], codes[1], scales[1])
