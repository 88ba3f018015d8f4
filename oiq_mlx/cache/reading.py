"""What attention reads of an :class:`~oiq_mlx.cache.sequence.OIQKVCache`: its segments (sinks,
packed rows, window), the rows the current call attends in full precision, the mask of a
``positional`` call over them, and the whole cache dequantized (for evaluation and tests).

:class:`CacheReads` is mixed into ``OIQKVCache``: its methods read the counters and buffers that
``oiq_mlx/cache/sequence.py`` writes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..core import fp4
from ..core.codec import CPU_REPACK_BITS, dequantize, repack_codes, split_rows
from .common import POSITIONAL, halves

# packed rows up to this many stay repacked for MLX's CPU quantized_matmul until a row they hold is
# written again (:meth:`CacheReads.cpu_codes`): the decode steps of a block repack once, where
# repacking every step costs its launches, as many at a few hundred rows as at a thousand.  Values
# of the widths CPU_REPACK_BITS names are kept at 4 bits a code (1- to 3-bit codes; 8 for 5- and 6-bit
# ones), which MLX multiplies as fast as 8-bit ones at these lengths for half the bytes, and past the
# bound repacked every step (to 8 bits) with no copy held.  Keys of 3, 5 or 6 bits are kept at 4 or 8 bits, which MLX's
# CPU kernel scores faster (2 cores, 3 query rows, 448 rows x 3 heads x 64: 5-bit 0.57 ms, as
# 8-bit 0.45; 3-bit 0.53, as 4-bit 0.41; 2-bit as fast as 4-bit), and past the bound read as they are
CPU_MEMO_ROWS = 1024
CPU_MEMO_BITS = {"v": {b: 4 if b < 4 else 8 for b in CPU_REPACK_BITS}, "k": {3: 4, 5: 8, 6: 8}}


class CacheReads:
    """The read side of :class:`~oiq_mlx.cache.sequence.OIQKVCache` (a mixin that holds no state
    of its own)."""

    def packed_scales(self, n: int):
        """Both sides' scales of the first ``n`` packed rows, stacked ``(2, B, H, n, groups)``
        (a view), when keys and values share packed buffers; else None."""
        return self._packed_views(n)[4] if n > 0 else None

    def _packed_views(self, n: int):
        """``(k_codes, k_scales, v_codes, v_scales, stacked scales or None)`` of the first ``n``
        packed rows, as views; kept until the packed rows are written again or ``n`` changes
        (a decode step between two blocks reuses them instead of building them anew)."""
        memo = self._views
        if memo is not None and memo[0] == n:
            return memo[1]
        g = self.config.group_size
        if self.k.fp4:
            # one joined buffer: each side's codes and uint8 scales are views of it
            rows = self.k.rows[:, :, :n]
            views = (*self.k.split(rows), *self.v.split(rows), None)
        elif self._kv_rows is not None:
            codes, scales = split_rows(self._kv_rows[:, :, :, :n], self.k.dim, self.k.bits, g)
            (kc, vc), (ks, vs) = halves(codes), halves(scales)
            views = (kc, ks, vc, vs, scales)
        else:
            views = (*(x for side in (self.k, self.v) for x in split_rows(side.rows[:, :, :n], side.dim, side.bits, g)),
                     None)
        # the repacked codes (cpu_codes) hold rows that have not been written since: kept
        self._views = (n, views, None if memo is None else memo[2])
        return views

    def _codes_kept_below(self, row: int, end: int):
        """What ``_views`` becomes when packed rows ``[row, end)`` are written or the packed
        buffers are copied to new ones holding ``end`` rows: no views, and the repacked codes
        (:meth:`cpu_codes`) kept when they hold no row from ``row`` on and ``end`` is within
        :data:`CPU_MEMO_ROWS` (past it no step reads them: they would only take memory)."""
        memo = self._views
        kept = None if memo is None else memo[2]
        if kept is None or kept[0] > row or end > CPU_MEMO_ROWS:
            return None
        return None, None, kept

    def cpu_codes(self, side: str, codes: mx.array):
        """``(codes, bits)``: ``codes``, the key (``side`` ``"k"``) or value (``"v"``) codes of
        this cache's first packed rows (as :meth:`attention_segments` gives them), as MLX's CPU
        ``quantized_matmul`` reads them fastest: repacked (the same codes, so the same scales
        and biases) or as they are.  Up to :data:`CPU_MEMO_ROWS` rows the repacked copy
        is kept until a row it holds is written again: a block's decode steps repack once, the
        step after the block is packed (growing the buffers, or reading fewer rows, keeps it)."""
        bits, n = getattr(self, side).bits, codes.shape[2]
        to = CPU_MEMO_BITS[side].get(bits)
        if n > CPU_MEMO_ROWS or to is None:
            to = CPU_REPACK_BITS.get(bits, bits) if side == "v" else bits
            return repack_codes(codes, bits, to), to
        memo = self._views
        kept = None if memo is None else memo[2]
        if kept is None or kept[0] < n:
            kept = (n, {})
            self._views = (None, None, kept) if memo is None else (memo[0], memo[1], kept)
        held = kept[1].get(side)
        if held is None:
            if kept[0] > n:  # a copy of more rows, made without this side: these rows only, not kept
                return repack_codes(codes, bits, to), to
            held = kept[1][side] = repack_codes(codes, bits, to)
        return (held if kept[0] == n else held[:, :, :n]), to

    def cpu_codes_nbytes(self) -> int:
        """Bytes of the repacked codes :meth:`cpu_codes` keeps (0 when it keeps none)."""
        memo = self._views
        kept = None if memo is None else memo[2]
        return 0 if kept is None else sum(a.nbytes for a in kept[1].values())

    def segments(self):
        """Stored data for attention, each in the rotated (centered) domain.

        Returns ``(sink_k, sink_v, quant, recent_k, recent_v)``; ``quant`` is
        None or ``(k_codes, k_scales, v_codes, v_scales)`` sliced to the used
        length; any full-precision part may be None when empty.
        """
        cfg = self.config
        n_sink = min(cfg.sink_tokens, self.offset)
        # a prompt waiting whole (exact_prefill) holds its sinks in the window buffer, from row 0
        where = "recent" if self.recent_start < cfg.sink_tokens else "sink"
        sink_k = getattr(self.k, where)[:, :, :n_sink] if n_sink else None
        sink_v = getattr(self.v, where)[:, :, :n_sink] if n_sink else None
        n_q = self.q_end - cfg.sink_tokens if self.offset > cfg.sink_tokens else 0
        quant = self._packed_views(n_q)[:4] if n_q > 0 else None
        a, b = max(self.q_end, cfg.sink_tokens) - self.recent_start, self.offset - self.recent_start
        recent_k = self.k.recent[:, :, a:b] if b > a else None
        recent_v = self.v.recent[:, :, a:b] if b > a else None
        return sink_k, sink_v, quant, recent_k, recent_v

    def attention_segments(self):
        """What attention reads: :meth:`segments`, except that the rows the
        current call found in the window, and the call's own rows, are full
        precision even when the call packed them.

        A call that writes more tokens than the window holds (a prompt, a
        chunk) quantizes some of them before its own queries attend to them,
        and a call whose writes move the window on packs rows its queries
        would have seen exactly one call earlier.  Its queries get those rows
        exact instead: prefill attention is exact, so quantization error never
        flows into the keys and values of later layers during prefill, and a
        call of several tokens (a chunk, a speculative draft) sees what
        one-token calls see.  A call that packs only rows it found (a decode
        step) reads them from the full-precision buffer, which keeps them
        until :meth:`release_fresh`; a call that packs some of its own rows
        holds the found rows and its own input aside, so the buffer drops the
        packed rows at once (a prompt never sits in it whole).  Attention
        calls :meth:`release_fresh` once it has read them.

        ``positional``: a one-token call reads :meth:`segments` (the block it
        packed, packed); a call of several tokens that packed rows gets them
        twice, packed up to ``q_end`` and in full precision from the position it
        found, and :meth:`positional_mask` tells each query which copy it reads.
        """
        if self.recent_start < self.config.sink_tokens and self.k.recent is not None:
            # a prompt waiting whole (exact_prefill), sinks included, in one buffer from position 0
            n = self.offset - self.recent_start
            return None, None, None, self.k.recent[:, :, :n], self.v.recent[:, :, :n]
        segs = self.segments()
        start = self._attend_from
        if start is None or start >= self.q_end or (self.config.positional and self._call_tokens == 1):
            # positional: a decode step reads what the cache holds after its write
            return segs
        sink_k, sink_v, quant, _, _ = segs
        n_q = start - self.config.sink_tokens  # sinks are stored exactly already
        if quant is not None and not self.config.positional:
            quant = tuple(x[:, :, :n_q] for x in quant) if n_q > 0 else None
        if self._fresh is not None:
            return sink_k, sink_v, quant, *self._fresh
        a, b = start - self.recent_start, self.offset - self.recent_start
        return sink_k, sink_v, quant, self.k.recent[:, :, a:b], self.v.recent[:, :, a:b]

    def positional_mask(self, mask, L: int):
        """The mask of the current call over :meth:`attention_segments`' columns.

        Unchanged (``mask``) unless the cache is ``positional`` and this call of ``L``
        tokens packed rows its queries attend: then its segments hold those rows twice,
        packed and in full precision, and query ``p`` sees a row packed when it had left
        the window by the time ``p`` was written (``packed_end(p + 1)``), in full precision
        otherwise, and no row past ``p``.  Returns a ``(B', 1 or n_q, L, T)`` array that
        also applies ``mask`` (None, ``"causal"``, or an array over the ``offset``
        positions): bool, or additive float32 when ``mask`` is additive.
        """
        start = self._attend_from
        if not self.config.positional or L < 2 or start is None or start >= self.q_end:
            return mask
        # every layer of a model's call has the same positions: the first builds, the others reuse
        key = (self.config, self.offset, self.q_end, start, self._call_tokens, L)
        out, cols = POSITIONAL.get(key, lambda: self._positional_columns(start, L))
        if mask is None or isinstance(mask, str):
            return out  # "causal" is part of what each query sees
        given = mx.take(mask, cols, axis=-1)
        if given.dtype == mx.bool_:
            return mx.logical_and(out, given)
        return mx.where(out, given.astype(mx.float32), -mx.inf)

    def _positional_columns(self, start: int, L: int):
        """What :meth:`positional_mask` builds on the host: which columns each query sees,
        ``(1, 1, L, T)`` bool, and each column's position, ``(T,)`` int32."""
        offset, s = self.offset, self.config.sink_tokens
        cols = np.concatenate([np.arange(min(s, offset)), np.arange(s, self.q_end), np.arange(start, offset)])
        # query j sits at the call's j-th position (a batch's padding queries come after them)
        p = np.arange(offset - self._call_tokens, offset - self._call_tokens + L)[:, None]
        # the cache held p + 1 tokens right after p was written
        packed_to = np.array([self.packed_end(int(x) + 1) for x in p[:, 0]])[:, None]
        n_sink, n_packed = min(s, offset), self.q_end - s
        kind = np.concatenate([np.zeros(n_sink, np.int8), np.ones(n_packed, np.int8),
                               np.full(offset - start, 2, np.int8)])[None, :]
        seen = np.where(kind == 1, cols < packed_to, (cols <= p) & ((kind == 0) | (cols >= packed_to)))
        return mx.array(seen.reshape(1, 1, L, -1)), mx.array(cols.astype(np.int32))

    def dequantized_kv(self):
        """All keys and values as the attention sees them, un-rotated, float32,
        ``(B, H, offset, d)``.  For evaluation and tests, not for decoding."""
        if self.dtype is None:
            raise ValueError("dequantized_kv: the cache is empty (nothing was written to it yet)")
        sink_k, sink_v, quant, recent_k, recent_v = self.segments()
        out = []
        for side, parts in ((self.k, (sink_k, quant and quant[:2], recent_k)), (self.v, (sink_v, quant and quant[2:], recent_v))):
            chunks = []
            for i, p in enumerate(parts):
                if p is None:
                    continue
                if i == 1 and side.fp4:
                    p = side.packed_to_window(fp4.dequantize(*p, side.storage))
                elif i == 1:
                    p = side.packed_to_window(dequantize(*p, bits=side.bits, group_size=self.config.group_size))
                chunks.append(p.astype(mx.float32))
            y = mx.concatenate(chunks, axis=2)
            if side.mean is not None:
                y = y + side.mean
            out.append(y[..., : side.head_dim])
        return tuple(out)
