"""The bit unpacking, group scaling and (optionally) inverse rotation of packed KV vectors, in one kernel."""

from __future__ import annotations

import math

import mlx.core as mx

from . import launcher
from .source import build_kernel

ROWS_PER_THREADGROUP = 4


def _kernel():
    return build_kernel("oiq_dequantize", "dequantize.metal", ("codes", "scales", "signs", "rot_scale", "params"),
                        ("out",))


def dequantize(codes: mx.array, scales: mx.array, *, bits: int, group_size: int,
               dtype=mx.float32, signs: mx.array | None = None) -> mx.array:
    """Decode packed vectors; equals ``codec.dequantize(codes, scales, bits, group_size, dtype=dtype)``,
    or ``rotation.unrotate(codec.dequantize(codes, scales, bits, group_size), signs).astype(dtype)``
    when ``signs`` is given (both bit-exact: same float operations in the same order).

    Args:
        codes: uint32 ``(..., d * bits / 32)``, d in ``SUPPORTED_DIMS``.
        scales: float16 ``(..., d / group_size)``.
        dtype: float16, bfloat16 or float32 output.
        signs: ``(d,)`` rotation signs to un-rotate with, or None to stay rotated.

    Returns:
        ``(..., d)`` in ``dtype``.
    """
    d = codes.shape[-1] * 32 // bits
    lead = codes.shape[:-1]
    n = math.prod(lead)
    unrotate = signs is not None
    if signs is None:
        signs = mx.ones((d,), mx.float32)
    if n == 0:
        return mx.zeros((*lead, d), dtype)
    rows = min(ROWS_PER_THREADGROUP, n)
    (out,) = launcher.launch(
        _kernel(),
        inputs=[codes.reshape(n, -1), scales.astype(mx.float16).reshape(n, -1), signs.astype(mx.float32),
                1.0 / math.sqrt(d), mx.array([bits, group_size, int(unrotate)], mx.int32)],
        template=[("OutT", dtype), ("D", d)],
        grid=(32, n, 1),
        threadgroup=(32, rows, 1),
        output_shapes=[(n, d)],
        output_dtypes=[dtype],
    )
    return out.reshape(*lead, d)
