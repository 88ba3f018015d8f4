"""The sign flip, Walsh-Hadamard rotation, group abs-max, rounding and bit packing of KV vectors, in one kernel."""

from __future__ import annotations

import math

import mlx.core as mx

from . import _launch
from ._source import build_kernel

ROWS_PER_THREADGROUP = 4


def _kernel():
    return build_kernel("oiq_quantize", "quantize.metal", ("x", "signs", "rot_scale", "params"),
                        ("codes", "scales"))


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
    codes, scales = _launch.launch(
        _kernel(),
        inputs=[x.reshape(n, d), signs.astype(mx.float32), 1.0 / math.sqrt(d),
                mx.array([bits, group_size, int(rotate)], mx.int32)],
        template=[("T", x.dtype), ("D", d), ("ROWS", ROWS_PER_THREADGROUP)],
        grid=(32, n, 1),
        threadgroup=(32, min(ROWS_PER_THREADGROUP, n), 1),
        output_shapes=[(n, d * bits // 32), (n, d // group_size)],
        output_dtypes=[mx.uint32, mx.float16],
    )
    return codes.reshape(*lead, d * bits // 32), scales.reshape(*lead, d // group_size)
