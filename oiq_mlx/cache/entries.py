"""Prompt-cache entries: compact, packed copies of OIQ caches, and packed rows shared between them.

mlx-lm's server keeps a copy of a sequence's cache at the end of each prompt segment (a
checkpoint) and when the sequence finishes.  A copy of a live cache would keep what the live
cache holds for its own next steps: spare capacity in every buffer, the block it just packed
still in full precision, the per-layer constants of its quantize pass, and, while
``exact_prefill`` defers packing, the whole prompt in full precision.  :func:`packed_entry`
makes the copy an entry needs instead:

* the prefill ends on the copy (:meth:`~oiq_mlx.cache.OIQKVCache.end_prefill`), never on the
  live cache, so the live sequence goes on exactly as it would have: the copy holds what the
  live cache holds once its own prefill ends at this length;
* every buffer is exactly the rows in use, in arrays of its own (no view keeps a larger buffer
  alive): sinks, the window and the trim reserve in full precision (so a trim within the
  reserve stays exact), the packed rows, the statistics.

A checkpoint is a prefix of the sequence that continues it.  When the checkpoint's packed rows
are bit-identical to the first rows of the longer entry (``positional`` caches: always), the
checkpoint holds them as views of the longer entry's buffers (:func:`share_packed_rows`); when
that entry goes, the checkpoint takes a copy of its own again (:func:`own_packed_rows`).
"""

from __future__ import annotations

import mlx.core as mx

from .batch import detached_copy
from .common import halves


def packed_rows(cache) -> int:
    """Packed rows ``cache`` holds (positions ``[sink_tokens, q_end)``)."""
    if cache.dtype is None:
        return 0
    return max(0, cache.q_end - cache.config.sink_tokens)


def _first_rows(x: mx.array, n: int, axis: int) -> mx.array:
    return x[(slice(None),) * axis + (slice(0, n),)]


def _own(x: mx.array | None, n: int, axis: int) -> mx.array | None:
    """The first ``n`` rows of ``x`` along ``axis`` in a buffer of their own, exactly that size
    (``mx.contiguous`` of a slice copies it unless the slice is the whole buffer already)."""
    return None if x is None else mx.contiguous(_first_rows(x, n, axis))


def packed_entry(cache):
    """A copy of ``cache`` (an :class:`~oiq_mlx.cache.OIQKVCache`) for the prompt cache: packed
    as far as its length packs, in compact buffers of its own, evaluated.  ``cache`` is not
    changed (its prefill, if any, goes on)."""
    entry = detached_copy(cache)
    # what a live cache holds for the call in progress or its next steps, never an entry's
    entry._attend_from = entry._fresh = None
    entry._views = entry._stacked = None
    entry._call_tokens = 0
    if entry.dtype is None:
        return entry
    entry.end_prefill()
    s = entry.config.sink_tokens
    for side in (entry.k, entry.v):
        side.sink = _own(side.sink, min(s, entry.offset), 2)
    # the full-precision rows an entry keeps: the window and the trim reserve; the block the
    # live cache packed last (kept until its next step) is dropped
    keep = max(entry.recent_start, entry.q_end - entry.reserve)
    drop, used = keep - entry.recent_start, entry.offset - entry.recent_start
    if entry._kv_recent is not None:
        entry._kv_recent = _own(entry._kv_recent[:, :, :, drop:], max(0, used - drop), 3)
        entry.k.recent, entry.v.recent = halves(entry._kv_recent)
    elif entry.k.recent is not None:
        for side in (entry.k, entry.v):
            side.recent = _own(side.recent[:, :, drop:], max(0, used - drop), 2)
    if entry.k.recent is not None:
        entry.recent_start = keep
    own_packed_rows(entry)
    return entry


def own_packed_rows(cache) -> None:
    """Make ``cache`` hold its packed rows in buffers of its own, exactly its rows (a copy when
    they are views of a larger buffer, e.g. another entry's)."""
    n = packed_rows(cache)
    bufs = cache.packed_buffers()
    if n == 0 or all(b is None for b in bufs):
        cache.set_packed_buffers(None)
    else:
        cache.set_packed_buffers([_own(b, n, 3) for b in bufs])
    _materialize(cache)


def packed_nbytes(cache) -> int:
    """Bytes of ``cache``'s packed rows (what a cache sharing them does not hold itself)."""
    return sum(b.nbytes for b in cache.packed_buffers() if b is not None)


def packed_rows_match(short, long) -> bool:
    """True when ``short``'s packed rows are bit for bit the first packed rows of ``long``
    (two OIQ caches of one layer and config), so that ``short`` can hold views of them."""
    n = packed_rows(short)
    if (n == 0 or packed_rows(long) < n or short.config != long.config or short.layer_idx != long.layer_idx
            or short.dtype != long.dtype or short.batch_heads != long.batch_heads
            or short.packed_layout() != long.packed_layout()):
        return False
    pairs = list(zip(short.packed_buffers(), long.packed_buffers()))
    if any(a is None or b is None for a, b in pairs):
        return False
    return all(mx.array_equal(_first_rows(a, n, 3), _first_rows(b, n, 3)).item() for a, b in pairs)


def share_packed_rows(short, long) -> None:
    """Make ``short`` hold its packed rows as views of ``long``'s (check
    :func:`packed_rows_match` first): its own buffers are dropped.

    Each view is a slice of an array ``long`` holds, evaluated: MLX serves a slice of an
    evaluated array from its buffer, where a reshape of a slice (``halves``, ``x[0]``) would
    be evaluated into a copy."""
    n = packed_rows(short)
    short.set_packed_buffers(None)
    if long._kv_rows is not None:
        short._kv_rows = long._kv_rows[:, :, :, :n]
    short.k.rows, short.v.rows = long.k.rows[:, :, :n], long.v.rows[:, :, :n]
    _materialize(short)


def _materialize(cache) -> None:
    """Evaluate every array ``cache`` holds, views included, so that none stays a lazy graph."""
    held = [a for a in (cache._kv_rows, cache._kv_recent) if a is not None]
    mx.eval(held + cache.k.arrays() + cache.v.arrays())
    cache._views = None


def float16_model_nbytes(cache) -> int:
    """:attr:`~oiq_mlx.cache.OIQKVCache.nbytes` with the full-precision rows (sinks, window,
    reserve: the model's dtype) counted at 2 bytes a value: what the cache holds for a float16
    model (a Mac's usual) when this machine ran the model in float32."""
    total = cache.nbytes
    rows = [cache._kv_recent] if cache._kv_recent is not None else [cache.k.recent, cache.v.recent]
    for a in [*rows, cache.k.sink, cache.v.sink]:
        if a is not None:
            total += a.size * 2 - a.nbytes
    return total
