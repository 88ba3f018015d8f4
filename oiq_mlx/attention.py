"""OIQ attention over an :class:`~oiq_mlx.cache.OIQKVCache`.

``q . k == r(q) . r(k)`` and ``sum_i p_i v_i == r^-1(sum_i p_i r(v_i))``
(DESIGN section 2): the query is rotated once, scores are taken against the
stored rotated keys, values are accumulated in the rotated domain and the
output is un-rotated once.  Keys are never un-rotated.

Two reference paths (plain MLX ops), picked by the number of queries:

* decode (``L <= DECODE_MAX_QUERIES``): scores of the full-precision segments
  by matmul and of the packed segment by ``mx.quantized_matmul`` on the codes
  (no float copy of the quantized cache is made); one softmax over all
  segments, which is the log-sum-exp merge of their partial results done in
  one step;
* prefill: the packed segment is dequantized for this layer only and
  ``mx.fast.scaled_dot_product_attention`` runs on the rotated K/V, so peak
  memory stays that of the full-precision cache of one layer.

Both read :meth:`OIQKVCache.attention_segments`: the tokens of the current
call are attended in full precision even when the call already quantized
some of them (a prompt longer than the window), so prefill is exact.
"""

from __future__ import annotations

import mlx.core as mx

from . import dispatch
from .cache import pad_last
from .codec import affine_biases
from .dispatch import DECODE_MAX_QUERIES


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
    q = pad_last(queries.astype(mx.float32) * scale, k.dim)
    if k.lam is not None:
        q = (q.reshape(B, n_kv, n_q // n_kv, L, k.dim) * mx.expand_dims(k.lam, 2)).reshape(B, n_q, L, k.dim)
    q = k.rotate(q)
    segments = cache.attention_segments()
    cache.release_fresh()
    fused = dispatch.decode_attention_kernel(cache, q, mask, sinks, unrotate=True, segments=segments)
    if fused is not None:
        return fused[..., : v.head_dim].astype(queries.dtype)
    if L <= DECODE_MAX_QUERIES:
        out = _decode_reference(q, cache, mask, sinks, segments)
    else:
        out = _prefill_reference(q, cache, mask, sinks, segments)
    if v.mean is not None:
        out = out + mx.repeat(v.mean, n_q // n_kv, axis=1)
    out = v.unrotate(out)[..., : v.head_dim]
    return out.astype(queries.dtype)


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


def _decode_reference(q: mx.array, cache, mask, sinks, segments=None) -> mx.array:
    """Few queries over ``segments`` (default ``cache.attention_segments()``):
    returns rotated outputs ``(B, n_q, L, v_dim)`` (centered)."""
    B, n_q, L, dq = q.shape
    k, v, gs = cache.k, cache.v, cache.config.group_size
    sink_k, sink_v, quant, recent_k, recent_v = cache.attention_segments() if segments is None else segments
    n_kv = k.sink.shape[1]
    rep = n_q // n_kv
    qg = q.reshape(B, n_kv, rep, L, dq)
    parts = []
    if sink_k is not None:
        parts.append(qg @ mx.expand_dims(sink_k.astype(mx.float32), 2).swapaxes(-1, -2))
    if quant is not None:
        kc, ks, vc, vs = quant
        ks = ks.astype(mx.float32)
        parts.append(
            mx.quantized_matmul(
                qg, kc[:, :, None], ks[:, :, None], affine_biases(ks, k.bits)[:, :, None],
                transpose=True, group_size=gs, bits=k.bits,
            )
        )
    if recent_k is not None:
        parts.append(qg @ mx.expand_dims(recent_k.astype(mx.float32), 2).swapaxes(-1, -2))
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    T = scores.shape[-1]
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
            sink_logits = sink_logits - mx.sum(qg * mx.expand_dims(k.mean, 2), axis=-1, keepdims=True)
        scores = mx.concatenate([sink_logits, scores], axis=-1)
        p = mx.softmax(scores, axis=-1, precise=True)[..., 1:]
    else:
        p = mx.softmax(scores, axis=-1, precise=True)
    out = 0.0
    i = 0
    if sink_v is not None:
        n = sink_v.shape[2]
        out = out + p[..., i : i + n] @ mx.expand_dims(sink_v.astype(mx.float32), 2)
        i += n
    if quant is not None:
        n = vc.shape[2]
        vs = vs.astype(mx.float32)
        out = out + mx.quantized_matmul(
            p[..., i : i + n], vc[:, :, None], vs[:, :, None], affine_biases(vs, v.bits)[:, :, None],
            transpose=False, group_size=gs, bits=v.bits,
        )
        i += n
    if recent_v is not None:
        out = out + p[..., i:] @ mx.expand_dims(recent_v.astype(mx.float32), 2)
    return out.reshape(B, n_q, L, v.dim)


def _prefill_reference(q: mx.array, cache, mask, sinks, segments=None) -> mx.array:
    """Many queries over ``segments`` (default ``cache.attention_segments()``):
    dequantize this layer's packed segment, fused SDPA."""
    k, v, gs = cache.k, cache.v, cache.config.group_size
    sink_k, sink_v, quant, recent_k, recent_v = cache.attention_segments() if segments is None else segments
    ks_, vs_ = [], []
    if sink_k is not None:
        ks_.append(sink_k), vs_.append(sink_v)
    if quant is not None:
        kc, ksc, vc, vsc = quant
        ks_.append(dispatch.dequantize(kc, ksc, k.bits, gs, dtype=cache.dtype))
        vs_.append(dispatch.dequantize(vc, vsc, v.bits, gs, dtype=cache.dtype))
    if recent_k is not None:
        ks_.append(recent_k), vs_.append(recent_v)
    keys = mx.concatenate(ks_, axis=2) if len(ks_) > 1 else ks_[0]
    values = mx.concatenate(vs_, axis=2) if len(vs_) > 1 else vs_[0]
    if sinks is not None and k.mean is not None:
        # the sink logit is not shifted like the scores of centered keys: undo the centering
        keys = (keys + k.mean).astype(cache.dtype)
    compute = cache.dtype
    return mx.fast.scaled_dot_product_attention(
        q.astype(compute), keys, values, scale=1.0, mask=mask, sinks=sinks
    )


def oiq_batch_attention(queries: mx.array, cache, scale: float, mask=None, sinks=None) -> mx.array:
    """Attention of a batch over a :class:`~oiq_mlx.batch_cache.BatchOIQKVCache`.

    Each sequence attends over its own cache with :func:`oiq_attention` and
    its row of ``mask`` (``(B, 1, L, T)``, its keys right-aligned in the last
    ``offset`` columns; None: every key).  A sequence whose cache is still
    empty (only padding in this step) gets zeros, which nothing reads.

    Returns ``(B, n_q_heads, L, v_head_dim)`` in ``queries.dtype``.
    """
    B, n_q, L, _ = queries.shape
    if B != len(cache.caches):
        raise ValueError(f"queries hold {B} sequences, the cache {len(cache.caches)}")
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
