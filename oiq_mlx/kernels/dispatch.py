"""The choice between the fused Metal kernels and the reference (plain MLX)
path for quantize and dequantize (the decode-kernel choice is with attention,
``attention.decode_attention_kernel``); depends only on codec, rotation and
the kernels.

Kernels are used when Metal is available, the default device is the GPU,
the shape is one the kernels serve, neither ``OIQ_MLX_FORCE_REFERENCE=1`` nor
``OIQ_MLX_KERNELS=reference`` is set, and the instantiation passed its
first-use self-test (:mod:`.selftest`).  Everything else (Linux/CPU, CUDA,
unsupported shapes, a failed self-test) runs the reference path, which gives
the same results (codes and scales bit-exact, attention within float32
rounding).

Kernels serve head (storage) dimensions 32, 64, 128 and 256; other sizes
(80, 96, 112, 160, 192, ... whose rotation is not a plain power-of-two
Walsh-Hadamard transform) always take the reference path.  The rows a cache
packs go through :func:`quantize_rows` (one fused kernel, ``clip=True``
included); the plain :func:`quantize` kernel does not serve ``clip=True``.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from ..core import codec, fp4, rotation
from . import selftest
from .source import SUPPORTED_DIMS
from .dequantize import dequantize as kernel_dequantize
from .quantize import quantize as kernel_quantize
from .quantize import quantize_rows as kernel_quantize_rows


def kernels_enabled() -> bool:
    """Metal is here, the default device is the GPU, and neither ``OIQ_MLX_FORCE_REFERENCE=1`` nor
    ``OIQ_MLX_KERNELS=reference`` asks for the reference path.  (Each instantiation also passes
    its first-use self-test before it serves: :mod:`.selftest`.)"""
    if os.environ.get("OIQ_MLX_FORCE_REFERENCE", "0") == "1" or selftest.mode() == "reference":
        return False
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def codec_shape_ok(dim: int, bits: int, group_size: int) -> bool:
    return (
        dim in SUPPORTED_DIMS
        and bits in codec.SUPPORTED_BITS
        and group_size in codec.SUPPORTED_GROUP_SIZES
        and dim % group_size == 0
    )


def _signs_ok(signs, dim: int) -> bool:
    return signs is None or (isinstance(signs, mx.array) and signs.shape == (dim,))


# -- quantize -------------------------------------------------------------------


def quantize_kernel(x: mx.array, bits: int, group_size: int, *, signs=None, clip: bool = False):
    """Fused (rotate +) quantize of ``x`` when a kernel serves it, else None.

    Equals ``codec.quantize(rotate(x, signs) if signs is not None else x, bits, group_size)``.
    """
    if not kernels_enabled() or clip or not isinstance(x, mx.array) or x.ndim < 1 or x.size == 0:
        return None
    if not mx.issubdtype(x.dtype, mx.floating) or not codec_shape_ok(x.shape[-1], bits, group_size):
        return None
    if not _signs_ok(signs, x.shape[-1]) or not selftest.quantize_ok(x.dtype, x.shape[-1]):
        return None
    return kernel_quantize(x, bits=bits, group_size=group_size, signs=signs)


def quantize(x: mx.array, bits: int, group_size: int, *, signs=None, clip: bool = False):
    """``codec.quantize(rotate(x, signs) if signs is not None else x, bits, group_size, clip=clip)``,
    by the fused kernel when one serves the call.  Returns ``(codes, scales)``."""
    out = quantize_kernel(x, bits, group_size, signs=signs, clip=clip)
    if out is not None:
        return out
    return codec.quantize(rotation.rotate(x, signs) if signs is not None else x, bits, group_size, clip=clip)


@functools.lru_cache(maxsize=None)
def _compiled_quantize(bits: int, group_size: int, clip: bool, align: float):
    return mx.compile(functools.partial(codec.quantize, bits=bits, group_size=group_size, clip=clip, align=align))


@functools.partial(mx.compile, shapeless=True)
def _to_packed_domain(x, lam, signs):
    return x.astype(mx.float32) / lam * signs


_ONE = mx.array(1.0, mx.float32)


def quantize_rows(x: mx.array, bits: int, group_size: int, *, lam: mx.array | None, signs: mx.array,
                  rotate: bool = True, clip: bool = False, joined: bool = False, align=False):
    """Codes and scales of window rows entering the packed segment of a cache: one fused
    kernel (key scaling, sign flip, Walsh-Hadamard, abs-max or clip search, rounding,
    packing) when one serves the call, else the reference.

    Equals ``codec.quantize(rotation.rotate(x.astype(float32) / lam, signs), bits, group_size,
    clip=clip, align=align)`` (``codec.quantize(x / lam * signs, ...)`` with ``rotate`` False),
    codes and scales bit-exact.

    Args:
        x: ``(..., n, d)`` rows as the window holds them (centered, model dtype); a slice of
            the window buffer along the row axis is read in place by the kernel (pass it as it
            is: reshaping it would copy).
        lam: key scales, float32, broadcastable to ``x`` with size 1 on the row axis, or None.
        signs: the rotation signs, float32, broadcastable the same way.
        joined: return the packed rows ``codec.join_rows(codes, scales)`` (what the cache
            stores) instead of ``(codes, scales)``; the kernel writes them directly.
        align: ``codec.quantize``'s, or a ``(keys, values)`` pair when ``x`` stacks keys and
            values on its first axis (``OIQConfig.scale_alignment``).
    """
    if (kernels_enabled() and x.size and mx.issubdtype(x.dtype, mx.floating)
            and codec_shape_ok(x.shape[-1], bits, group_size) and selftest.quantize_ok(x.dtype, x.shape[-1])):
        return kernel_quantize_rows(x, bits=bits, group_size=group_size, lam=lam, signs=signs, rotate=rotate,
                                    clip=clip, joined=joined, align=align)
    y = _to_packed_domain(x, _ONE if lam is None else lam, signs)
    if rotate:
        y = rotation.hadamard(y)
    first, second = codec.alignment_pair(align, x.shape[:-1])
    if first != second:  # keys and values stacked, each side its own alignment
        sides = [_compiled_quantize(bits, group_size, clip, a)(y[i]) for i, a in enumerate((first, second))]
        out = tuple(mx.stack(parts) for parts in zip(*sides))
        return codec.join_rows(*out) if joined else out
    out = _compiled_quantize(bits, group_size, clip, first)(y)
    return codec.join_rows(*out) if joined else out


def quantize_fp4_rows(x: mx.array, mode: str, *, lam: mx.array | None, signs: mx.array, rotate: bool = True,
                      clip: bool = False):
    """Joined fp4 rows (``fp4.join_pair``) of window rows entering the packed segment: keys and
    values stacked on the first axis, ``x`` ``(2, ..., n, d)``; ``clip``: MXFP4's exponent search
    (``fp4.quantize``).  Plain MLX on every backend (``mx.quantize(mode=)``): the int kernels
    never see fp4 data, and need not, since MLX quantizes fp4 natively."""
    y = _to_packed_domain(x, _ONE if lam is None else lam, signs)
    if rotate:
        y = rotation.hadamard(y)
    return fp4.quantize_pair(y, mode, clip=clip)


# -- dequantize -----------------------------------------------------------------


def dequantize_kernel(codes: mx.array, scales: mx.array, bits: int, group_size: int, *,
                      dtype=mx.float32, signs=None):
    """Fused dequantize (+ un-rotate) when a kernel serves it, else None.

    Equals ``codec.dequantize(codes, scales, bits, group_size, dtype=dtype)``, or
    ``unrotate(codec.dequantize(codes, scales, bits, group_size), signs).astype(dtype)``.
    """
    if not kernels_enabled() or not isinstance(codes, mx.array) or codes.dtype != mx.uint32:
        return None
    if codes.ndim < 1 or codes.size == 0 or bits not in codec.SUPPORTED_BITS:
        return None
    dim = codes.shape[-1] * 32 // bits
    if codes.shape[-1] * 32 % bits or not codec_shape_ok(dim, bits, group_size) or not _signs_ok(signs, dim):
        return None
    if scales.shape != (*codes.shape[:-1], dim // group_size):
        return None
    if dtype not in (mx.float16, mx.bfloat16, mx.float32) or not selftest.dequantize_ok(dtype, dim):
        return None
    return kernel_dequantize(codes, scales, bits=bits, group_size=group_size, dtype=dtype, signs=signs)


def dequantize(codes: mx.array, scales: mx.array, bits: int, group_size: int, *, dtype=mx.float32, signs=None):
    """``codec.dequantize`` (then ``unrotate(., signs)`` when ``signs`` is given), by the fused
    kernel when one serves the call.  Returns ``(..., d)`` in ``dtype``."""
    out = dequantize_kernel(codes, scales, bits, group_size, dtype=dtype, signs=signs)
    if out is not None:
        return out
    y = codec.dequantize(codes, scales, bits, group_size, dtype=mx.float32 if signs is not None else dtype)
    return rotation.unrotate(y, signs).astype(dtype) if signs is not None else y
