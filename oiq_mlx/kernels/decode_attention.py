"""Scores, online softmax and value sums over packed and full-precision KV segments, split over the
sequence and merged by log-sum-exp with the packed share's un-rotation fused into the merge (two
kernels: the two dispatches of a decode step's attention, query preparation included); pass 1
merges the slices of each threadgroup before it writes its partials."""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from . import launcher
from .source import build_kernel

MAX_QUERY_ROWS = 8  # query rows (rep * L) sharing one read of the cache per simdgroup
# Query rows x values per lane one simdgroup may hold: MLX's own GQA vector kernel caps rows x D/32
# at 16, and each row costs 2 x D/32 live floats per lane here (query and accumulator).
MAX_ROW_VALUES = 16
# The split of the sequence into slices (split_parts; metal/README.md, "Split sizes").  Unverified
# on hardware: chosen from core counts and bytes, not timed.
KEYS_PER_PART_MIN = 64  # a slice's fixed work (query load and preparation, partial store) vs its keys
TARGET_SIMDGROUPS = 1024  # ~25 per core on a 40-core M3/M4 Max, 128 per core on an 8-core M1
# pass 1's partial outputs (written, then read by the merge) at most 1/PARTIAL_TRAFFIC_SHARE of the
# key/value bytes a slice reads
PARTIAL_TRAFFIC_SHARE = 8
MAX_PARTS = 128  # slices per query row (their threadgroups' partials the merge reads serially)
OUT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)  # the merge's output dtypes (the queries')
# slices per threadgroup of pass 1, which merges them into one partial output (TGP): the partials
# written and read back are 1/TGP of the slices
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


ATTENTION_INPUTS = ("q", "scale", "lam", "k_signs", "rot_scale", "sk", "sv", "kc", "ks", "vc", "vs", "rk", "rv",
                    "mask", "ranges", "k_mean", "params")


def _attention_kernel():
    return build_kernel("oiq_decode_attention", "decode_attention.metal", ATTENTION_INPUTS,
                        ("part_o", "part_ml", "part_shift"), row_contiguous=False)


def is_attention_kernel(kernel) -> bool:
    """Is ``kernel`` (what ``launcher.launch`` is handed) pass 1 of decode attention?"""
    return kernel is _attention_kernel()


def attention_bytes_read(inputs) -> int:
    """Bytes pass 1 reads of its ``inputs`` (in :data:`ATTENTION_INPUTS` order): every array in
    full, except the packed and recent rows of a launch given per-sequence ``ranges``, of which it
    reads each sequence's own rows only (``oiq_mlx.bench.bytes`` counts a call by this)."""
    named = dict(zip(ATTENTION_INPUTS, inputs))
    total = sum(x.nbytes for x in inputs if isinstance(x, mx.array))
    if not int(named["params"][16].item()):
        return total
    r = np.array(named["ranges"]).reshape(-1, 3)
    for name, rows in (("kc", r[:, 0]), ("ks", r[:, 0]), ("vc", r[:, 0]), ("vs", r[:, 0]),
                       ("rk", r[:, 2] - r[:, 1]), ("rv", r[:, 2] - r[:, 1])):
        x = named[name]
        if x.ndim == 4 and x.shape[0] == len(r) and x.shape[2] > 0:
            per_row = x.nbytes // (x.shape[0] * x.shape[2])
            total += int(per_row * np.maximum(rows, 0).sum()) - x.nbytes
    return total


@functools.lru_cache(maxsize=None)
def placeholder(shape: tuple, dtype) -> mx.array:
    """An evaluated zero array standing for an absent input: built once, not per call."""
    a = mx.zeros(shape, dtype)
    mx.eval(a)
    return a


def _merge_kernel():
    return build_kernel(
        "oiq_decode_merge", "decode_merge.metal",
        ("part_o", "part_ml", "sinks", "mean", "signs", "rot_scale", "part_shift", "params"), ("out",),
    )


def min_keys_per_part(d: int, qb: int, bytes_per_key: float) -> int:
    """The fewest keys a slice should hold: KEYS_PER_PART_MIN, and enough that the slice's partial
    outputs (``qb`` rows of ``d + 2`` floats, written by pass 1 and read by the merge:
    ``2 * qb * (d + 2) * 4`` bytes) stay within 1/PARTIAL_TRAFFIC_SHARE of the ``bytes_per_key``
    the slice reads per key (keys and values, codes and scales)."""
    partial = 2 * qb * (d + 2) * 4
    return max(KEYS_PER_PART_MIN, math.ceil(PARTIAL_TRAFFIC_SHARE * partial / max(bytes_per_key, 1.0)))


def split_parts(total: int, n_programs: int, kmin: int) -> int:
    """Slices per (KV head, query chunk) for ``total`` keys over ``n_programs = B * n_kv * chunks``
    simdgroup programs: enough for ~TARGET_SIMDGROUPS simdgroups in all, no slice below ``kmin``
    keys (unless the context is shorter: then one), at most MAX_PARTS - 2 (a slice never straddles
    two of the three segments, which adds at most 2 slices: the merge reads at most MAX_PARTS).
    Non-decreasing in ``total``, non-increasing in ``n_programs`` and ``kmin``."""
    fill = math.ceil(TARGET_SIMDGROUPS / max(1, n_programs))
    return max(1, min(fill, total // max(1, kmin), MAX_PARTS - 2))


def keys_per_part(total: int, n_programs: int, *, d: int = 128, qb: int = 1,
                  bytes_per_key: float = 2 * 128 * 2) -> int:
    """Keys per slice: ``ceil(total / split_parts(...))`` with ``kmin = min_keys_per_part(d, qb,
    bytes_per_key)`` (defaults: d = 128, one query row, fp16 keys and values)."""
    parts = split_parts(total, n_programs, min_keys_per_part(d, qb, bytes_per_key))
    return max(1, math.ceil(total / parts))


def launch_parts(p_sink: int, p_quant: int, p_recent: int, tgp: int = PARTS_PER_THREADGROUP) -> tuple:
    """``(P_F, P)``: the slices pass 1 launches, in threadgroups of ``tgp`` that each stay in one
    domain: the sinks' and the recent rows' slices, padded with empty ones to ``P_F`` (a multiple
    of ``tgp``), then the packed rows', padded to ``P`` (decode_attention.metal)."""
    p_fp = -(-(p_sink + p_recent) // tgp) * tgp
    return p_fp, p_fp + -(-p_quant // tgp) * tgp


def segment_parts(kpp: int, *lengths: int) -> tuple:
    """Slices of each segment (sinks, packed, recent) at ``kpp`` keys per slice: a slice never
    straddles two segments (each slice's output is in one domain), so the total is at most
    ``ceil(sum(lengths) / kpp) + len(lengths) - 1``."""
    return tuple(math.ceil(n / kpp) for n in lengths)


def bytes_per_key(d: int, k_bits: int, v_bits: int, group_size: int, n_packed: int, n_fp: int,
                  fp_bytes: int) -> float:
    """Mean bytes read per key (key and value) over ``n_packed`` packed and ``n_fp`` full-precision
    rows of ``fp_bytes`` per value."""
    packed = d * (k_bits + v_bits) / 8 + 2 * 2 * d / group_size
    fp = 2 * d * fp_bytes
    return (n_packed * packed + n_fp * fp) / max(1, n_packed + n_fp)


def fast_exp_relative_bound(keys_per_part: int, mean_gap: float) -> float:
    """Bound of ``sum_i w_i |rho_i|``, the softmax-weighted relative error that fast::exp puts on the
    keys' weights in pass 1 (metal/README.md, "fast::exp"), for exps off by at most
    ``4 + 2|x|`` ulp (Metal's documented ``3 + floor(2|x|)`` plus one ulp of slack, which the
    emulator's model uses): ``e^eps - 1`` with ``eps = 2^-23 (4 keys_per_part + 4 mean_gap)``,
    where ``mean_gap = sum_i w_i (m - s_i)`` (at most ``ln(T + 1)``) and ``keys_per_part - 1`` bounds
    the rescales after any key of a slice.  The output is then off by at most
    ``max_i |v_i - o| * b / (1 - b)`` for this ``b``."""
    return math.expm1(2.0 ** -23 * (4 * keys_per_part + 4 * mean_gap))


def _sink_logits(sinks: mx.array, B: int, n_q: int, L: int) -> tuple:
    """``(logits, per_head)``: the merge kernel's sink logits in float32, per query head
    ``(n_q,)`` as given (no broadcast copy), else per query row ``(B, n_q, L)`` row-contiguous."""
    s = sinks.astype(mx.float32)
    if s.ndim == 1 and s.shape[0] == n_q:
        return s, True
    if s.ndim == 1:
        s = s.reshape(1, n_q, 1)
    return (s if s.shape == (B, n_q, L) else mx.contiguous(mx.broadcast_to(s, (B, n_q, L)))), False


def decode_attention(q: mx.array, *, scale: float, segments, k_bits: int, v_bits: int, group_size: int,
                     k_lam: mx.array | None = None, k_signs: mx.array | None = None,
                     mask=None, sinks: mx.array | None = None, v_mean: mx.array | None = None,
                     v_signs: mx.array | None = None, ranges: mx.array | None = None,
                     k_mean: mx.array | None = None, keys_per_part_: int | None = None,
                     out_dtype=mx.float32) -> mx.array:
    """Attention of few queries over an OIQ cache's segments (keys and values of the same head
    dimension), query preparation included; equals the reference path of
    ``attention.oiq_attention`` (``_prepare_queries``, the Hadamard transform,
    ``_decode_reference``, the packed share un-rotated, ``_combine``, cast to ``out_dtype``), within
    float32 rounding and the fast::exp bound (``fast_exp_relative_bound``).

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
        k_mean: ``(B, n_kv, 1, dk)`` float32 key mean the stored keys are centered by, or None:
            with ``sinks``, each sink logit moves by ``-scale * q . k_mean`` as every score did
            (pass 1 computes the product, the merge subtracts it).
        v_mean: ``(B, n_kv, 1, dv)`` value mean (un-rotated) to add, or None.
        v_signs: ``(dv,)`` value rotation signs (un-rotate the packed share), or None when values
            are not rotated.
        ranges: ``(B, 3)`` int32, for a batch stacked on padded lengths: sequence ``b``'s packed
            rows ``[0, ranges[b, 0])`` and recent rows ``[ranges[b, 1], ranges[b, 2])``; the
            other rows are neither read nor attended (no mask needed for them).  None: all.
        keys_per_part_: slice length override (tests).
        out_dtype: the output dtype (float16, bfloat16 or float32): the merge accumulates in
            float32 and rounds once at the store.

    Returns:
        ``(B, n_q, L, dv)`` in ``out_dtype``.
    """
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"the merge kernel writes {OUT_DTYPES}, not {out_dtype}")
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
    kpp = keys_per_part_ or keys_per_part(
        T, B * n_kv * nqc, d=dk, qb=qb,
        bytes_per_key=bytes_per_key(dk, k_bits, v_bits, group_size, n_quant, n_sink + n_recent, fp_dtype.size))
    p_sink, p_quant, p_recent = segment_parts(kpp, n_sink, n_quant, n_recent)
    if p_sink + p_quant + p_recent > MAX_PARTS:
        raise ValueError(f"{p_sink + p_quant + p_recent} slices of {kpp} keys: the merge reads at most {MAX_PARTS}")
    shift = sinks is not None and k_mean is not None
    tgp = PARTS_PER_THREADGROUP
    p_fp, n_parts = launch_parts(p_sink, p_quant, p_recent, tgp)
    n_groups = n_parts // tgp
    params = mx.array([n_sink, n_quant, n_recent, n_kv, rep, L, kpp, nqc, k_bits, v_bits, group_size, mode,
                       p_sink, p_recent, k_lam is not None, k_signs is not None, ranges is not None,
                       shift], mx.int32)
    part_o, part_ml, part_shift = launcher.launch(
        _attention_kernel(),
        inputs=[q, float(scale),
                placeholder((1,), mx.float32) if k_lam is None else k_lam,
                placeholder((1,), mx.float32) if k_signs is None else k_signs,
                1.0 / math.sqrt(dk), sink_k, sink_v, kc, ks, vc, vs, recent_k, recent_v, mask_arr,
                placeholder((1,), mx.int32) if ranges is None else ranges,
                k_mean.astype(mx.float32) if shift else placeholder((1,), mx.float32), params],
        template=[("FT", fp_dtype), ("D", dk), ("QB", qb), ("TGP", tgp)],
        grid=(32, n_parts, B * n_kv * nqc),
        threadgroup=(32, tgp, 1),
        output_shapes=[(B * n_kv * nqc, n_groups, qb, dv), (B * n_kv * nqc, n_groups, qb, 2),
                       (B * n_kv * nqc, qb) if shift else (1,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )

    has_sinks, has_mean, unrotate = sinks is not None, v_mean is not None, v_signs is not None
    sink_logits, per_head = _sink_logits(sinks, B, n_q, L) if has_sinks else (placeholder((1,), mx.float32), False)
    n_rows = B * n_q * L
    (out,) = launcher.launch(
        _merge_kernel(),
        inputs=[part_o, part_ml,
                sink_logits,
                v_mean if has_mean else placeholder((1,), mx.float32),
                v_signs if unrotate else placeholder((1,), mx.float32),
                1.0 / math.sqrt(dv), part_shift,
                # the merge's "parts" are pass 1's threadgroups: [P_F / TGP, P / TGP) the packed ones
                mx.array([n_kv, rep, L, n_groups, nqc, qb, has_sinks, has_mean, unrotate, p_fp // tgp,
                          n_groups - p_fp // tgp, per_head, shift], mx.int32)],
        template=[("OutT", out_dtype), ("D", dv)],
        grid=(32, n_rows, 1),
        threadgroup=(32, min(ROWS_PER_THREADGROUP, n_rows), 1),
        output_shapes=[(B, n_q, L, dv)],
        output_dtypes=[out_dtype],
    )
    return out
