"""OIQKVCache: an mlx-lm KV cache that stores rotated, quantized keys and values.

Token positions of one layer fall into three segments, in temporal order:

* ``[0, S)``: sink tokens, full precision (``sink_tokens``);
* ``[S, q_end)``: packed rows of the rotated vectors, codes then float16 group
  scales in one uint32 row per vector (``codec.join_rows``; DESIGN.md section 3);
* ``[q_end, offset)``: the recent window, full precision (``window`` to
  ``window + block - 1`` tokens, see :meth:`OIQKVCache.packed_end`; everything
  while ``offset <= quantize_after``).

The full-precision segments hold the vectors as the model gave them, minus the
side's mean (with centering), in the model dtype: not rotated, so a decode step
appends like mlx-lm's ``KVCache`` and only rows that get packed are rotated, in
one quantize pass per block (DESIGN.md section 5).  Attention scores the window
with the query as given and the packed segment with the rotated query, and
un-rotates only the packed segment's share of the output (``attention.py``).
The full-precision buffer also keeps ``trim_reserve`` tokens (rounded up to
whole blocks) that were already quantized, so ``trim`` of up to that many
tokens restores the exact state a cache that never saw them has.
Keys and values of equal width share buffers, stacked on a new first axis
(``cache.k`` / ``cache.v`` hold views), so a step writes the window once and a
packed block once (DESIGN.md section 5).
Attention reads :meth:`OIQKVCache.attention_segments`, in which the rows the
current ``update_and_fetch`` found in the window, and its own rows, are full
precision even when the call already packed them.

Cache files: :attr:`OIQKVCache.state` and its checks are in ``files.py``; what attention reads
(:class:`~oiq_mlx.cache.reading.CacheReads`, mixed in) in ``reading.py``; how the prefill ends
and the statistics are estimated (:class:`~oiq_mlx.cache.prefill.PromptPacking`, mixed in) in
``prefill.py``.
"""

from __future__ import annotations

import numbers
import warnings

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..core import fp4
from ..core.codec import bytes_per_token, row_width
from ..core.config import OIQConfig
from ..kernels import dispatch
from .batch import BatchOIQKVCache, detached_copy
from .common import (SELECT_FIRST, ZERO, center_one, center_pair, check_update, expected_signs, grow, halves,
                     kept_rows, pad_last, pair_tables, write_rows)
from .files import cache_state, restore_state
from .prefill import PIECE_ROWS, PromptPacking, eval_now
from .reading import CacheReads
from .side import SideStorage

# Packing more rows than this at once (a prompt) quantizes keys and values one after the other,
# which halves the reference quantizer's temporaries; a decode step's block goes in one pass.
_STACK_MAX_ROWS = 64


class OIQKVCache(PromptPacking, CacheReads, _BaseCache):
    """mlx-lm cache contract (``update_and_fetch``, ``offset``, ``state``,
    ``from_state``, ``trim``, ``make_mask``, ``nbytes``...) over OIQ storage.

    ``update_and_fetch`` returns ``(self, self)``: attention reads the cache
    directly through :func:`oiq_mlx.cache.attention.oiq_attention`, which
    ``oiq_mlx.mlx_lm.routing`` routes mlx-lm's ``scaled_dot_product_attention`` to.
    """

    # the packed buffers' capacity is a multiple of step rows, one block (flush_block): rows
    # are packed in whole blocks (DESIGN.md section 5); mlx-lm's KVCache grows by 256, which
    # at 72 bytes per packed row would be up to 18 KB per KV head and layer unused
    step = 16
    # the packed buffers grow by step rows, or, once they hold growth_from rows, by
    # 1/growth_fraction of them (rounded to whole steps): a growth copies the held rows, so
    # growing by 16 rows would copy every packed row once per 16 tokens (3/16 of a step's ideal
    # bytes); this costs about 64 rows' bytes per step amortized and leaves at most 1/32 of the
    # rows unused (below growth_from rows, 16-row steps keep a short cache tight)
    growth_fraction = 32
    growth_from = 1024
    # the full-precision buffer's capacity is a multiple of recent_step rows: at most
    # window + reserve + one block once a call has ended (DESIGN.md section 5)
    recent_step = 16
    flush_block = 16

    def __init__(self, config: OIQConfig | None = None, *, layer_idx: int = 0, head_dim: int | None = None):
        self.config = config if config is not None else OIQConfig()
        if not isinstance(self.config, OIQConfig):
            raise ValueError(f"config must be an OIQConfig, got {type(self.config).__name__}")
        for name, x, low in (("layer_idx", layer_idx, 0), ("head_dim", 1 if head_dim is None else head_dim, 1)):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {x!r}")
        if head_dim is not None:
            self.config.storage_dim(head_dim)
        self.layer_idx, self.head_dim = int(layer_idx), head_dim  # head_dim: what keys must have, when given
        # which slice of a sharded model this cache belongs to (oiq_mlx.mlx_lm.sharding
        # sets it; saved in state so a saved cache loads only on the same layout)
        self.layout = None
        self.offset = 0
        self.q_end = self.config.sink_tokens
        self.recent_start = self.config.sink_tokens
        self.dtype = None
        # first position the current call attends in full precision (attention_segments), and
        # for a call that packs some of its own rows, those rows in full precision: (keys, values)
        self._attend_from = self._fresh = None
        self._call_tokens = 0  # tokens the latest update_and_fetch wrote
        self._stacked = None
        # keys and values of equal width are stored stacked on a new first axis, (2, B, H,
        # rows, .), and self.k / self.v hold views of them: a decode step writes the window
        # once, and a packed block once (codes and scales joined in one row, codec.join_rows)
        self._kv_recent = self._kv_rows = None
        self._views = None  # memo of _packed_views
        # exact_prefill: the prompt is being prefilled and its rows wait in full precision
        # until the first one-token call (end_prefill)
        self._prefilling = self.config.exact_prefill > 0 and not self.config.positional
        cfg = self.config
        k_bits, v_bits = cfg.bits_for_layer(self.layer_idx)
        self.k = SideStorage(k_bits, cfg.group_size, cfg.clip, cfg.center_keys, cfg.key_scaling, cfg.key_scaling_cap,
                             storage=cfg.storage, which=0)
        self.v = SideStorage(v_bits, cfg.group_size, cfg.clip, cfg.center_values, storage=cfg.storage, which=1)

    # -- writing -----------------------------------------------------------

    def _init_storage(self, keys: mx.array, values: mx.array):
        cfg = self.config
        if cfg.storage != "int" and keys.shape[-1] != values.shape[-1]:
            raise ValueError(f"storage={cfg.storage!r} joins a token's keys and values in one packed row: they "
                             f"need one head dimension, got keys {keys.shape[-1]} and values {values.shape[-1]}")
        self.dtype = keys.dtype
        bh = tuple(keys.shape[:2])
        for which, (side, x) in enumerate(((self.k, keys), (self.v, values))):
            dim = cfg.storage_dim(x.shape[-1])
            side.init(x, expected_signs(cfg, self.layer_idx, which, dim), dim, cfg.rotation != "none")
            # grown as sink tokens arrive (a huge sink_tokens costs only what is held)
            side.sink = mx.zeros((*bh, 0, dim), self.dtype)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``kv_bits`` conversion (``maybe_quantize_kv_cache``): the cache stays itself, and says so."""
        warnings.warn(f"kv_bits={bits} is ignored: OIQ caches are quantized already (K{self.k.bits}V{self.v.bits}"
                      "); set other bits with OIQConfig", stacklevel=2)
        return self

    @property
    def batch_heads(self):
        return tuple(self.k.sink.shape[:2]) if self.k.sink is not None else None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        check_update(self, keys, values)
        if self.dtype is None:
            self._init_storage(keys, values)
        cfg, start, L = self.config, self.offset, keys.shape[2]
        if L == 0:
            # as mlx-lm's KVCache: an empty update stores nothing (and estimates nothing)
            self._attend_from = self._fresh = None
            self._call_tokens = 0
            return self, self
        bh = tuple(keys.shape[:2])
        deferring = self._prefilling and L > 1 and start + L <= cfg.exact_prefill
        if self._prefilling and not deferring:
            self.end_prefill()
        if deferring and start == 0 and cfg.sink_tokens:
            # the prompt waits in one buffer from position 0, its sinks included: a prefill call
            # attends that buffer as it is (attention_segments), not a copy of it joined to the
            # sinks; end_prefill copies the sinks out and moves the buffer's start past them
            self.recent_start = 0
        # rows from here on (the window as this call finds it, and the call's own rows) are
        # attended in full precision by this call's queries, even those the call packs
        self._attend_from = found = max(self.q_end, cfg.sink_tokens)
        self._fresh = found_rows = None
        packs_own = not deferring and self.packed_end(start + L) > start
        if packs_own and start > found:
            # a call that packs some of its own rows (a prompt, a chunk): the rows it found in
            # the window are kept aside (views of the buffer as it is now), its own rows are
            # attended from its input, and the buffer drops what it packs right away
            a, b = found - self.recent_start, start - self.recent_start
            found_rows = (self.k.recent[:, :, a:b], self.v.recent[:, :, a:b])
        n_sink = max(0, min(cfg.sink_tokens, start + L) - start)
        skip = n_sink if self.recent_start >= cfg.sink_tokens else 0  # rows the window buffer leaves to the sinks
        if L > skip:
            self._reserve_recent(start + L, bh)
        k_rows, v_rows, both = self._to_window(keys, values, n_sink, estimate=not deferring)
        if packs_own:
            cut = max(start, cfg.sink_tokens) - start  # sinks are stored exactly already
            own = (k_rows[:, :, cut:], v_rows[:, :, cut:])
            self._fresh = own if found_rows is None else tuple(
                mx.concatenate([f, o], axis=2) for f, o in zip(found_rows, own))
        for side, y in ((self.k, k_rows), (self.v, v_rows)):
            if n_sink and skip:
                side.sink = grow(side.sink, start, start + n_sink, self.step, (side.dim,), self.dtype, bh,
                                  limit=cfg.sink_tokens)
                side.sink = write_rows(side.sink, start, y[:, :, :n_sink])
        if L > skip:
            a = start + skip - self.recent_start
            if self._kv_recent is not None:
                if both is not None:
                    # keys and values stacked: one write, as KVCache's one per side
                    self._kv_recent[:, :, :, a : a + L - skip] = both[:, :, :, skip:]
                else:
                    for i, y in enumerate((k_rows, v_rows)):
                        self._kv_recent[i : i + 1, :, :, a : a + L - skip] = y[None, :, :, skip:]
                self.k.recent, self.v.recent = halves(self._kv_recent)
            else:
                for side, y in ((self.k, k_rows), (self.v, v_rows)):
                    side.recent[:, :, a : a + L - skip] = y[:, :, skip:]
        self.offset = start + L
        self._call_tokens = L
        if not deferring:
            self._flush(bh)
        return self, self

    def _to_window(self, keys: mx.array, values: mx.array, skip: int, estimate: bool = True):
        """New keys and values as the window stores them: padded, minus the side's mean
        (estimated on the first chunk, its first ``skip`` tokens left out), in the
        cache dtype.  Not rotated: only rows that get packed are (DESIGN.md section 5).
        Returns ``(keys, values, both)``: ``both`` stacks them on a new first axis (one
        elementwise pass) when their widths agree and they need that pass (a mean to
        subtract, or a few rows: one write of both), else None."""
        k, v = self.k, self.v
        keys, values = pad_last(keys, k.dim), pad_last(values, v.dim)
        if estimate and not self.config.positional:
            for side, x in ((k, keys), (v, values)):
                if side.needs_statistics:
                    side.estimate(x, skip)
        if k.dim == v.dim and (k.mean is not None or v.mean is not None or keys.shape[2] <= _STACK_MAX_ROWS):
            both = center_pair(self.dtype)(keys[None], values[None], ZERO if k.mean is None else k.mean,
                                            ZERO if v.mean is None else v.mean, SELECT_FIRST)
            return (*halves(both), both)
        return (*(x.astype(self.dtype) if side.mean is None else center_one(self.dtype)(x, side.mean)
                  for side, x in ((k, keys), (v, values))), None)

    def _keep_from(self) -> int:
        """First position the full-precision buffer must keep: the trim reserve, and the
        rows the current call attends in full precision unless they are held aside; while the
        prompt waits (``exact_prefill``), all of it."""
        if self._prefilling:
            return self.recent_start
        keep = self.q_end - self.reserve
        if self._attend_from is not None and self._fresh is None:
            keep = min(keep, self._attend_from)
        return max(self.recent_start, self.config.sink_tokens, keep)

    def _reserve_recent(self, end: int, bh):
        """Make the full-precision buffers hold positions up to ``end``,
        dropping rows older than the trim reserve when reallocating."""
        rec = self.k.recent
        if rec is not None and end - self.recent_start <= rec.shape[2]:
            return
        self._compact(end, bh)

    def _compact(self, end: int, bh):
        keep_from = self._keep_from()
        drop, used = keep_from - self.recent_start, self.offset - self.recent_start
        cap = -(-(end - keep_from) // self.recent_step) * self.recent_step
        if self.k.dim == self.v.dim:
            self._kv_recent = kept_rows(self._kv_recent, drop, used, (2, *bh, cap, self.k.dim), self.dtype)
            self.k.recent, self.v.recent = halves(self._kv_recent)
        else:
            for side in (self.k, self.v):
                side.recent = kept_rows(side.recent, drop, used, (*bh, cap, side.dim), self.dtype)
        self.recent_start = keep_from

    def packed_end(self, offset: int) -> int:
        """Where the packed segment ends for a cache holding ``offset`` tokens.

        Tokens leave the window in blocks of ``F = min(flush_block, window)`` (at
        least 1): the window holds between ``window`` and ``window + F - 1`` tokens,
        and a decode step quantizes nothing except once every ``F`` steps, when
        one block of ``F`` rows goes through one quantize pass (DESIGN.md section 5).
        A function of ``offset`` alone, so ``trim`` can restore it.
        """
        cfg = self.config
        if offset <= cfg.quantize_after:
            return cfg.sink_tokens
        block = self.block
        return cfg.sink_tokens + max(0, offset - cfg.sink_tokens - cfg.window) // block * block

    @property
    def statistics_end(self) -> int:
        """The smallest offset at which anything is packed.  With ``positional``, the mean
        and key scales are estimated then, on the rows from the sinks up to it."""
        cfg = self.config
        return max(cfg.quantize_after + 1, cfg.sink_tokens + cfg.window + self.block)

    @property
    def block(self) -> int:
        return max(1, min(self.flush_block, self.config.window))

    @property
    def reserve(self) -> int:
        """Already packed rows kept in full precision: ``trim_reserve`` rounded up to
        whole blocks, since trimming one token can move the packed end back a block."""
        return -(-self.config.trim_reserve // self.block) * self.block

    @property
    def _pairs_packed(self) -> bool:
        """Keys and values go through one quantize pass and share packed buffers."""
        k, v = self.k, self.v
        return (k.bits, k.dim, k.clip) == (v.bits, v.dim, v.clip)

    def _rows_views(self):
        """``k.rows`` / ``v.rows`` as views of the shared packed buffer: its two halves, or for fp4
        the one joined buffer ``(1, B, H, rows, pair_width)`` both sides read (``core/fp4.py``)."""
        if self.k.fp4:
            self.k.rows = self.v.rows = self._kv_rows.reshape(self._kv_rows.shape[1:])
        else:
            self.k.rows, self.v.rows = halves(self._kv_rows)

    def packed_layout(self) -> list:
        """``(lead, width)`` of each packed buffer, each with a leading side axis: ``[(2, W)]``
        when keys and values share one (:attr:`_pairs_packed`), else ``[(1, W_k), (1, W_v)]``."""
        g = self.config.group_size
        if self.k.fp4:
            return [(1, fp4.pair_width(self.k.dim, self.config.storage))]
        if self._pairs_packed:
            return [(2, row_width(self.k.dim, self.k.bits, g))]
        return [(1, row_width(side.dim, side.bits, g)) for side in (self.k, self.v)]

    def packed_buffers(self) -> list:
        """The packed rows in :meth:`packed_layout`'s order, each with its leading side axis
        (None for a side with none)."""
        if self._pairs_packed:
            return [self._kv_rows]
        return [None if side.rows is None else side.rows[None] for side in (self.k, self.v)]

    def set_packed_buffers(self, bufs):
        """Hold packed rows laid out as :meth:`packed_buffers` returns them (None: none)."""
        self._kv_rows = self.k.rows = self.v.rows = None
        if bufs is None:
            return
        if len(bufs) == 1:
            self._kv_rows = bufs[0]
            self._rows_views()
        else:
            self.k.rows, self.v.rows = (b[0] for b in bufs)

    def _flush(self, bh):
        """Quantize the block(s) of tokens that left the full-precision window."""
        target = self.packed_end(self.offset)
        if target <= self.q_end:
            self._grow_before_packing(bh)
            return
        s = self.config.sink_tokens
        if self.config.positional and (self.k.needs_statistics or self.v.needs_statistics):
            self._estimate_positional()
        a, b = self.q_end - self.recent_start, target - self.recent_start
        qa, qb = self.q_end - s, target - s
        self._packed_room(qa, qb, bh)
        if self.k.fp4:
            # keys and values in one joined row: a block in one pass, a prompt in evaluated pieces
            step = PIECE_ROWS if b - a > _STACK_MAX_ROWS else b - a
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                self._kv_rows[:, :, :, qa + lo - a : qa + hi - a] = self._quantize_rows(lo, hi)[None]
                if step < b - a:
                    eval_now(self._kv_rows)
            self._rows_views()
        elif self._pairs_packed and b - a <= _STACK_MAX_ROWS:
            # keys and values stacked: one quantize pass, one write
            self._kv_rows[:, :, :, qa:qb] = self._quantize_rows(a, b)
            self.k.rows, self.v.rows = halves(self._kv_rows)
        else:
            # a prompt's rows: in pieces of PIECE_ROWS, one side at a time, each evaluated before
            # the next is built, so the quantizer's temporaries are those of one piece
            # (prefill.py; the launches and syncs are once per prompt)
            step = PIECE_ROWS if b - a > _STACK_MAX_ROWS else b - a
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                for i, (side, rows) in enumerate(zip((self.k, self.v), self._quantize_rows(lo, hi, stacked=False))):
                    at = (slice(None), slice(None), slice(qa + lo - a, qa + hi - a))
                    if self._pairs_packed:
                        self._kv_rows[(slice(i, i + 1), *at)] = rows[None]
                    else:
                        side.rows[at] = rows
                if step < b - a:
                    eval_now(self._kv_rows if self._pairs_packed else [self.k.rows, self.v.rows])
            if self._pairs_packed:
                self.k.rows, self.v.rows = halves(self._kv_rows)
        self._views = self._codes_kept_below(qa, qb)
        self.q_end = target
        self._drop_dead(bh)

    def _drop_dead(self, bh):
        """Drop the full-precision rows older than the reserve (and than what the current
        call attends in full precision unless they are held aside): a call of several tokens
        (a prompt, a chunk) drops them as soon as it has any, so the buffer ends the call at
        window + reserve + one block at most; a decode step's packed block is dropped by the
        next step, whose write needs the room (:meth:`_reserve_recent`), so that packing and
        compacting never share a step (DESIGN.md section 5)."""
        if self._call_tokens > 1 and self._keep_from() > self.recent_start:
            self._compact(self.offset, bh)

    def _packed_room(self, used: int, needed: int, bh):
        """Make the packed buffers hold ``needed`` rows, keeping their first ``used``."""
        layout = self.packed_layout()
        step = self.growth_step(used)
        if self._pairs_packed:
            old = self._kv_rows
            self._kv_rows = grow(old, used, needed, step, (layout[0][1],), mx.uint32, (layout[0][0], *bh))
            if self._kv_rows is not old:
                self._rows_views()
                self._views = self._codes_kept_below(used, needed)
            return
        for side, (_, width) in zip((self.k, self.v), layout):
            old = side.rows
            side.rows = grow(old, used, needed, step, (width,), mx.uint32, bh)
            if side.rows is not old:
                self._views = self._codes_kept_below(used, needed)

    def growth_step(self, used: int) -> int:
        """Rows a packed buffer holding ``used`` rows grows by: :attr:`step`, or from
        :attr:`growth_from` rows on ``used / growth_fraction`` rounded up to whole steps."""
        if used < self.growth_from:
            return self.step
        return max(self.step, -(-(used // self.growth_fraction) // self.step) * self.step)

    def _grow_before_packing(self, bh):
        """On the step before one that packs a block, grow the packed buffer if that block
        will not fit: a decode step then never both packs and grows (DESIGN.md section 5)."""
        nxt = self.packed_end(self.offset + 1)
        s = self.config.sink_tokens
        if nxt > self.q_end > s:
            self._packed_room(self.q_end - s, nxt - s, bh)

    def _quantize_rows(self, a: int, b: int, stacked: bool = True):
        """Packed rows (``codec.join_rows``) of rows ``[a, b)`` of the window buffers.

        Keys and values of the same bits, width and clip go through one quantize pass over
        the stacked buffer (it works per token and group, so the result is identical) and
        come back stacked, ``(2, B, H, b - a, .)``: the cost of a block is one pass, not
        the rows.  Otherwise (or with ``stacked`` False) ``[k_rows, v_rows]``.
        """
        k, v, cfg = self.k, self.v, self.config
        rotate = cfg.rotation != "none"
        if k.fp4:
            stacked = True  # fp4: one joined row per token, ``(B, H, b - a, pair_width)``
        if not (stacked and self._pairs_packed):
            return [dispatch.quantize_rows(s.recent[:, :, a:b], s.bits, cfg.group_size, clip=s.clip,
                                           lam=s.lam, signs=s.signs, rotate=rotate, joined=True, align=align)
                    for s, align in zip((k, v), cfg.scale_alignment)]
        if self._stacked is None:
            # per-layer constants of the stacked pass, built once (statistics never change after
            # the first chunk): 2 x (B, H, 1, d) key scales and 2 x d signs
            self._stacked = pair_tables(k, v)
            mx.eval([x for x in self._stacked if x is not None])
        lam, signs = self._stacked
        if k.fp4:
            return dispatch.quantize_fp4_rows(self._kv_recent[:, :, :, a:b], cfg.storage, lam=lam, signs=signs,
                                              rotate=rotate, clip=cfg.clip)
        return dispatch.quantize_rows(self._kv_recent[:, :, :, a:b], k.bits, cfg.group_size, clip=k.clip, lam=lam,
                                      signs=signs, rotate=rotate, joined=True, align=cfg.scale_alignment)

    # -- reading (segments, attention_segments, positional_mask...: CacheReads, reading.py) ----

    def release_fresh(self):
        """Attention has read this call's segments: later reads see the packed rows, and
        full-precision rows nothing needs any more (past the window and the trim reserve)
        are dropped as :meth:`_drop_dead` says."""
        self._attend_from = self._fresh = None
        if self.k.recent is not None:
            self._drop_dead(self.batch_heads)

    # -- mlx-lm contract -----------------------------------------------------

    @property
    def keys(self):
        """The key sign vector, the one array of this cache that is never
        empty once written and always in :attr:`state`.

        mlx-lm's pipeline-parallel models (``models/pipeline.py``) chain the
        send of their hidden state to the last local cache with
        ``cache[-1].keys = mx.depends(cache[-1].keys, h)``, so that evaluating
        the caches' state (all ``generate_step`` evaluates during prefill) runs
        the send; the setter takes that array back.
        """
        return self.k.signs

    @keys.setter
    def keys(self, value):
        if self.k.signs is None or not isinstance(value, mx.array) or value.shape != self.k.signs.shape:
            raise ValueError("OIQKVCache.keys can only be replaced by an array of the key signs' shape "
                             "(mx.depends(cache.keys, ...)) after the cache was written")
        self.k.signs = value

    def size(self):
        return self.offset

    def empty(self):
        return self.dtype is None

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, int(n)))
        self._attend_from = self._fresh = None
        self.offset -= n
        cfg = self.config
        if self.offset < self.recent_start:
            # every full-precision row is gone: the buffer restarts here
            self.recent_start = max(self.offset, cfg.sink_tokens)
        wanted = self.packed_end(self.offset)
        # quantized tokens still held in full precision return to the window
        self.q_end = max(cfg.sink_tokens, min(self.q_end, self.offset, max(wanted, self.recent_start)))
        if cfg.positional and self.q_end == cfg.sink_tokens and self.dtype is not None:
            self._reset_statistics()
        self.end_prefill()  # generation is under way: the verify calls that follow read it packed
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def __deepcopy__(self, memo):
        # mlx-lm's prompt cache deep-copies caches; mx.Dtype cannot be, and
        # arrays are values, so new handles on the same data are a full copy
        return detached_copy(self)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching hook: one :class:`~oiq_mlx.cache.batch.BatchOIQKVCache` over ``caches``."""
        return BatchOIQKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        """Bytes of every array this cache holds (allocated capacity included, the per-layer
        constants of the stacked quantize pass once built, and on the CPU the repacked codes a
        decode step keeps for the next, :meth:`cpu_codes`)."""
        stacked = sum(a.nbytes for a in self._stacked if a is not None) if self._stacked is not None else 0
        return self.k.nbytes() + self.v.nbytes() + stacked + self.cpu_codes_nbytes()

    def quantized_nbytes_formula(self) -> int:
        """What the quantized segment must occupy: capacity x bytes_per_token x B x H."""
        if self.k.codes is None:
            return 0
        b, h, cap = self.k.codes.shape[:3]
        if self.k.fp4:
            return b * h * cap * fp4.pair_bytes_per_token(self.k.dim, self.config.storage)
        per = bytes_per_token(self.k.dim, self.k.bits, self.config.group_size)
        per += bytes_per_token(self.v.dim, self.v.bits, self.config.group_size)
        return b * h * cap * per

    @property
    def state(self):
        """The arrays this cache holds, trimmed to what is used, and a JSON string.

        ``[k_codes, k_scales, k_sink, k_recent, k_signs, k_mean, k_lam, (same for
        values), metadata]``, None for an array not held.  The metadata carries
        the format version, the config, the counters and a digest of itself;
        :meth:`from_state` checks all of it against the arrays
        (:func:`oiq_mlx.cache.files.cache_state` and ``restore_state``).
        """
        return cache_state(self)

    @state.setter
    def state(self, v):
        # the config, counters and arrays (validated first), then what this cache lays out
        # itself: the exact_prefill flag and the buffers keys and values share
        meta = restore_state(self, v)
        if meta["dtype"] is not None:
            self._prefilling = meta.get("prefilling", False)
            self._pair_up()

    def _pair_up(self):
        """Stack loaded keys and values into the shared buffers (see ``__init__``)."""
        k, v = self.k, self.v
        if k.dim == v.dim and k.recent is not None:
            self._kv_recent = mx.stack([k.recent, v.recent])
            k.recent, v.recent = halves(self._kv_recent)
        if k.fp4 and k.rows is not None:
            self.set_packed_buffers([k.rows[None]])  # the state held the joined rows already
            self._views = None
        elif self._pairs_packed and k.rows is not None:
            self.set_packed_buffers([mx.stack([k.rows, v.rows])])
            self._views = None


BatchOIQKVCache.sequence_class = OIQKVCache  # what BatchOIQKVCache.from_state builds
