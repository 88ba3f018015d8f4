"""fp4 microscaling storage of the packed segment (``OIQConfig.storage``): MXFP4 and NVFP4.

Both store each rotated coordinate as an E2M1 value (0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6;
denser near zero than the uniform int grid, which suits the near-Gaussian coordinates the
Hadamard rotation gives) with one 8-bit scale per group: MXFP4 an E8M0 power of two per 32
values, NVFP4 an E4M3 float per 16.  The codes and scales are what ``mx.quantize(..., mode=)``
writes, so ``mx.quantized_matmul`` and ``mx.dequantize`` with the same ``mode`` read them (on
every backend MLX has: no kernel of this package reads them).  No aligned scales.  NVFP4 is used
without MLX's optional per-tensor ``global_scale``: a group whose abs-max exceeds 6 x 448 = 2688
saturates there.

Exponent search (MXFP4, ``clip=True``).  MLX picks a group's E8M0 exponent from its abs-max
(MLX 0.32: the smallest power of two >= abs-max / 6, so nothing saturates but the grid can be
twice as coarse as the bulk of the group wants; the OCP rule rounds down instead and saturates
the largest values).  With ``clip`` each group also tries the exponents one below and one above
MLX's, rounding to the nearest E2M1 level (ties to the even code, as MLX's Metal quantize) with
saturation at +-6, and keeps the candidate whose decoded group (``mx.dequantize``) has the
lowest squared error; MLX's own codes win ties.  Codes and scales stay in MLX's layout.

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

from .codec import pack_codes, pairwise_sum

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


def quantize(y: mx.array, mode: str, *, clip: bool = False):
    """``(codes uint32 (..., d / 8), scales uint8 (..., d / g))`` of ``y`` ``(..., d)``
    (``ndim >= 2``), non-finite groups as the module docstring says.  ``clip`` (MXFP4 only):
    each group's exponent by the search of the module docstring instead of MLX's."""
    check_dim(y.shape[-1], mode)
    if clip and mode != "mxfp4":
        raise ValueError(f"the exponent search (clip) serves mxfp4, not {mode!r}")
    g = FP4_GROUP[mode]
    d = y.shape[-1]
    y = y.astype(mx.float32)
    groups = y.reshape(*y.shape[:-1], d // g, g)
    finite = mx.all(mx.isfinite(groups), axis=-1)
    clean = mx.where(finite[..., None], groups, 0.0).reshape(y.shape)
    codes, scales = mx.quantize(clean, group_size=g, bits=4, mode=mode)[:2]
    if clip:
        codes, scales = _search_exponent(clean, codes, scales)
    nan = mx.array(_NAN_SCALE[mode], mx.uint8)
    return codes, mx.where(finite, scales, nan)


# E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0-7; bit 3 the sign) and the midpoints
# between neighbours; a value on a midpoint goes to the even code (``>=`` where the code below
# is odd), as MLX's Metal ``fp4_e2m1`` rounds
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                   (5.0, False))


def e2m1_codes(x: mx.array) -> mx.array:
    """E2M1 codes (uint32, 0-15) of ``x`` in units of the scale: the nearest level, +-6 for
    anything beyond (saturation); zero without a sign bit, as MLX's CPU quantize writes it."""
    a = mx.abs(x)
    mag = sum(((a >= t) if up else (a > t)).astype(mx.uint32) for t, up in _E2M1_MIDPOINTS)
    return mag | mx.where((x < 0) & (mag > 0), 8, 0).astype(mx.uint32)


def _search_exponent(y: mx.array, codes: mx.array, scales: mx.array):
    """Per 32-group, MLX's ``(codes, scales)`` or the codes at the exponent one below or above,
    whichever decodes with the lowest squared error against ``y`` (finite, float32)."""
    g = FP4_GROUP["mxfp4"]
    lead, d = y.shape[:-1], y.shape[-1]
    s = scales.astype(mx.int32)
    cand_s, cand_c = [scales], [codes]
    for step in (-1, 1):
        e = mx.clip(s + step, 0, 254)  # out-of-range candidates are refused below
        # the decoded E8M0 scale 2^(e - 127), 2^-127 for byte 0 as MLX decodes it: y times its inverse
        inv = mx.power(mx.array(2.0, mx.float32), (127 - e).astype(mx.float32))
        x = y.reshape(*lead, d // g, g) * inv[..., None]
        cand_c.append(pack_codes(e2m1_codes(x).reshape(*lead, d), 4))
        cand_s.append(e.astype(mx.uint8))
    cs, ss = mx.stack(cand_c), mx.stack(cand_s)  # (3, ..., d / 8), (3, ..., d / g)
    out = mx.dequantize(cs, ss, group_size=g, bits=4, mode="mxfp4", dtype=mx.float32)
    err = pairwise_sum(mx.square(out - y).reshape(3, *lead, d // g, g))
    valid = mx.stack([s >= 0, s >= 1, s <= 253])  # the NaN byte 0xFF is no candidate
    err = mx.where(valid & ~mx.isnan(err), err, mx.inf)
    best = mx.argmin(err, axis=0, keepdims=True)  # the first minimum: MLX's own on a tie
    scales = mx.take_along_axis(ss, best, axis=0)[0]
    words = cs.reshape(3, *lead, d // g, g // 8)
    codes = mx.take_along_axis(words, best[..., None], axis=0)[0].reshape(*lead, d // 8)
    return codes, scales


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


def quantize_pair(y: mx.array, mode: str, *, clip: bool = False) -> mx.array:
    """Joined rows ``(..., n, pair_width)`` of rotated keys and values stacked on the first
    axis, ``y`` ``(2, ..., n, d)`` (``clip``: :func:`quantize`)."""
    codes, scales = quantize(y, mode, clip=clip)
    return join_pair(codes[0], scales[0], codes[1], scales[1])
