"""The key scaling, sign flip, Walsh-Hadamard rotation, group abs-max (or MSE clip search), rounding and
bit packing of KV vectors, in one kernel."""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ..core import codec
from . import launcher
from .source import build_kernel

ROWS_PER_THREADGROUP = 4


def _kernel():
    # read through strides: x as the cache passes it (a slice of its stacked window buffer along
    # the token axis, whose reshape to rows would be a copy), the tables as reshaped below
    return build_kernel("oiq_quantize", "quantize.metal", ("x", "lam", "signs", "rot_scale", "clip_ratios", "params"),
                        ("codes", "scales"), row_contiguous=False)


@functools.lru_cache(maxsize=None)
def _constant(values: tuple, shape: tuple | None = None) -> mx.array:
    """A small float32 input (placeholder, clip ratios): built once, not per call."""
    a = mx.array(values, mx.float32)
    if shape is not None:
        a = a.reshape(shape)
    mx.eval(a)
    return a


def _align_params(align, lead: tuple) -> list:
    """The kernel's three align parameters: the mode of the rows before the split row, of the
    rows from it, and the split row (mode 0, 1, 2 for ``codec.quantize(align=0, 0.5, 1)``).
    ``align``: one alignment for every row, or a pair for keys and values stacked on the first
    axis of the rows ``lead``."""
    n = math.prod(lead)
    first, second = (int(2 * a) for a in codec.alignment_pair(align, lead))
    return [first, second, n // 2 if first != second else n]


def _launch_quantize(x: mx.array, lam2, signs2, *, bits: int, group_size: int, rotate: bool, clip: bool,
                     round_to_input: bool, joined: bool, align=False):
    """The kernel over the rows of ``x`` ``(..., d)`` as it is (any strides: no copy, no reshape);
    ``lam2``, ``signs2``: ``(groups, d)`` tables (``_rows_of``); ``align``: ``_align_params``.
    Returns ``(codes, scales)`` shaped like ``x``'s rows, or the joined rows."""
    d = x.shape[-1]
    lead = tuple(x.shape[:-1])
    n = math.prod(lead)
    w, g = d * bits // 32, d // group_size
    if joined:
        shapes, dtypes = [(*lead, codec.row_width(d, bits, group_size)), (1,)], [mx.uint32, mx.float16]
    else:
        shapes, dtypes = [(*lead, w), (*lead, g)], [mx.uint32, mx.float16]
    rows_per_lam = 0 if lam2 is None else n // lam2.shape[0]
    out = launcher.launch(
        _kernel(),
        inputs=[x, _constant((1.0,), (1, 1)) if lam2 is None else lam2, signs2, 1.0 / math.sqrt(d),
                _constant(codec.CLIP_RATIOS),
                mx.array([bits, group_size, int(rotate), int(clip), rows_per_lam, n // signs2.shape[0],
                          int(round_to_input), int(joined), *_align_params(align, lead)], mx.int32)],
        template=[("T", x.dtype), ("D", d), ("ROWS", ROWS_PER_THREADGROUP)],
        grid=(32, n, 1),
        threadgroup=(32, min(ROWS_PER_THREADGROUP, n), 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    return out[0] if joined else (out[0], out[1])


def _empty(lead: tuple, d: int, bits: int, group_size: int, joined: bool):
    if joined:
        return mx.zeros((*lead, codec.row_width(d, bits, group_size)), mx.uint32)
    return mx.zeros((*lead, d * bits // 32), mx.uint32), mx.zeros((*lead, d // group_size), mx.float16)


def _rows_of(a: mx.array, lead: tuple, what: str) -> mx.array:
    """``a`` (broadcastable to ``(*lead, d)`` along whole trailing blocks of rows) as a
    ``(groups, d)`` table: row r of the flattened input uses table row ``r // (N / groups)``.
    (A view when ``a`` is contiguous, as the cache's tables are; the kernel reads it through
    its strides either way.)"""
    shape = (1,) * (len(lead) + 1 - a.ndim) + tuple(a.shape)
    k = len(lead)
    while k > 0 and shape[k - 1] == 1:
        k -= 1
    if tuple(shape[:k]) != tuple(lead[:k]) or any(s != 1 for s in shape[k:-1]):
        raise ValueError(f"{what} of shape {a.shape} does not cover whole blocks of rows of {lead}")
    return a.astype(mx.float32).reshape(-1, shape[-1])


def quantize_rows(x: mx.array, *, bits: int, group_size: int, lam: mx.array | None, signs: mx.array,
                  rotate: bool, clip: bool, joined: bool = False, align=False):
    """Codes and scales of cache rows entering the packed segment, in one pass; equals
    ``dispatch.quantize_rows`` (``codec.quantize(hadamard(x / lam * signs), clip=clip,
    align=align)``), packed codes and scales bit-exact.  ``align``: one alignment
    (``codec.ALIGNMENTS``), or a ``(keys, values)`` pair when ``x`` stacks the two sides on
    its first axis.

    Args:
        x: ``(..., n, d)`` rows in the cache dtype, any strides (a slice of a larger buffer is
            read in place, not copied).
        lam: key scales broadcastable to ``x`` with size 1 on the row axis (and on any axis
            after a size-1 one), float32, or None.
        signs: rotation signs broadcastable the same way (``(d,)``, or one per leading block).
        joined: return one uint32 array ``(..., n, W + S)`` equal to
            ``codec.join_rows(codes, scales)`` (the cache's packed rows) instead of the pair.
    """
    d = x.shape[-1]
    lead = x.shape[:-1]
    if math.prod(lead) == 0:
        return _empty(lead, d, bits, group_size, joined)
    return _launch_quantize(x, None if lam is None else _rows_of(lam, lead, "lam"), _rows_of(signs, lead, "signs"),
                            bits=bits, group_size=group_size, rotate=rotate, clip=clip, round_to_input=False,
                            joined=joined, align=align)


def quantize(x: mx.array, *, bits: int, group_size: int, signs: mx.array | None = None):
    """Quantize head vectors; equals ``codec.quantize(rotation.rotate(x, signs), bits, group_size)``
    (``codec.quantize(x, ...)`` when ``signs`` is None), packed codes and scales bit-exact.

    Args:
        x: ``(..., d)`` float16/bfloat16/float32, d in ``SUPPORTED_DIMS``.
        bits: 1, 2, 3, 4, 5, 6 or 8.  group_size: 32, 64 or 128 (dividing d).
        signs: ``(d,)`` +-1 rotation signs, or None for already rotated input.

    Returns:
        ``(codes, scales)``: uint32 ``(..., d * bits / 32)``, float16 ``(..., d / group_size)``.
    """
    d = x.shape[-1]
    lead = x.shape[:-1]
    rotate = signs is not None
    if signs is None:
        signs = mx.ones((d,), mx.float32)
    if math.prod(lead) == 0:
        return _empty(lead, d, bits, group_size, False)
    return _launch_quantize(x, None, signs.astype(mx.float32).reshape(1, d), bits=bits, group_size=group_size,
                            rotate=rotate, clip=False, round_to_input=True, joined=False)
