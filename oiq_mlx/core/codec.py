"""Reference OIQ codec: per-group quantization of rotated vectors, bit packing.

This module is the specification the Metal kernels are tested against: plain
MLX ops, float32 math.

Level scheme (mid-rise, symmetric)
----------------------------------
A group of ``g`` values with scale ``s`` stores codes ``c`` in
``[0, 2**bits - 1]`` and decodes to ``s * (c - (2**bits - 1) / 2)``: all
``2**bits`` codes are used, levels sit at odd multiples of ``s / 2``.  With the
abs-max rule ``s = 2 * max|y| / (2**bits - 1)`` the outermost levels hit
``+-max|y|`` and every value is within ``s / 2`` of its level.  The mid-tread
alternative (zero as a level) wastes one code, which at 2 bits leaves three
levels and breaks the model (DESIGN.md section 9).

``clip=True`` picks, per group, the scale among ``CLIP_RATIOS * absmax`` that
minimises the group's squared error (values beyond the outer level saturate).
Rotated coordinates are near-Gaussian, for which abs-max is far from the MSE
optimum at 2-3 bits.

``align=True`` keeps the codes (abs-max or clipped) and stores instead the
scale ``s = sum(y * y) / sum(y * u)``, ``u = c - (2**bits - 1) / 2``, so that
the decoded group ``s * u`` has the projection on ``y`` that ``y`` has:
``<s u, y> = |y|^2``, the error orthogonal to ``y``.  The MSE-chosen scale
shrinks a group (by 3% at 3 bits and 11% at 2 bits on Gaussian groups of 32),
which lowers the score of every key in the direction of a query that matches
it, and most the score of the key that matches best; the aligned scale does not
shrink, at about the clipped search's squared error (DESIGN.md section 9).
``align=0.5`` stores the mean of the two scales, ``(s_chosen + s) / 2``: half the
shrinkage, less of the aligned scale's larger error off ``y`` (``ALIGNMENTS``).

Storage is the layout of ``mx.quantize``: codes of one vector form one
little-endian, LSB-first bit stream packed into uint32 words (value ``i`` in
bits ``[i*bits, (i+1)*bits)``; 3-, 5- and 6-bit values straddle words), one
float16 scale per group.  ``mx.dequantize(codes, scales, -scales *
(2**bits - 1) / 2, group_size, bits)`` therefore decodes our codes too.

Non-finite input
----------------
A group that contains NaN or +-Inf is stored with all codes 0 and scale NaN,
so it decodes to NaN: the damage is visible and confined to that group (after
rotation, to that token and head); codes of every other group and token are
unaffected.  Scales are stored in float16: a group whose scale exceeds the
float16 range (|y| above ~3e5 at 2 bits) saturates to the largest float16
scale rather than becoming Inf.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
FP16_MAX = 65504.0


def check_bits(bits, what: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"{what}={bits!r} is not supported; choose one of {SUPPORTED_BITS}")
    return int(bits)


def check_group_size(group_size, dim: int | None = None) -> int:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, (int, np.integer))
        or int(group_size) not in SUPPORTED_GROUP_SIZES
    ):
        raise ValueError(f"group_size={group_size!r} is not supported; choose one of {SUPPORTED_GROUP_SIZES}")
    if dim is not None and dim % group_size != 0:
        raise ValueError(f"head dimension {dim} is not divisible by group_size={group_size}")
    return int(group_size)


def packed_width(dim: int, bits: int) -> int:
    """Number of uint32 words holding one ``dim``-vector at ``bits`` bits."""
    if (dim * bits) % 32:
        raise ValueError(f"dimension {dim} at {bits} bits does not fill whole 32-bit words")
    return dim * bits // 32


def scale_words(dim: int, group_size: int) -> int:
    """uint32 words holding the float16 group scales of one ``dim``-vector in a packed row
    (two per word; an odd count leaves one half-word of padding)."""
    return -(-(dim // group_size) // 2)


def row_width(dim: int, bits: int, group_size: int) -> int:
    """uint32 words of one packed row: :func:`packed_width` code words, then
    :func:`scale_words` words of scales (:func:`join_rows`)."""
    return packed_width(dim, bits) + scale_words(dim, group_size)


def bytes_per_token(head_dim: int = 128, bits: int = 4, group_size: int = 32) -> int:
    """Bytes one token costs per KV head for keys *or* values, as the cache stores it:
    packed codes plus one float16 scale per group, in whole words (a packed row,
    :func:`row_width`).  128/4/32 -> 72 (fp16 would be 256)."""
    bits = check_bits(bits)
    group_size = check_group_size(group_size, head_dim)
    return 4 * row_width(head_dim, bits, group_size)


def join_rows(codes: mx.array, scales: mx.array) -> mx.array:
    """Packed rows: ``codes`` ``(..., W)`` uint32 followed by the bits of ``scales``
    ``(..., G)`` float16, two per word, the first in the low half; an odd ``G`` is
    padded with a zero half.  ``(..., W + ceil(G / 2))`` uint32."""
    if scales.shape[-1] % 2:
        scales = mx.pad(scales, [(0, 0)] * (scales.ndim - 1) + [(0, 1)])
    return mx.concatenate([codes, mx.contiguous(scales).view(mx.uint32)], axis=-1)


def split_rows(rows: mx.array, dim: int, bits: int, group_size: int):
    """``(codes, scales)`` of packed rows (:func:`join_rows`), as views of ``rows``: the
    scales view narrows the dtype over a contiguous last axis, which MLX serves
    without a copy."""
    w = packed_width(dim, bits)
    return rows[..., :w], rows[..., w:].view(mx.float16)[..., : dim // group_size]


@functools.lru_cache(maxsize=None)
def _pack_plan(bits: int):
    """Shift tables (built once per bits) packing 32 codes into ``bits`` words (one chunk).

    Word ``j`` of a chunk is ``sum_i ((c[i] << lsh[j,i]) >> rsh[j,i]) * use[j,i]``:
    value ``i`` either starts in word ``j`` (left shift; bits past 32 fall off
    and go to the next word) or straddles into it from word ``j-1`` (right
    shift by the bits already written).  Elementwise plus one sum: no gather.
    """
    lsh = np.zeros((bits, 32), np.uint32)
    rsh = np.zeros((bits, 32), np.uint32)
    use = np.zeros((bits, 32), np.uint32)
    for i in range(32):
        w, sh = divmod(i * bits, 32)
        lsh[w, i], use[w, i] = sh, 1
        if sh + bits > 32:
            rsh[w + 1, i], use[w + 1, i] = 32 - sh, 1
    return tuple(mx.array(a) for a in (lsh, rsh, use))


@functools.lru_cache(maxsize=None)
def _unpack_plan(bits: int):
    """For each of 32 values of a chunk: word, shift, and the straddle part."""
    w = np.zeros(32, np.int32)
    sh = np.zeros(32, np.uint32)
    w2 = np.zeros(32, np.int32)
    sh2 = np.zeros(32, np.uint32)
    hi = np.zeros(32, np.uint32)
    for i in range(32):
        w[i], sh[i] = divmod(i * bits, 32)
        if sh[i] + bits > 32:
            w2[i], sh2[i], hi[i] = w[i] + 1, 32 - sh[i], 1
        else:
            w2[i] = w[i]
    return tuple(mx.array(a) for a in (w, sh, w2, sh2, hi))


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes ``(..., d)`` (values < 2**bits) into uint32 ``(..., d*bits/32)``."""
    bits = check_bits(bits)
    d = codes.shape[-1]
    if d % 32:
        raise ValueError(f"can only pack vectors whose length is a multiple of 32, got {d}")
    lsh, rsh, use = _pack_plan(bits)
    c = codes.astype(mx.uint32).reshape(*codes.shape[:-1], d // 32, 1, 32)
    words = mx.sum(((c << lsh) >> rsh) * use, axis=-1).astype(mx.uint32)
    return words.reshape(*codes.shape[:-1], d * bits // 32)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """Inverse of :func:`pack_codes`: uint32 ``(..., d*bits/32)`` -> uint32 codes ``(..., d)``."""
    bits = check_bits(bits)
    if packed.dtype != mx.uint32:
        raise ValueError(f"packed codes must be uint32, got {packed.dtype}")
    nw = packed.shape[-1]
    if nw % bits:
        raise ValueError(f"{nw} words is not a whole number of {bits}-bit chunks of 32 values")
    w, sh, w2, sh2, hi = _unpack_plan(bits)
    p = packed.reshape(*packed.shape[:-1], nw // bits, bits)
    lo = mx.take(p, w, axis=-1) >> sh
    up = (mx.take(p, w2, axis=-1) << sh2) * hi
    codes = (lo | up) & mx.array((1 << bits) - 1, mx.uint32)
    return codes.reshape(*packed.shape[:-1], nw // bits * 32)


def check_floating(y) -> mx.array:
    """``y`` if it is a floating-point mx.array with at least one axis, else ValueError."""
    if not isinstance(y, mx.array):
        raise ValueError(f"expected an mx.array, got {type(y).__name__}")
    if not mx.issubdtype(y.dtype, mx.floating):
        raise ValueError(f"expected float16, bfloat16 or float32 input, got {y.dtype}")
    if y.ndim < 1:
        raise ValueError("expected an array with at least one dimension")
    return y


def _levels_half(bits: int) -> float:
    return ((1 << bits) - 1) / 2.0


def _codes_for_scale(yg: mx.array, scale: mx.array, bits: int) -> mx.array:
    """Codes (float32, integral) of grouped values ``yg`` for a given scale."""
    half = _levels_half(bits)
    safe = mx.where(scale > 0, scale, 1.0)
    c = mx.clip(mx.round(yg / safe + half), 0, 2 * half)
    return mx.where(scale > 0, c, 0.0)


# How far a group's stored scale goes from the one its codes were chosen with to the aligned
# scale (``quantize(align=)``): none, half way (the mean of the two), all the way.
ALIGNMENTS = (0.0, 0.5, 1.0)


def check_alignment(align) -> float:
    """``align`` as one of :data:`ALIGNMENTS` (False / True are 0 and 1), else ValueError."""
    if align in ALIGNMENTS:
        return float(align)
    raise ValueError(f"align must be one of {ALIGNMENTS} (or False / True), got {align!r}")


def alignment_pair(align, lead: tuple) -> tuple[float, float]:
    """``align`` of rows with leading shape ``lead`` as ``(first half, second half)``: one
    alignment for every row, or a ``(keys, values)`` pair of two that differ for keys and values
    stacked on a first axis of 2 (the cache's stacked packing pass)."""
    pair = tuple(align) if isinstance(align, (tuple, list)) else (align, align)
    if len(pair) != 2:
        raise ValueError(f"align {align!r}: one alignment, or one for keys and one for values")
    first, second = (check_alignment(a) for a in pair)
    if first != second and (not lead or lead[0] != 2):
        raise ValueError(f"align {align!r}: a pair needs keys and values stacked on the first axis, got rows {lead}")
    return first, second


def quantize(y: mx.array, bits: int = 4, group_size: int = 32, *, clip: bool = False, align: float = False):
    """Quantize (rotated) vectors per group with a symmetric mid-rise grid.

    Args:
        y: ``(..., d)`` float16/bfloat16/float32, ``d`` divisible by
            ``group_size`` and ``d * bits`` by 32.
        bits: one of 1, 2, 3, 4, 5, 6, 8.
        group_size: one of 32, 64, 128.
        clip: choose each group's scale by MSE search over ``CLIP_RATIOS``
            instead of plain abs-max.
        align: with the codes so chosen, store the scale that keeps each
            group's projection on itself (True or 1), or the mean of that scale
            and the chosen one (0.5) (module docstring).

    Returns:
        ``(codes, scales)``: uint32 ``(..., d * bits / 32)`` and float16
        ``(..., d / group_size)``.
    """
    y = check_floating(y)
    bits = check_bits(bits)
    align = check_alignment(align)
    d = y.shape[-1]
    group_size = check_group_size(group_size, d)
    packed_width(d, bits)
    half = _levels_half(bits)
    yg = y.astype(mx.float32).reshape(*y.shape[:-1], d // group_size, group_size)
    finite = mx.all(mx.isfinite(yg), axis=-1, keepdims=True)
    yg = mx.where(finite, yg, 0.0)
    amax = mx.max(mx.abs(yg), axis=-1, keepdims=True)
    if clip:
        ratios = mx.array(CLIP_RATIOS, mx.float32)
        cand = _round_scale(amax * ratios / half)  # (..., ng, C)
        cg = _codes_for_scale(yg[..., None, :], cand[..., None], bits)
        # err overflows only for |y| ~ 1e18 and up, where every candidate is the
        # saturated float16 scale: whichever argmin picks, the scale is the same
        err = pairwise_sum(mx.square((cg - half) * cand[..., None] - yg[..., None, :]))
        best = mx.argmin(err, axis=-1, keepdims=True)
        scale = mx.take_along_axis(cand, best, axis=-1)
    else:
        scale = _round_scale(amax / half)
    codes = _codes_for_scale(yg, scale, bits)
    if align:
        # summed in the kernel's order (codec.pairwise_sum); a zero group keeps its scale (0),
        # and so does one whose sums overflow float32 (|y| ~ 1e19 and up)
        yy = pairwise_sum(yg * yg)[..., None]
        yu = pairwise_sum(yg * (codes - half))[..., None]
        ratio = yy / mx.where(yu > 0, yu, 1.0)
        target = ratio if align == 1.0 else 0.5 * (scale + ratio)  # the kernel's order of operations
        scale = mx.where((yu > 0) & mx.isfinite(ratio), _round_scale(target), scale)
    scale = mx.where(finite, scale, mx.nan)
    codes = codes.reshape(*y.shape[:-1], d).astype(mx.uint32)
    return pack_codes(codes, bits), scale.squeeze(-1).astype(mx.float16)


def pairwise_sum(e: mx.array) -> mx.array:
    """Sum over the last axis (a power of two long) as a tree of pairwise adds,
    neighbours first: ``((e0 + e1) + (e2 + e3)) + ...``.

    The clip search compares errors across candidates, so every implementation
    (this one, ``mx.compile``'d or not, the Metal kernel's lane-then-simdgroup
    butterflies) must add in the same order to choose the same scale: an
    ``mx.sum`` leaves the order to the backend.
    """
    while e.shape[-1] > 1:
        e = e.reshape(*e.shape[:-1], e.shape[-1] // 2, 2)
        e = e[..., 0] + e[..., 1]
    return e[..., 0]


def _round_scale(s: mx.array) -> mx.array:
    """Scales as they will be stored (float16, saturated), back in float32."""
    return mx.minimum(s, FP16_MAX).astype(mx.float16).astype(mx.float32)


def dequantize(codes: mx.array, scales: mx.array, bits: int = 4, group_size: int = 32, *, dtype=mx.float32):
    """Decode :func:`quantize` output back to values ``(..., d)`` in ``dtype``.

    Equals ``mx.dequantize(codes, scales, -scales * (2**bits - 1) / 2,
    group_size=group_size, bits=bits)`` up to float rounding.
    """
    bits = check_bits(bits)
    if codes.dtype != mx.uint32:
        raise ValueError(f"codes must be uint32, got {codes.dtype}")
    d = codes.shape[-1] * 32 // bits
    group_size = check_group_size(group_size, d)
    if scales.shape[-1] != d // group_size or scales.shape[:-1] != codes.shape[:-1]:
        raise ValueError(
            f"scales shape {scales.shape} does not match codes shape {codes.shape} "
            f"(expected (..., {d // group_size}) for d={d}, group_size={group_size})"
        )
    c = unpack_codes(codes, bits).astype(mx.float32) - _levels_half(bits)
    c = c.reshape(*codes.shape[:-1], d // group_size, group_size)
    out = c * scales.astype(mx.float32)[..., None]
    return out.reshape(*codes.shape[:-1], d).astype(dtype)


def affine_biases(scales: mx.array, bits: int) -> mx.array:
    """Biases that make ``mx.dequantize`` / ``mx.quantized_matmul`` decode OIQ codes."""
    return -scales * _levels_half(bits)


# bits whose codes MLX's CPU quantized_matmul(transpose=False) reads several times more slowly
# than the power-of-two widths it specializes, and the width their codes are repacked to for it
# (:func:`repack_codes`).  At 32 query / 8 KV heads, d = 128, 2k rows: 3 and 5 bits ~12 ms, 2
# and 6 bits ~5 ms, 4 bits 2.2 ms, 8 bits 1.5 ms; 2- or 3-bit values repacked to 8 bits and
# multiplied take 2.0 ms, to 4 bits 2.6 (SmolLM2's 3 KV heads, d = 64, 8k rows: 1.3 against 1.7-1.9,
# mlx-lm's 4-bit values 1.26); 1-bit codes as 2-bit ones
CPU_REPACK_BITS = {1: 8, 2: 8, 3: 8, 5: 8, 6: 8}


@functools.lru_cache(maxsize=None)
def _repack_chunks(bits: int, to_bits: int):
    """A compiled function from the ``bits`` words of each 32-code chunk (one array each, all of
    one shape) to the ``to_bits`` words that hold the same codes at ``to_bits`` each, stacked on
    the last axis.

    Output word ``j`` holds codes ``[j * per, (j + 1) * per)`` (``per = 32 / to_bits``), one run
    of ``per * bits`` bits of the chunk's stream: it is cut out with two shifts, then its fields
    are spread apart in ``log2(per)`` steps that each move the upper half of every group of
    fields up at once (field ``i`` ends ``i * (to_bits - bits)`` higher).  Straight-line shifts
    and masks on same-shape contiguous inputs, fused by ``mx.compile`` (fixed shapes: MLX's CPU
    backend fuses those, not shapeless graphs)."""
    per, gap, run = 32 // to_bits, to_bits - bits, (32 // to_bits) * bits
    field = (1 << bits) - 1
    steps = []  # (low mask, high mask, shift) of each spreading step
    pos = [i * bits for i in range(per)]
    g = per
    while g > 1:
        h = g // 2
        move = [i % g >= h for i in range(per)]
        lo = sum(field << p for p, m in zip(pos, move) if not m)
        hi = sum(field << p for p, m in zip(pos, move) if m)
        steps.append((lo, hi, h * gap))
        pos = [p + h * gap if m else p for p, m in zip(pos, move)]
        g = h

    def repack(*words):
        out = []
        for j in range(to_bits):
            k, sh = divmod(j * run, 32)
            x = words[k] >> sh if sh else words[k]
            if sh + run > 32:
                x = x | (words[k + 1] << (32 - sh))
            x = x & ((1 << run) - 1)
            for lo, hi, shift in steps:
                x = (x & lo) | ((x & hi) << shift)
            out.append(x)
        return mx.stack(out, axis=-1)

    return mx.compile(repack)


def _rows_bucket(n: int) -> int:
    """``n`` rounded up to a multiple of 64, or of 1/16 of its power of two past 1024 rows: a few
    shapes per octave, so a compiled :func:`repack_codes` is traced once per bucket, not per row."""
    q = max(64, (1 << max(0, n.bit_length() - 1)) // 16)
    return -(-n // q) * q


def repack_codes(codes: mx.array, bits: int, to_bits: int) -> mx.array:
    """Packed codes ``(..., n, W)`` (``bits`` each, :func:`pack_codes`) repacked at ``to_bits``
    each, ``(..., n, W * to_bits / bits)``: the same code values, so the same scales and
    ``bits``' biases (:func:`affine_biases`) decode them with ``bits=to_bits``.  ``to_bits`` is 4
    or 8 and at least ``bits``."""
    bits, to_bits = check_bits(bits), check_bits(to_bits, "to_bits")
    if bits == to_bits:
        return codes
    if to_bits not in (4, 8) or to_bits < bits:
        raise ValueError(f"can repack {bits}-bit codes to 4 or 8 bits at least as wide, not {to_bits}")
    *lead, n, nw = codes.shape
    if nw % bits:
        raise ValueError(f"{nw} words is not a whole number of {bits}-bit chunks of 32 values")
    nb = _rows_bucket(n)
    # the chunks' words on a first axis, rows padded to the bucket: one copy (the pad of a
    # transposed view writes it contiguous), then a view of each word
    x = mx.moveaxis(codes.reshape(*lead, n, nw // bits, bits), -1, 0)
    x = mx.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, nb - n), (0, 0)]) if nb > n else mx.contiguous(x)
    out = _repack_chunks(bits, to_bits)(*(x[k : k + 1] for k in range(bits)))
    out = out.reshape(*lead, nb, nw // bits * to_bits)
    return out[..., :n, :] if nb > n else out


def dequantize_repacked(codes: mx.array, scales: mx.array, bits: int, group_size: int) -> mx.array:
    """:func:`dequantize` of packed rows ``(..., n, W)`` as float32, bit for bit, by repacking the
    codes to one byte each (:func:`repack_codes`) and decoding the bytes: a few passes over the
    rows where :func:`dequantize` gathers every code.  ``scales``:
    ``(..., n, groups)``, float16 or float32.  For the CPU backend, where this and a matmul
    score packed keys several times faster than ``mx.quantized_matmul`` (``transpose=True``
    costs as much per query row as a whole dequantization)."""
    *lead, n, nw = codes.shape
    d = nw * 32 // bits
    c = repack_codes(codes, bits, 8)
    c = c.view(mx.uint8).reshape(*lead, n, d // group_size, group_size)
    # plain ops: MLX's CPU backend runs these three faster than one compiled kernel of them (at 4096
    # rows x 3 heads x 64: 0.47 ms against 0.65 for fixed shapes, 0.74 shapeless)
    out = (c.astype(mx.float32) - _levels_half(bits)) * mx.expand_dims(scales.astype(mx.float32), -1)
    return out.reshape(*lead, n, d)
