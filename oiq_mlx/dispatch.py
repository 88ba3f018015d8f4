"""The one place that decides between the fused Metal kernels and the
reference (plain MLX) path.

Kernels are used when Metal is available, the default device is the GPU,
the shape is one the kernels serve, and ``OIQ_MLX_FORCE_REFERENCE`` is not
set to ``1``.  Everything else (Linux/CPU, CUDA, unsupported shapes) runs the
reference path, which gives the same results (codes and scales bit-exact,
attention within float32 rounding).

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

from . import codec, rotation
from .kernels._source import SUPPORTED_DIMS
from .kernels.decode_attention import decode_attention
from .kernels.dequantize import dequantize as kernel_dequantize
from .kernels.quantize import quantize as kernel_quantize
from .kernels.quantize import quantize_rows as kernel_quantize_rows

# queries per step up to which attention takes the decode path (kernel or reference)
DECODE_MAX_QUERIES = 8


def kernels_enabled() -> bool:
    if os.environ.get("OIQ_MLX_FORCE_REFERENCE", "0") == "1":
        return False
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def _codec_shape_ok(dim: int, bits: int, group_size: int) -> bool:
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
    if not mx.issubdtype(x.dtype, mx.floating) or not _codec_shape_ok(x.shape[-1], bits, group_size):
        return None
    if not _signs_ok(signs, x.shape[-1]):
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
def _compiled_quantize(bits: int, group_size: int, clip: bool):
    return mx.compile(functools.partial(codec.quantize, bits=bits, group_size=group_size, clip=clip))


@functools.partial(mx.compile, shapeless=True)
def _to_packed_domain(x, lam, signs):
    return x.astype(mx.float32) / lam * signs


_ONE = mx.array(1.0, mx.float32)


def quantize_rows(x: mx.array, bits: int, group_size: int, *, lam: mx.array | None, signs: mx.array,
                  rotate: bool = True, clip: bool = False):
    """Codes and scales of window rows entering the packed segment of a cache: one fused
    kernel (key scaling, sign flip, Walsh-Hadamard, abs-max or clip search, rounding,
    packing) when one serves the call, else the reference.

    Equals ``codec.quantize(rotation.rotate(x.astype(float32) / lam, signs), bits, group_size,
    clip=clip)`` (``codec.quantize(x / lam * signs, ...)`` with ``rotate`` False), codes and
    scales bit-exact.

    Args:
        x: ``(..., n, d)`` rows as the window holds them (centered, model dtype).
        lam: key scales, float32, broadcastable to ``x`` with size 1 on the row axis, or None.
        signs: the rotation signs, float32, broadcastable the same way.
    """
    if (kernels_enabled() and x.size and mx.issubdtype(x.dtype, mx.floating)
            and _codec_shape_ok(x.shape[-1], bits, group_size)):
        return kernel_quantize_rows(x, bits=bits, group_size=group_size, lam=lam, signs=signs, rotate=rotate,
                                    clip=clip)
    y = _to_packed_domain(x, _ONE if lam is None else lam, signs)
    if rotate:
        y = rotation.hadamard(y)
    return _compiled_quantize(bits, group_size, clip)(y)


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
    if codes.shape[-1] * 32 % bits or not _codec_shape_ok(dim, bits, group_size) or not _signs_ok(signs, dim):
        return None
    if scales.shape != (*codes.shape[:-1], dim // group_size):
        return None
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
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


# -- decode attention -----------------------------------------------------------


def _mask_ok(mask, shape) -> bool:
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    if not isinstance(mask, mx.array):
        return False
    try:
        mx.broadcast_shapes(mask.shape, shape)
    except ValueError:
        return False
    return mask.ndim <= 4


def decode_attention_kernel(cache, queries: mx.array, scale: float, mask, sinks, *, segments=None):
    """Fused decode attention over ``cache`` when a kernel serves this call, else None
    (the caller runs the reference path).

    Args:
        cache: an OIQKVCache holding at least one token.
        queries: ``(B, n_q, L, head_dim)`` as the model gives them; L <= 8.
        scale, mask, sinks: as for ``attention.oiq_attention``.
        segments: what to attend to (default ``cache.attention_segments()``).

    Returns:
        ``(B, n_q, L, v.dim)`` float32, the output before its cast to the query dtype (slice to
        ``v.head_dim``), or None.
    """
    if not kernels_enabled() or not isinstance(queries, mx.array) or queries.ndim != 4:
        return None
    k, v, cfg = cache.k, cache.v, cache.config
    B, n_q, L, dq = queries.shape
    if cache.offset == 0 or L > DECODE_MAX_QUERIES or dq != k.head_dim:
        return None
    if k.dim != v.dim or not _codec_shape_ok(k.dim, k.bits, cfg.group_size) \
            or not _codec_shape_ok(v.dim, v.bits, cfg.group_size):
        return None
    n_kv = k.sink.shape[1]
    if n_q % n_kv or not _mask_ok(mask, (B, n_q, L, cache.offset)):
        return None
    if isinstance(mask, str) and L > 1 and cache.offset < L:
        return None
    if sinks is not None and (not isinstance(sinks, mx.array) or sinks.shape != (n_q,)):
        return None
    q = queries if queries.dtype == cache.dtype else queries.astype(cache.dtype)
    if dq != k.dim:
        q = mx.pad(q, [(0, 0)] * 3 + [(0, k.dim - dq)])
    if sinks is not None and k.mean is not None:
        # centered keys shift every score by -q.mean; the sink logit must follow
        qg = q.astype(mx.float32).reshape(B, n_kv, n_q // n_kv, L, k.dim) * scale
        shift = mx.sum(qg * mx.expand_dims(k.mean, 2), axis=-1).reshape(B, n_q, L)
        sinks = sinks.astype(mx.float32).reshape(1, n_q, 1) - shift
    return decode_attention(
        q, scale=scale, segments=cache.attention_segments() if segments is None else segments,
        k_bits=k.bits, v_bits=v.bits, group_size=cfg.group_size, k_lam=k.lam,
        k_signs=k.signs if k.rotated else None, mask=mask, sinks=sinks, v_mean=v.mean,
        v_signs=v.signs if v.rotated else None,
    )
