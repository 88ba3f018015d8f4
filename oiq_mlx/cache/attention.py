"""OIQ attention over an :class:`~oiq_mlx.cache.OIQKVCache`.

The window and sinks hold keys and values as the model gave them, minus the
side's mean (``k - m``); the packed segment holds ``r((k - m) / lam)`` (DESIGN.md
sections 2 and 5).  So the window is scored with the query as given and the
packed segment with ``r(q * lam)``: both give ``q . (k - m)``, one constant
``q . m`` away from ``q . k`` for every key of a query, which softmax ignores.
Values: the packed segment's share of the output is un-rotated once, and the
value mean added once (the weights sum to 1).

Two reference paths (plain MLX ops), picked by the number of queries:

* decode (``L <= DECODE_MAX_QUERIES``): scores of the full-precision segments
  by matmul and of the packed segment by ``mx.quantized_matmul`` on the codes
  (no float copy of the quantized cache is made); one softmax over all
  segments; the elementwise steps are compiled.  On the CPU, values of 2, 3,
  5 or 6 bits are first repacked to 4 or 8 bits (``codec.repack_codes``:
  the same codes, a few fused passes), the widths MLX's CPU kernel reads
  several times faster, as are 3-, 5- and 6-bit keys at short lengths (a
  sequence cache keeps the copies: ``cpu_codes``), and the packed keys of a
  KV head with several query rows are dequantized a bounded chunk at a time
  and multiplied once they are many, which costs less than MLX's CPU kernel
  scoring each query row on its own (DESIGN.md section 5);
* prefill: the packed segment is dequantized into the window's domain for
  this layer only and ``mx.fast.scaled_dot_product_attention`` runs on the
  keys/values, so peak memory stays that of the full-precision cache of one
  layer.

Both read :meth:`OIQKVCache.attention_segments`: the tokens of the current
call are attended in full precision even when the call already quantized
some of them (a prompt longer than the window), so prefill is exact.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..kernels import dispatch
from ..core import fp4, rotation
from .common import halves, pad_last
from ..core.codec import CPU_REPACK_BITS, SUPPORTED_BITS, dequantize_repacked, repack_codes
from ..kernels import selftest
from ..kernels.decode_attention import OUT_DTYPES, decode_attention, query_rows_per_chunk

# queries per step up to which attention takes the decode path (kernel or reference)
DECODE_MAX_QUERIES = 8

_ONE = mx.array(1.0, mx.float32)
_ZERO = mx.array(0.0, mx.float32)
# The CPU reference path scores packed keys by dequantizing them (:func:`_cpu_scores`) when a KV
# head has at least CPU_SCORE_MIN_QUERIES query rows and the query rows times the packed key values
# reach CPU_SCORE_MIN_WORK: MLX's quantized_matmul costs about that product, the dequantization
# about the values alone (2 cores, 5-bit keys, 3 heads x 64: 3 query rows even at 256 rows, 24 rows
# at 128 rows 1.1 ms against 0.36; 1 row 0.29 against 0.55 at 1024 rows).  786k: a one-token step
# of 3 query rows per KV head from 1365 packed rows at SmolLM2's shapes (a whole SmolLM2 decode step
# at 512 tokens ran slower below it), a chunk of 8 tokens from 171.  At most CPU_SCORE_VALUES
# values at a time: a bound on the float32 copy, 4 MiB
CPU_SCORE_MIN_QUERIES = 2
CPU_SCORE_MIN_WORK = 3 << 18
CPU_SCORE_VALUES = 1 << 20
# -(2^b - 1) / 2 for each bits: the affine bias of a group is this times its scale
_HALF = {b: mx.array(-((1 << b) - 1) / 2, mx.float32) for b in SUPPORTED_BITS}


@functools.partial(mx.compile, shapeless=True)
def _prepare_queries(q, scale, lam, signs):
    """``q * scale`` (for the full-precision segments) and ``q * scale * lam * signs``
    (to be Hadamard-transformed for the packed segment), float32."""
    qs = q.astype(mx.float32) * scale
    return qs, qs * lam * signs


@functools.partial(mx.compile, shapeless=True)
def _affine(scales, half):
    """float32 scales and ``mx.quantized_matmul`` biases (``half`` times the scale) of
    packed rows from their float16 scales: one fused pass with two outputs."""
    s = scales.astype(mx.float32)
    return s, s * half


@functools.lru_cache(maxsize=None)
def _combine(dtype):
    """Output: the sinks' and the window's shares + the un-rotated packed share
    (signs) + the value mean, in one elementwise pass."""

    def combine(sink, window, packed, signs, mean):
        return (sink + window + packed * signs + mean).astype(dtype)

    return mx.compile(combine, shapeless=True)


def oiq_attention(queries: mx.array, cache, scale: float, mask=None, sinks=None) -> mx.array:
    """Attention of ``queries`` over everything ``cache`` holds.

    Args:
        queries: ``(B, n_q_heads, L, head_dim)``.
        cache: an OIQKVCache that already received this step's keys/values.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        mask: None, ``"causal"`` or an array broadcastable to
            ``(B, n_q_heads, L, offset)`` (bool, or additive).
        sinks: optional per-head attention-sink logits ``(n_q_heads,)``.

    Returns:
        ``(B, n_q_heads, L, v_head_dim)`` in ``queries.dtype``.
    """
    B, n_q, L, d = queries.shape
    k, v = cache.k, cache.v
    if cache.empty():
        raise ValueError("the cache holds nothing: call cache.update_and_fetch(keys, values) before attention")
    if d != k.head_dim:
        raise ValueError(f"queries have head_dim {d}, the cache holds keys of dimension {k.head_dim}")
    n_kv = k.sink.shape[1]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads cannot share {n_kv} KV heads")
    if sinks is not None and v.mean is not None:
        raise ValueError("attention sinks cannot be combined with center_values=True")
    if L == 0:
        cache.release_fresh()
        return mx.zeros((B, n_q, 0, v.head_dim), queries.dtype)
    if cache.offset == 0:
        raise ValueError(f"{L} queries have no key to attend to: the cache holds 0 tokens")
    segments = cache.attention_segments()
    mask = cache.positional_mask(mask, L)
    cache.release_fresh()
    fused = decode_attention_kernel(cache, queries, scale, mask, sinks, segments=segments, out_dtype=queries.dtype)
    if fused is not None:
        return fused[..., : v.head_dim]  # the merge kernel wrote the queries' dtype
    return reference_output(queries, cache, scale, mask, sinks, segments)[..., : v.head_dim].astype(queries.dtype)


def reference_output(queries: mx.array, cache, scale: float, mask, sinks, segments) -> mx.array:
    """The reference path of :func:`oiq_attention` over ``segments``: ``(B, n_q, L, v.dim)``
    float32 (what the decode kernels return too); many queries (a prompt's) in the cache
    dtype, as ``scaled_dot_product_attention`` gives them."""
    k, v = cache.k, cache.v
    B, n_q, L, _ = queries.shape
    n_kv = k.sink.shape[1]
    rep = n_q // n_kv
    mean = _ZERO if v.mean is None else mx.expand_dims(v.mean, 2).reshape(B, n_kv, 1, 1, v.dim)
    if L > DECODE_MAX_QUERIES:
        out = _prefill_reference(pad_last(queries, k.dim), scale, cache, mask, sinks, segments)
        if v.mean is None:
            return out
        return (out.reshape(B, n_kv, rep, L, v.dim) + mean).reshape(B, n_q, L, v.dim)
    q = pad_last(queries, k.dim).reshape(B, n_kv, rep, L, k.dim)
    lam = _ONE if k.lam is None else mx.expand_dims(k.lam, 2)
    qs, qr = _prepare_queries(q, scale, lam, k.signs if k.rotated else _ONE)
    if k.rotated:
        qr = rotation.hadamard(qr)
    qs, qr = qs.reshape(B, n_q, L, k.dim), qr.reshape(B, n_q, L, k.dim)
    sink, window, packed = _decode_reference(qs, qr, cache, mask, sinks, segments)
    if packed is not None and v.rotated:
        packed = rotation.hadamard(packed, transpose=True)
    out = _combine(mx.float32)(*(_ZERO if x is None else x.reshape(B, n_kv, rep, L, v.dim)
                                 for x in (sink, window, packed)),
                               v.signs if v.rotated else _ONE, mean)
    return out.reshape(B, n_q, L, v.dim)


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


def decode_attention_kernel(cache, queries: mx.array, scale: float, mask, sinks, *, segments=None,
                            ranges=None, out_dtype=mx.float32):
    """Fused decode attention over ``cache`` when a kernel serves this call, else None
    (the caller runs the reference path).

    Args:
        cache: an OIQKVCache holding at least one token.
        queries: ``(B, n_q, L, head_dim)`` as the model gives them; L <= 8.
        scale, mask, sinks: as for ``attention.oiq_attention``.
        segments: what to attend to (default ``cache.attention_segments()``).
        ranges: each sequence's rows of a stacked batch (``decode_attention``'s ``ranges``), or None.
        out_dtype: the dtype the merge kernel writes (float16, bfloat16, float32; another
            declines the kernel).

    Returns:
        ``(B, n_q, L, v.dim)`` in ``out_dtype`` (slice to ``v.head_dim``), or None.
    """
    if cache.config.storage != "int":
        # the kernels decode integer codes: an fp4 cache (MXFP4 / NVFP4) always takes the reference
        # path, whose mx.quantized_matmul(mode=) MLX runs natively on every backend
        return None
    if not dispatch.kernels_enabled() or not isinstance(queries, mx.array) or queries.ndim != 4:
        return None
    if out_dtype not in OUT_DTYPES:
        return None
    k, v, cfg = cache.k, cache.v, cache.config
    B, n_q, L, dq = queries.shape
    if cache.offset == 0 or L > DECODE_MAX_QUERIES or dq != k.head_dim:
        return None
    if k.dim != v.dim or not dispatch.codec_shape_ok(k.dim, k.bits, cfg.group_size) \
            or not dispatch.codec_shape_ok(v.dim, v.bits, cfg.group_size):
        return None
    n_kv = k.sink.shape[1]
    segments = cache.attention_segments() if segments is None else segments
    if n_q % n_kv or not _mask_ok(mask, (B, n_q, L, _columns(segments))):
        return None
    if isinstance(mask, str) and L > 1 and cache.offset < L:
        return None
    if sinks is not None and (not isinstance(sinks, mx.array) or sinks.shape != (n_q,)):
        return None
    if not selftest.attention_ok(cache.dtype, k.dim, query_rows_per_chunk(n_q // n_kv * L, k.dim), out_dtype):
        return None
    q = queries if queries.dtype == cache.dtype else queries.astype(cache.dtype)
    if dq != k.dim:
        q = mx.pad(q, [(0, 0)] * 3 + [(0, k.dim - dq)])
    # centered keys shift every score by -scale * q . mean; a sink logit follows them, which the
    # kernels compute themselves (k_mean): no dispatch of its own
    return decode_attention(
        q, scale=scale, segments=segments,
        k_bits=k.bits, v_bits=v.bits, group_size=cfg.group_size, k_lam=k.lam,
        k_signs=k.signs if k.rotated else None, mask=mask, sinks=sinks, v_mean=v.mean,
        v_signs=v.signs if v.rotated else None, ranges=ranges, k_mean=k.mean if sinks is not None else None,
        out_dtype=out_dtype,
    )


def _columns(segments) -> int:
    """Key columns of ``segments`` (sinks, packed, full precision), the mask's last axis."""
    sink_k, _, quant, recent_k, _ = segments
    return sum(x.shape[2] for x in (sink_k, None if quant is None else quant[0], recent_k) if x is not None)


def _gqa_mask(mask, n_kv: int, rep: int, L: int, T: int):
    """Bring ``mask`` to a shape broadcastable to ``(B, n_kv, rep, L, T)``."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        if L == 1:
            return None
        return mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask.ndim == 4 and mask.shape[1] != 1:
        return mask.reshape(mask.shape[0], n_kv, rep, *mask.shape[2:])
    if mask.ndim == 4:
        return mx.expand_dims(mask, 2)
    return mask


def _cpu_scores(q: mx.array, codes: mx.array, scales: mx.array, bits: int, group_size: int) -> mx.array:
    """``q @ dequantize(codes, scales).T``, float32 ``(..., M, n)``: the packed keys dequantized
    (``codec.dequantize_repacked``) a chunk of rows at a time, at most :data:`CPU_SCORE_VALUES`
    values, and multiplied.  MLX's CPU ``quantized_matmul(transpose=True)`` dequantizes every row
    once per query row (a GQA group's several queries cost several times one), at every width;
    this dequantizes once for all of them and lets a float matmul take the rest."""
    *lead, n, nw = codes.shape
    per_row = nw * 32 // bits
    for x in lead:
        per_row *= x
    step = 1 << max(6, (CPU_SCORE_VALUES // per_row).bit_length() - 1)
    parts = []
    for i in range(0, n, step):
        # one chunk's float copy at a time, made once this layer's queries are: the first chunk
        # waits for them, each next one for the product of the one before (else MLX may dequantize
        # the packed keys of several chunks, and layers, at once: 47 MiB over a SmolLM2 step at
        # 8k tokens where one at a time takes 10)
        chunk = mx.depends(codes[..., i : i + step, :], parts[-1] if parts else q)
        keys = dequantize_repacked(chunk, scales[..., i : i + step, :], bits, group_size)
        parts.append(q @ keys.swapaxes(-1, -2))
    return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def _decode_reference(qs: mx.array, qr: mx.array, cache, mask, sinks, segments=None):
    """Few queries over ``segments`` (default ``cache.attention_segments()``).

    ``qs``: queries times the softmax scale; ``qr``: the same times the key scales,
    rotated (what the packed keys are scored with); both ``(B, n_q, L, k_dim)``.
    Returns ``(sink, window, packed)``, each ``(B, n_kv, rep * L, v_dim)`` float32 or
    None: the shares of the output of the sinks and the window (centered) and
    of the packed segment (still rotated).
    """
    B, n_q, L, dq = qs.shape
    k, v, gs = cache.k, cache.v, cache.config.group_size
    sink_k, sink_v, quant, recent_k, recent_v = cache.attention_segments() if segments is None else segments
    n_kv = k.sink.shape[1]
    rep = n_q // n_kv
    # a KV head's rep x L queries as the rows of one matrix: every product is a plain batched
    # matmul over (B, n_kv) against the stored arrays as they are (no broadcast axis, which the
    # CPU backend's quantized matmul serves markedly slower)
    qg = qs.reshape(B, n_kv, rep * L, dq)
    parts = []
    if sink_k is not None:
        parts.append(qg @ sink_k.swapaxes(-1, -2))
    mode = cache.config.storage  # "int", or the fp4 mode of the packed rows
    on_cpu = mx.default_device() == mx.cpu
    # a sequence cache keeps codes repacked for MLX's CPU kernel (values, and 3/5/6-bit keys), which
    # reads them faster at 4 or 8 bits; a stacked batch repacks its values every step
    cpu_codes = getattr(cache, "cpu_codes", None) if on_cpu else None
    if quant is not None and mode != "int":
        kc, ks, vc, vs = quant
        parts.append(mx.quantized_matmul(qr.reshape(B, n_kv, rep * L, dq), kc, ks, transpose=True, group_size=gs,
                                         bits=4, mode=mode))
    elif quant is not None:
        kc, ks, vc, vs = quant
        qk = qr.reshape(B, n_kv, rep * L, dq)
        dequantized = on_cpu and rep * L >= CPU_SCORE_MIN_QUERIES \
            and rep * L * (kc.size * 32 // k.bits) >= CPU_SCORE_MIN_WORK
        pair = cache.packed_scales(kc.shape[2]) if k.bits == v.bits else None
        if pair is not None:
            # keys' and values' scales share one buffer: one conversion for both
            (ks, vs), (kb, vb) = (halves(x) for x in _affine(pair, _HALF[k.bits]))
        elif dequantized:
            vs, vb = _affine(vs, _HALF[v.bits])  # the keys' dequantization converts their scales itself
        else:
            (ks, kb), (vs, vb) = _affine(ks, _HALF[k.bits]), _affine(vs, _HALF[v.bits])
        if dequantized:
            parts.append(_cpu_scores(qk, kc, ks, k.bits, gs))
        else:
            kc, bits = (kc, k.bits) if cpu_codes is None else cpu_codes("k", kc)
            parts.append(mx.quantized_matmul(qk, kc, ks, kb, transpose=True, group_size=gs, bits=bits))
    if recent_k is not None:
        parts.append(qg @ recent_k.swapaxes(-1, -2))
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    T = scores.shape[-1]
    scores = scores.reshape(B, n_kv, rep, L, T)
    m = _gqa_mask(mask, n_kv, rep, L, T)
    if m is not None:
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, -mx.inf)
        else:
            scores = scores + m.astype(mx.float32)
    if sinks is not None:
        sink_logits = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, n_kv, rep, 1, 1), (B, n_kv, rep, L, 1))
        if k.mean is not None:
            # centered keys shift every score by -q.mean; the sink logit must follow
            qm = qg.reshape(B, n_kv, rep, L, dq) * mx.expand_dims(k.mean, 2)
            sink_logits = sink_logits - mx.sum(qm, axis=-1, keepdims=True)
        scores = mx.concatenate([sink_logits, scores], axis=-1)
        p = mx.softmax(scores, axis=-1, precise=True)[..., 1:]
    else:
        p = mx.softmax(scores, axis=-1, precise=True)
    p = p.reshape(B, n_kv, rep * L, T)
    sink = window = packed = None
    i = 0
    if sink_v is not None:
        n = sink_v.shape[2]
        sink = p[..., i : i + n] @ sink_v
        i += n
    if quant is not None:
        n = vc.shape[2]
        if mode != "int":
            packed = mx.quantized_matmul(p[..., i : i + n], vc, vs, transpose=False, group_size=gs, bits=4,
                                         mode=mode)
        else:
            bits = v.bits
            if bits in CPU_REPACK_BITS and on_cpu:
                # MLX's CPU kernel reads 1/2/3/5/6-bit rows this way several times more slowly than
                # 4/8-bit ones: the same codes repacked cost a few fused passes
                if cpu_codes is not None:
                    vc, bits = cpu_codes("v", vc)
                else:
                    vc, bits = repack_codes(vc, bits, CPU_REPACK_BITS[bits]), CPU_REPACK_BITS[bits]
            packed = mx.quantized_matmul(p[..., i : i + n], vc, vs, vb, transpose=False, group_size=gs, bits=bits)
        i += n
    if recent_v is not None:
        window = p[..., i:] @ recent_v
    return sink, window, packed


def _prefill_reference(queries: mx.array, scale: float, cache, mask, sinks, segments=None) -> mx.array:
    """Many queries over ``segments`` (default ``cache.attention_segments()``): the packed
    segment dequantized into the window's domain for this layer, fused SDPA with the softmax
    scale given to it (as ``KVCache`` attention: no scaled copy of the queries).  Returns the
    centered output in the cache dtype."""
    k, v, gs = cache.k, cache.v, cache.config.group_size
    sink_k, sink_v, quant, recent_k, recent_v = cache.attention_segments() if segments is None else segments
    ks_, vs_ = [], []
    if sink_k is not None:
        ks_.append(sink_k), vs_.append(sink_v)
    if quant is not None:
        kc, ksc, vc, vsc = quant
        mode = cache.config.storage
        if mode != "int":
            ks_.append(k.packed_to_window(fp4.dequantize(kc, ksc, mode)).astype(cache.dtype))
            vs_.append(v.packed_to_window(fp4.dequantize(vc, vsc, mode)).astype(cache.dtype))
        else:
            ks_.append(k.packed_to_window(dispatch.dequantize(kc, ksc, k.bits, gs)).astype(cache.dtype))
            vs_.append(v.packed_to_window(dispatch.dequantize(vc, vsc, v.bits, gs)).astype(cache.dtype))
    if recent_k is not None:
        ks_.append(recent_k), vs_.append(recent_v)
    keys = mx.concatenate(ks_, axis=2) if len(ks_) > 1 else ks_[0]
    values = mx.concatenate(vs_, axis=2) if len(vs_) > 1 else vs_[0]
    if sinks is not None and k.mean is not None:
        # the sink logit is not shifted like the scores of centered keys: undo the centering
        keys = (keys + k.mean).astype(cache.dtype)
    return mx.fast.scaled_dot_product_attention(queries.astype(cache.dtype), keys, values, scale=scale, mask=mask,
                                                sinks=sinks)



def oiq_batch_attention(queries: mx.array, cache, scale: float, mask=None, sinks=None) -> mx.array:
    """Attention of a batch over a :class:`~oiq_mlx.cache.batch.BatchOIQKVCache`.

    Each sequence attends over its own cache with :func:`oiq_attention` and
    its row of ``mask`` (``(B, 1, L, T)``, its keys right-aligned in the last
    ``offset`` columns; None: every key).  A sequence whose cache is still
    empty (only padding in this step) gets zeros, which nothing reads.

    Returns ``(B, n_q_heads, L, v_head_dim)`` in ``queries.dtype``.
    """
    B, n_q, L, _ = queries.shape
    if B != len(cache.caches):
        raise ValueError(f"queries hold {B} sequences, the cache {len(cache.caches)}")
    if cache.stacked is not None:
        if mask is None:
            return _stacked_attention(queries, cache.stacked, scale, sinks)
        cache.unstack()  # a mask of mlx-lm's: each sequence with its own slice of it
    filled = [c for c in cache.caches if not c.empty()]
    if not filled:
        raise ValueError("attention over a batch whose caches are all empty")
    v_dim = filled[0].v.head_dim
    outs = []
    for i, c in enumerate(cache.caches):
        if c.empty():
            outs.append(mx.zeros((1, n_q, L, v_dim), queries.dtype))
            continue
        m = None if mask is None else mask[i : i + 1, ..., mask.shape[-1] - c.offset :]
        outs.append(oiq_attention(queries[i : i + 1], c, scale=scale, mask=m, sinks=sinks))
    return mx.concatenate(outs, axis=0) if B > 1 else outs[0]


def _stacked_attention(queries: mx.array, stacked, scale: float, sinks) -> mx.array:
    """One decode step of a batch over storage stacked across its sequences
    (:class:`oiq_mlx.cache.stacked.StackedDecode`): the kernel or reference path of one cache,
    with the mask that shows each sequence only its own rows."""
    v = stacked.v
    if sinks is not None and v.mean is not None:
        raise ValueError("attention sinks cannot be combined with center_values=True")
    segments, mask, ranges = stacked.attention_segments()
    stacked.release()
    # the kernel reads each sequence's own rows (ranges), the reference path masks the others
    fused = decode_attention_kernel(stacked, queries, scale, None, sinks, segments=segments, ranges=ranges,
                                    out_dtype=queries.dtype)
    if fused is not None:
        return fused[..., : v.head_dim]
    return reference_output(queries, stacked, scale, mask, sinks, segments)[..., : v.head_dim].astype(queries.dtype)
