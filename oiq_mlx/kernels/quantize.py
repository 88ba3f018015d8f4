"""The key scaling, sign flip, Walsh-Hadamard rotation, group abs-max (or MSE clip search), rounding and
bit packing of KV vectors, in one kernel."""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from .. import codec
from . import _launch
from ._source import build_kernel

ROWS_PER_THREADGROUP = 4


def _kernel():
    return build_kernel("oiq_quantize", "quantize.metal", ("x", "lam", "signs", "rot_scale", "clip_ratios", "params"),
                        ("codes", "scales"))


@functools.lru_cache(maxsize=None)
def _constant(values: tuple) -> mx.array:
    """A small float32 input (placeholder, clip ratios): built once, not per call."""
    a = mx.array(values, mx.float32)
    mx.eval(a)
    return a


def _launch_quantize(x2: mx.array, lam2, signs2, *, bits: int, group_size: int, rotate: bool, clip: bool,
                     round_to_input: bool):
    n, d = x2.shape
    rows_per_lam = 0 if lam2 is None else n // lam2.shape[0]
    return _launch.launch(
        _kernel(),
        inputs=[x2, _constant((1.0,)) if lam2 is None else lam2, signs2, 1.0 / math.sqrt(d),
                _constant(codec.CLIP_RATIOS),
                mx.array([bits, group_size, int(rotate), int(clip), rows_per_lam, n // signs2.shape[0],
                          int(round_to_input)], mx.int32)],
        template=[("T", x2.dtype), ("D", d), ("ROWS", ROWS_PER_THREADGROUP)],
        grid=(32, n, 1),
        threadgroup=(32, min(ROWS_PER_THREADGROUP, n), 1),
        output_shapes=[(n, d * bits // 32), (n, d // group_size)],
        output_dtypes=[mx.uint32, mx.float16],
    )


def _rows_of(a: mx.array, lead: tuple, what: str) -> mx.array:
    """``a`` (broadcastable to ``(*lead, d)`` along whole trailing blocks of rows) as a
    ``(groups, d)`` table: row r of the flattened input uses table row ``r // (N / groups)``."""
    shape = (1,) * (len(lead) + 1 - a.ndim) + tuple(a.shape)
    k = len(lead)
    while k > 0 and shape[k - 1] == 1:
        k -= 1
    if tuple(shape[:k]) != tuple(lead[:k]) or any(s != 1 for s in shape[k:-1]):
        raise ValueError(f"{what} of shape {a.shape} does not cover whole blocks of rows of {lead}")
    return a.astype(mx.float32).reshape(-1, shape[-1])


def quantize_rows(x: mx.array, *, bits: int, group_size: int, lam: mx.array | None, signs: mx.array,
                  rotate: bool, clip: bool):
    """Codes and scales of cache rows entering the packed segment, in one pass; equals
    ``dispatch.quantize_rows`` (``codec.quantize(hadamard(x / lam * signs), clip=clip)``), packed
    codes and scales bit-exact.

    Args:
        x: ``(..., n, d)`` rows in the cache dtype.
        lam: key scales broadcastable to ``x`` with size 1 on the row axis (and on any axis
            after a size-1 one), float32, or None.
        signs: rotation signs broadcastable the same way (``(d,)``, or one per leading block).
    """
    d = x.shape[-1]
    lead = x.shape[:-1]
    n = math.prod(lead)
    if n == 0:
        return mx.zeros((*lead, d * bits // 32), mx.uint32), mx.zeros((*lead, d // group_size), mx.float16)
    codes, scales = _launch_quantize(
        x.reshape(n, d), None if lam is None else _rows_of(lam, lead, "lam"), _rows_of(signs, lead, "signs"),
        bits=bits, group_size=group_size, rotate=rotate, clip=clip, round_to_input=False)
    return codes.reshape(*lead, d * bits // 32), scales.reshape(*lead, d // group_size)


def quantize(x: mx.array, *, bits: int, group_size: int, signs: mx.array | None = None):
    """Quantize head vectors; equals ``codec.quantize(rotation.rotate(x, signs), bits, group_size)``
    (``codec.quantize(x, ...)`` when ``signs`` is None), packed codes and scales bit-exact.

    Args:
        x: ``(..., d)`` float16/bfloat16/float32, d in ``SUPPORTED_DIMS``.
        bits: 2, 3, 4, 5, 6 or 8.  group_size: 32, 64 or 128 (dividing d).
        signs: ``(d,)`` +-1 rotation signs, or None for already rotated input.

    Returns:
        ``(codes, scales)``: uint32 ``(..., d * bits / 32)``, float16 ``(..., d / group_size)``.
    """
    d = x.shape[-1]
    lead = x.shape[:-1]
    n = math.prod(lead)
    rotate = signs is not None
    if signs is None:
        signs = mx.ones((d,), mx.float32)
    if n == 0:
        return mx.zeros((*lead, d * bits // 32), mx.uint32), mx.zeros((*lead, d // group_size), mx.float16)
    codes, scales = _launch_quantize(x.reshape(n, d), None, signs.astype(mx.float32).reshape(1, d), bits=bits,
                                     group_size=group_size, rotate=rotate, clip=False, round_to_input=True)
    return codes.reshape(*lead, d * bits // 32), scales.reshape(*lead, d // group_size)
