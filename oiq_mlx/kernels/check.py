"""Validate every fused kernel against the reference on a Metal GPU and time it (``scripts/check_metal.py``)."""

from __future__ import annotations

import time

import mlx.core as mx

from .. import attention, codec, rotation
from ..cache import OIQKVCache
from ..config import OIQConfig
from .decode_attention import decode_attention
from .dequantize import dequantize
from .quantize import quantize


class MetalUnavailable(RuntimeError):
    pass


def require_metal():
    if not mx.metal.is_available():
        raise MetalUnavailable("Metal is not available on this machine (the kernels need an Apple GPU); "
                               "the reference path is used instead")
    mx.set_default_device(mx.gpu)


def _time(fn, iters: int) -> float:
    """Median milliseconds per call of fn (evaluated)."""
    mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def check_codec(d: int, bits: int, group_size: int, tokens: int, iters: int):
    x = mx.random.normal((tokens, 8, d), key=mx.random.key(0)).astype(mx.float16)
    signs = rotation.random_signs(0, d)
    codes, scales = quantize(x, bits=bits, group_size=group_size, signs=signs)
    ref_c, ref_s = codec.quantize(rotation.rotate(x, signs), bits, group_size)
    mismatches = int(mx.sum(codes != ref_c).item() + mx.sum(scales != ref_s).item())
    out = dequantize(codes, scales, bits=bits, group_size=group_size, dtype=mx.float16)
    deq_err = mx.abs(out.astype(mx.float32) - codec.dequantize(ref_c, ref_s, bits, group_size)).max().item()
    return {
        "op": f"quantize+dequantize d={d} {bits}b g{group_size} T={tokens}",
        "mismatched words/scales": mismatches,
        "dequantize max err": deq_err,
        "quantize kernel ms": _time(lambda: quantize(x, bits=bits, group_size=group_size, signs=signs), iters),
        "quantize reference ms": _time(lambda: codec.quantize(rotation.rotate(x, signs), bits, group_size), iters),
        "dequantize kernel ms": _time(lambda: dequantize(codes, scales, bits=bits, group_size=group_size,
                                                         dtype=mx.float16), iters),
        "dequantize reference ms": _time(lambda: codec.dequantize(codes, scales, bits, group_size,
                                                                  dtype=mx.float16), iters),
    }


def check_decode(d: int, bits: int, group_size: int, context: int, n_kv: int, rep: int, L: int, iters: int):
    cfg = OIQConfig(k_bits=bits, v_bits=bits, group_size=group_size)
    cache = OIQKVCache(cfg)
    k = mx.random.normal((1, n_kv, context, d), key=mx.random.key(1)).astype(mx.float16)
    v = mx.random.normal((1, n_kv, context, d), key=mx.random.key(2)).astype(mx.float16)
    cache.update_and_fetch(k, v)
    queries = mx.random.normal((1, n_kv * rep, L, d), key=mx.random.key(3)).astype(mx.float16)
    q = rotation.rotate(queries.astype(mx.float32) * d ** -0.5, cache.k.signs)
    mask = "causal" if L > 1 else None
    segs = cache.segments()

    def kernel():
        return decode_attention(q, segments=segs, k_bits=bits, v_bits=bits, group_size=group_size, mask=mask)

    ref = attention._decode_reference(q, cache, mask, None, segs)
    err = mx.abs(kernel() - ref).max().item()
    kf, vf = k, v
    sdpa_mask = "causal" if L > 1 else None
    return {
        "op": f"decode attention d={d} {bits}b g{group_size} ctx={context} kv={n_kv} rep={rep} L={L}",
        "max err vs reference": err,
        "kernel ms": _time(kernel, iters),
        "reference path ms": _time(lambda: attention._decode_reference(q, cache, mask, None, segs), iters),
        "fp16 sdpa ms": _time(lambda: mx.fast.scaled_dot_product_attention(
            queries, kf, vf, scale=d ** -0.5, mask=sdpa_mask), iters),
    }


def run_all(iters: int = 20):
    """Yield one result dict per check."""
    require_metal()
    for d in (64, 128, 256):
        for bits in codec.SUPPORTED_BITS:
            yield check_codec(d, bits, 32, 512, iters)
    for d, rep in ((64, 3), (128, 4), (256, 8)):
        for context in (1024, 8192, 32768):
            for L in (1, 8):
                yield check_decode(d, 4, 32, context, 8 if d < 256 else 1, rep, L, iters)
