"""Scores, online softmax and value sums over packed and full-precision KV segments, split over the
sequence and merged by log-sum-exp with the packed share's un-rotation fused into the merge (two
kernels: the two dispatches of a decode step's attention, query preparation included)."""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from . import _launch
from ._source import build_kernel

MAX_QUERY_ROWS = 8  # query rows (rep * L) sharing one read of the cache per simdgroup
# Query rows x values per lane one simdgroup may hold: MLX's own GQA vector kernel caps rows x D/32
# at 16, and each row costs 2 x D/32 live floats per lane here (query and accumulator).
MAX_ROW_VALUES = 16
KEYS_PER_PART_MIN = 64
TARGET_SIMDGROUPS = 1024  # enough slices to fill an M-series GPU at small batch
PARTS_PER_THREADGROUP = 4
ROWS_PER_THREADGROUP = 4
_MASK_NONE, _MASK_CAUSAL, _MASK_BOOL, _MASK_ADD = 0, 1, 2, 3


def max_query_rows(d: int) -> int:
    """The most query rows one simdgroup serves at head dimension d: 8 at d <= 64, 4 at 128, 2 at 256
    (rows x d/32 <= MAX_ROW_VALUES), so live registers stay near MLX's GQA kernel's."""
    return max(1, min(MAX_QUERY_ROWS, MAX_ROW_VALUES * 32 // d))


def query_rows_per_chunk(rows: int, d: int) -> int:
    """QB, the query rows one simdgroup serves: the power of two >= rows, at most max_query_rows(d)
    (powers of two only, so that few kernel instantiations exist; padded rows are skipped).  More
    rows than that read the cache once per chunk of QB rows."""
    return min(max_query_rows(d), 1 << max(0, rows - 1).bit_length())


def _attention_kernel():
    return build_kernel(
        "oiq_decode_attention", "decode_attention.metal",
        ("q", "scale", "lam", "k_signs", "rot_scale", "sk", "sv", "kc", "ks", "vc", "vs", "rk", "rv", "mask",
         "params"),
        ("part_o", "part_ml"), row_contiguous=False,
    )


@functools.lru_cache(maxsize=None)
def placeholder(shape: tuple, dtype) -> mx.array:
    """An evaluated zero array standing for an absent input: built once, not per call."""
    a = mx.zeros(shape, dtype)
    mx.eval(a)
    return a


def _merge_kernel():
    return build_kernel(
        "oiq_decode_merge", "decode_merge.metal",
        ("part_o", "part_ml", "sinks", "mean", "signs", "rot_scale", "params"), ("out",),
    )


def keys_per_part(total: int, n_programs: int) -> int:
    """Keys per slice: enough slices for ~TARGET_SIMDGROUPS simdgroups, at least KEYS_PER_PART_MIN keys each."""
    parts = max(1, min(math.ceil(total / KEYS_PER_PART_MIN), TARGET_SIMDGROUPS // max(1, n_programs)))
    return math.ceil(total / parts)


def _sink_rows(sinks: mx.array, B: int, n_q: int, L: int) -> mx.array:
    s = sinks.astype(mx.float32)
    if s.ndim == 1:
        s = s.reshape(1, n_q, 1)
    return mx.contiguous(mx.broadcast_to(s, (B, n_q, L)))


def decode_attention(q: mx.array, *, scale: float, segments, k_bits: int, v_bits: int, group_size: int,
                     k_lam: mx.array | None = None, k_signs: mx.array | None = None,
                     mask=None, sinks: mx.array | None = None, v_mean: mx.array | None = None,
                     v_signs: mx.array | None = None, keys_per_part_: int | None = None) -> mx.array:
    """Attention of few queries over an OIQ cache's segments (keys and values of the same head
    dimension), query preparation included; equals the reference path of
    ``attention.oiq_attention`` before its cast to the query dtype (``_prepare_queries``, the
    Hadamard transform, ``_decode_reference``, the packed share un-rotated, ``_combine``), within
    float32 rounding.

    Args:
        q: ``(B, n_q, L, dk)`` queries as the model gives them (any strides), in the dtype of the
            full-precision segments.
        scale: the softmax scale.
        segments: ``cache.segments()``: ``(sink_k, sink_v, quant, recent_k, recent_v)``, any
            full-precision part None when empty, ``quant`` None or
            ``(k_codes, k_scales, v_codes, v_scales)``; full-precision rows centered and
            un-rotated, packed rows ``r((k - m) / lam)``; slices along the token axis are fine
            (read through strides), the last axis must be contiguous.
        k_lam: ``(B, n_kv, 1, dk)`` key scales, or None.
        k_signs: ``(dk,)`` key rotation signs, or None when keys are not rotated.
        mask: None, ``"causal"`` or an array broadcastable to ``(B, n_q, L, T)`` (bool, or
            additive).
        sinks: attention-sink logits ``(n_q,)`` or per query row ``(B, n_q, L)``, or None.
        v_mean: ``(B, n_kv, 1, dv)`` value mean (un-rotated) to add, or None.
        v_signs: ``(dv,)`` value rotation signs (un-rotate the packed share), or None when values
            are not rotated.
        keys_per_part_: slice length override (tests).

    Returns:
        ``(B, n_q, L, dv)`` float32.
    """
    sink_k, sink_v, quant, recent_k, recent_v = segments
    B, n_q, L, dk = q.shape
    ref = next(x for x in (sink_v, recent_v, quant and quant[2]) if x is not None)
    n_kv = ref.shape[1]
    rep = n_q // n_kv
    n_sink = sink_k.shape[2] if sink_k is not None else 0
    n_recent = recent_k.shape[2] if recent_k is not None else 0
    if quant is not None:
        kc, ks, vc, vs = quant
        n_quant = kc.shape[2]
        dv = vc.shape[-1] * 32 // v_bits
    else:
        n_quant = 0
        dv = ref.shape[-1]
        # placeholders of one packed vector: at low bits they are small enough (< 8
        # elements) that MLX binds them `constant`, which the kernel accepts
        kc = placeholder((1, 1, 1, dk * k_bits // 32), mx.uint32)
        vc = placeholder((1, 1, 1, dv * v_bits // 32), mx.uint32)
        ks = placeholder((1, 1, 1, dk // group_size), mx.float16)
        vs = placeholder((1, 1, 1, dv // group_size), mx.float16)
    if dk != dv:
        raise ValueError(f"the decode kernels serve equal key and value head dimensions, got {dk} and {dv}")
    fp_dtype = q.dtype
    for x in (sink_k, sink_v, recent_k, recent_v):
        if x is not None and x.dtype != fp_dtype:
            raise ValueError(f"queries ({fp_dtype}) and full-precision segments ({x.dtype}) must share a dtype")
    if sink_k is None:
        sink_k = sink_v = placeholder((1, 1, 1, dk), fp_dtype)
    if recent_k is None:
        recent_k = recent_v = placeholder((1, 1, 1, dk), fp_dtype)
    T = n_sink + n_quant + n_recent

    if mask is None or (isinstance(mask, str) and L == 1):
        mode, mask_arr = _MASK_NONE, placeholder((1, 1, 1, 1), mx.float32)
    elif isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        mode, mask_arr = _MASK_CAUSAL, placeholder((1, 1, 1, 1), mx.float32)
    else:
        # converted before broadcasting: one float32 copy of the mask as given, read through
        # stride-0 axes (bool: nonzero keeps; float16/bfloat16 convert exactly)
        mode = _MASK_BOOL if mask.dtype == mx.bool_ else _MASK_ADD
        mask_arr = mx.broadcast_to(mask.astype(mx.float32), (B, n_q, L, T))

    rows = rep * L
    qb = query_rows_per_chunk(rows, dk)
    nqc = math.ceil(rows / qb)
    kpp = keys_per_part_ or keys_per_part(T, B * n_kv * nqc)
    # slices never straddle two segments (each slice's output is in one domain)
    p_sink, p_quant, p_recent = (math.ceil(n / kpp) for n in (n_sink, n_quant, n_recent))
    n_parts = p_sink + p_quant + p_recent
    params = mx.array([n_sink, n_quant, n_recent, n_kv, rep, L, kpp, nqc, k_bits, v_bits, group_size, mode,
                       p_sink, p_quant, k_lam is not None, k_signs is not None], mx.int32)
    part_o, part_ml = _launch.launch(
        _attention_kernel(),
        inputs=[q, float(scale),
                placeholder((1,), mx.float32) if k_lam is None else k_lam,
                placeholder((1,), mx.float32) if k_signs is None else k_signs,
                1.0 / math.sqrt(dk), sink_k, sink_v, kc, ks, vc, vs, recent_k, recent_v, mask_arr, params],
        template=[("FT", fp_dtype), ("D", dk), ("QB", qb)],
        grid=(32, n_parts, B * n_kv * nqc),
        threadgroup=(32, min(PARTS_PER_THREADGROUP, n_parts), 1),
        output_shapes=[(B * n_kv * nqc, n_parts, qb, dv), (B * n_kv * nqc, n_parts, qb, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )

    has_sinks, has_mean, unrotate = sinks is not None, v_mean is not None, v_signs is not None
    n_rows = B * n_q * L
    (out,) = _launch.launch(
        _merge_kernel(),
        inputs=[part_o, part_ml,
                _sink_rows(sinks, B, n_q, L) if has_sinks else placeholder((1,), mx.float32),
                v_mean if has_mean else placeholder((1,), mx.float32),
                v_signs if unrotate else placeholder((1,), mx.float32),
                1.0 / math.sqrt(dv),
                mx.array([n_kv, rep, L, n_parts, nqc, qb, has_sinks, has_mean, unrotate, p_sink, p_quant],
                         mx.int32)],
        template=[("D", dv)],
        grid=(32, n_rows, 1),
        threadgroup=(32, min(ROWS_PER_THREADGROUP, n_rows), 1),
        output_shapes=[(B, n_q, L, dv)],
        output_dtypes=[mx.float32],
    )
    return out
