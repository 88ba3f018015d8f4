"""Decode steps of a batch of OIQ caches over storage stacked across sequences.

:class:`~oiq_mlx.cache.batch.BatchOIQKVCache` keeps one :class:`~oiq_mlx.cache.OIQKVCache`
per sequence.  Run as they are, a decode step of ``B`` sequences writes and attends
each cache on its own: ``B`` times the operations of one sequence, which on the CPU
backend cost about half the throughput of mlx-lm's batched full-precision cache.  While a batch only decodes (one token per sequence per step), this
module holds the batch's storage in arrays with the sequences on one axis:

* ``sinks``  ``(2, B, H, S, d)``: keys and values of the sink tokens;
* ``recent`` ``(2, B, H, R, d)``: the full-precision rows, sequence ``i``'s row ``j``
  being its position ``recent_start[i] + j``;
* ``rows``: the packed rows (``codec.join_rows``), sequence ``i``'s first ``q_end[i] - S``:
  one ``(2, B, H, P, width)`` array when keys and values have the same bits (one write
  per packed block), else one ``(1, B, H, P, width_side)`` array per side (``4bit``
  stores keys at 5 bits and values at 3).

A step writes every sequence's new row with one scatter, packs a block of the
sequences whose window just filled (one quantize pass each, once per ``flush_block``
steps of a sequence), and attends all sequences in one pass over the stacked
arrays: the same reference path and decode kernels as one sequence
(:func:`oiq_mlx.cache.attention.reference_output`, :func:`~oiq_mlx.cache.attention.decode_attention_kernel`),
with a mask that shows each sequence only its own rows.  Each sequence keeps
its own positions, statistics, sinks and packing phase, so it stores and attends to
exactly the rows it would alone (the values are bit-identical; sums over the padded
columns may round differently).  :meth:`StackedDecode.unstack` gives every sequence
its storage back, as copies that hold none of the stacked buffers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .common import SELECT_FIRST, ZERO, HostMemo, center_pair, halves, pad_last, pair_tables
from ..core.codec import split_rows
from ..kernels import dispatch

# spare rows of each sequence's window in the stacked buffer, so that compacting it (one
# gather over the batch) is needed about once per block rather than every step
RECENT_SPARE = 16
# what each sequence has its own entry of, in batch order
PER_SEQUENCE = ("caches", "offsets", "q_end", "recent_start")
# every layer of a step writes at and masks by the same positions (see HostMemo)
_INDEX = HostMemo()
_MASK = HostMemo()
_RANGES = HostMemo()
_PACK_INDEX = HostMemo()


def _estimates_now(c) -> bool:
    """Does ``c`` (``positional``) estimate its statistics on the block it packs now?"""
    return c.config.positional and (c.k.needs_statistics or c.v.needs_statistics)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def stackable(caches) -> bool:
    """True when these caches (one layer of a batch) can decode stacked: written, keys and
    values of one width sharing the window buffer, one dtype and config, sinks complete."""
    if not caches:
        return False
    first = caches[0]
    if first.config.storage != "int":
        # fp4 rows join keys and values, a layout the stacked step does not build: such a batch
        # decodes one sequence at a time (each through its own fp4 reference path)
        return False
    s = first.config.sink_tokens
    for c in caches:
        if c.dtype is None or c.dtype != first.dtype or c.config != first.config:
            return False
        if c._kv_recent is None or c.batch_heads != first.batch_heads:
            return False
        if c.batch_heads[0] != 1 or c.offset <= s or c._attend_from is not None:
            return False
    return True


class _SideView:
    """What attention reads of one side of the stacked batch: the per-sequence constants
    stacked on the batch axis (``mean``, ``lam``: ``(B, H, 1, d)`` or None)."""

    def __init__(self, sides, sink):
        first = sides[0]
        self.bits, self.dim, self.head_dim = first.bits, first.dim, first.head_dim
        self.signs, self.rotated = first.signs, first.rotated
        self.sink = sink
        self.mean = self._stack([s.mean for s in sides], mx.zeros_like)
        self.lam = self._stack([s.lam for s in sides], mx.ones_like)

    @staticmethod
    def _stack(arrays, neutral):
        """The sequences' arrays on the batch axis; a ``positional`` sequence that has not
        estimated its statistics yet gets the neutral value (its rows are not centered,
        and it has no packed row to scale)."""
        present = [a for a in arrays if a is not None]
        if not present:
            return None
        return mx.concatenate([neutral(present[0]) if a is None else a for a in arrays], axis=0)


class StackedDecode:
    """A decoding batch's storage stacked across sequences (see the module docstring).

    Built by :meth:`stack` from the per-sequence caches, whose full-precision and
    packed buffers move here (they hold only their constants meanwhile); they get
    them back from :meth:`unstack`.  Acts as the cache :func:`oiq_mlx.cache.attention.reference_output`
    and the decode kernels read (``k``, ``v``, ``config``, ``dtype``, ``offset``,
    ``packed_scales``)."""

    def __init__(self, caches, sinks, recent, rows):
        self.caches = caches
        first = caches[0]
        self.config, self.dtype = first.config, first.dtype
        self.sinks, self.recent, self.rows = sinks, recent, rows
        self.offsets = [c.offset for c in caches]
        self.q_end = [c.q_end for c in caches]
        self.recent_start = [c.recent_start for c in caches]
        self.attend_from = None  # per sequence, the q_end the current step found
        self.offset = 0  # columns of the current step's segments (the mask's last axis)
        self._views()

    # -- building and giving back ------------------------------------------

    @classmethod
    def stack(cls, caches) -> "StackedDecode":
        caches = list(caches)
        for c in caches:
            c.end_prefill()  # exact_prefill: a decode step reads the prompt packed
        first = caches[0]
        s = first.config.sink_tokens
        _, H = first.batch_heads
        held = [c.offset - c.recent_start for c in caches]
        packed = [c.q_end - s for c in caches]
        r_cap = _round_up(max(held) + RECENT_SPARE, first.recent_step)
        p_cap = _round_up(max(packed), first.growth_step(max(packed)))
        sinks = mx.concatenate(
            [mx.stack([c.k.sink[:, :, :s], c.v.sink[:, :, :s]]) for c in caches], axis=1)
        recent = mx.concatenate(
            [_pad_rows(c._kv_recent[:, :, :, :n], r_cap) for c, n in zip(caches, held)], axis=1)
        owned = [c.packed_buffers() for c in caches]
        rows = tuple(
            mx.concatenate(
                [_pad_rows(bufs[j][:, :, :, :n] if n > 0 else mx.zeros((lead, 1, H, 0, width), mx.uint32), p_cap)
                 for bufs, n in zip(owned, packed)], axis=1)
            for j, (lead, width) in enumerate(first.packed_layout()))
        mx.eval(sinks, recent, *rows)
        for c in caches:
            c._kv_recent = c.k.recent = c.v.recent = None
            c.set_packed_buffers(None)
            c.k.sink = c.v.sink = None
            c._views = None
        return cls(caches, sinks, recent, rows)

    def _give_back(self, i: int, c):
        """Sequence ``i``'s storage, copied out of the stacked buffers, into cache ``c``
        (``caches[i]`` or a detached copy of it).  A step whose attention has not run
        yet stays pending: ``c`` attends the rows it packed in full precision."""
        s = self.config.sink_tokens
        c.offset, c.q_end, c.recent_start = self.offsets[i], self.q_end[i], self.recent_start[i]
        held, packed = c.offset - c.recent_start, c.q_end - s
        c._kv_recent = mx.contiguous(self.recent[:, i : i + 1, :, : _round_up(max(held, 1), c.recent_step)])
        c.k.recent, c.v.recent = halves(c._kv_recent)
        c.set_packed_buffers([mx.contiguous(r[:, i : i + 1, :, : _round_up(packed, c.step)]) for r in self.rows]
                             if packed > 0 else None)
        c.k.sink, c.v.sink = (mx.contiguous(x) for x in halves(self.sinks[:, i : i + 1]))
        c._views = c._fresh = None
        c._attend_from = None if self.attend_from is None else self.attend_from[i]
        c._call_tokens = 1
        mx.eval(c._kv_recent, c.k.rows, c.v.rows, c.k.sink, c.v.sink)
        return c

    def unstack(self):
        """Give every sequence's cache its storage back (copies that hold none of the
        stacked buffers, which are dropped) and return the caches."""
        out = [self._give_back(i, c) for i, c in enumerate(self.caches)]
        self.caches = []
        self.sinks = self.recent = self.rows = None
        return out

    def extract(self, i: int, copy_cache):
        """Sequence ``i``'s cache on its own (``copy_cache``: a detached copy of its
        metadata), the batch staying stacked."""
        return self._give_back(i, copy_cache(self.caches[i]))

    def filter(self, keep):
        """Keep the sequences at indices ``keep``, in that order (one gather per buffer)."""
        keep = [int(i) for i in keep]
        idx = mx.array(np.array(keep, np.int32))
        self.sinks, self.recent = (mx.take(x, idx, axis=1) for x in (self.sinks, self.recent))
        self.rows = tuple(mx.take(r, idx, axis=1) for r in self.rows)
        for name in PER_SEQUENCE:
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if self.attend_from is not None:
            self.attend_from = [self.attend_from[i] for i in keep]
        self._views()

    def fits(self, other: "StackedDecode") -> bool:
        """True when ``other``'s sequences can join this stacked batch (one layer, config,
        dtype and head shape)."""
        a, b = self.caches[0], other.caches[0]
        return (a.config == b.config and a.layer_idx == b.layer_idx and self.dtype == other.dtype
                and self.sinks.shape[2:] == other.sinks.shape[2:]
                and [r.shape[4] for r in self.rows] == [r.shape[4] for r in other.rows])

    def extend(self, other: "StackedDecode"):
        """Append the sequences of ``other`` (one copy of each buffer, padded to the larger
        capacity)."""
        if self.attend_from is not None or other.attend_from is not None:
            raise ValueError("cannot extend a stacked batch between a write and its attention")
        r_cap = max(self.recent.shape[3], other.recent.shape[3])
        p_cap = max(self.rows[0].shape[3], other.rows[0].shape[3])
        self.sinks = mx.concatenate([self.sinks, other.sinks], axis=1)
        self.recent = mx.concatenate([_pad_rows(self.recent, r_cap), _pad_rows(other.recent, r_cap)], axis=1)
        self.rows = tuple(mx.concatenate([_pad_rows(a, p_cap), _pad_rows(b, p_cap)], axis=1)
                          for a, b in zip(self.rows, other.rows))
        for name in PER_SEQUENCE:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        other.caches = []
        other.sinks = other.recent = other.rows = None
        self._views()

    def _views(self):
        sk, sv = halves(self.sinks)
        self.k = _SideView([c.k for c in self.caches], sk)
        self.v = _SideView([c.v for c in self.caches], sv)
        # what packing several sequences in one pass reads: both sides' key scales (ones for a
        # side without) and signs, stacked on a new first axis as one cache's pass stacks them
        k, v = self.k, self.v
        self._lam2, self._signs2 = pair_tables(k, v)
        # the stacked statistics are built once per batch membership, not in every step's graph
        mx.eval([x for x in (k.mean, k.lam, v.mean, v.lam, self._lam2, self._signs2) if x is not None])
        self._segments = None

    @property
    def nbytes(self) -> int:
        return (self.sinks.nbytes + self.recent.nbytes + sum(r.nbytes for r in self.rows)
                + sum(c.nbytes for c in self.caches))

    @property
    def state(self):
        # what evaluating the batch's state must evaluate (mlx-lm evaluates it after prefill;
        # the key signs carry a pipeline model's send, see OIQKVCache.keys)
        return [self.sinks, self.recent, *self.rows, self.caches[0].k.signs]

    # -- one decode step -----------------------------------------------------

    def update(self, keys: mx.array, values: mx.array):
        """Write one token per sequence (``(B, H, 1, d)`` keys and values) and pack the
        blocks that left the windows."""
        B = len(self.caches)
        if keys.shape[2] != 1 or keys.shape[0] != B:
            raise ValueError(f"a stacked decode step takes one token per sequence, got {tuple(keys.shape)}")
        self.attend_from = list(self.q_end)
        pos = [o - r for o, r in zip(self.offsets, self.recent_start)]
        if max(pos) >= self.recent.shape[3]:
            self._compact()
            pos = [o - r for o, r in zip(self.offsets, self.recent_start)]
        km, vm = self.k.mean, self.v.mean
        d = self.k.dim
        k, v = pad_last(keys, d), pad_last(values, d)
        both = center_pair(self.dtype)(k[None], v[None], ZERO if km is None else km,
                                        ZERO if vm is None else vm, SELECT_FIRST)
        idx = _INDEX.get(tuple(pos), lambda: mx.array(np.array(pos, np.int32).reshape(1, B, 1, 1, 1)))
        self.recent = mx.put_along_axis(self.recent, idx, both, axis=3)
        due = []
        for i, c in enumerate(self.caches):
            self.offsets[i] = c.offset = self.offsets[i] + 1
            target = c.packed_end(c.offset)
            if target > self.q_end[i]:
                due.append((i, c, target))
        self._pack_due(due)
        self._grow_ahead(bool(due))
        self._segments = None

    def _grow_ahead(self, packed_now: bool):
        """Grow the packed buffers before a packing step needs it: on a step that packs
        nothing, when a sequence will pack past their capacity within a block of steps; on any
        step, when one will at the next step.  So a packing step grows nothing unless every step
        of a block packs (16 sequences or more in distinct phases)."""
        s, cap = self.config.sink_tokens, self.rows[0].shape[3]
        nxt = max(c.packed_end(o + 1) for c, o in zip(self.caches, self.offsets)) - s
        soon = max(c.packed_end(o + c.block) for c, o in zip(self.caches, self.offsets)) - s
        if nxt > cap or (not packed_now and soon > cap):
            self._packed_room(soon)

    def _packed_room(self, needed: int):
        """Make the stacked packed buffers hold ``needed`` rows per sequence, growing them as one
        sequence's would grow (:meth:`OIQKVCache.growth_step` of the rows they hold)."""
        cap = self.rows[0].shape[3]
        if needed > cap:
            step = self.caches[0].growth_step(cap)
            self.rows = tuple(_pad_rows(r, _round_up(needed, step)) for r in self.rows)

    def _pack_due(self, due):
        """Pack the block of each sequence in ``due`` (``(i, cache, target)``): the sequences
        that pack a block of one size together, in one quantize pass (one per side for
        ``4bit``'s two widths) between one gather of their rows and one scatter of the result;
        a sequence alone, or one that estimates its statistics now (``positional``), by itself."""
        together = [x for x in due if not _estimates_now(x[1])]
        if len(together) < 2 or len({t - self.q_end[i] for i, _, t in together}) != 1:
            together = []
        for x in due:
            if x not in together:
                self._pack(*x)
        if together:
            self._pack_together(together)

    def _pack_together(self, due):
        """Sequences ``due`` pack a block of the same size each: rows ``[q_end, target)`` of each
        gathered from the stacked window (one gather), quantized in one pass per packed buffer
        with each sequence's key scales (the pass works per row: the codes are those each
        sequence's own pass gives), and scattered into the packed rows (one write per buffer)."""
        cfg, s = self.config, self.config.sink_tokens
        idx = [i for i, _, _ in due]
        n = due[0][2] - self.q_end[idx[0]]
        qa = [self.q_end[i] - s for i in idx]
        a = [self.q_end[i] - self.recent_start[i] for i in idx]  # the block's first row in the window
        first = due[0][1]
        self._packed_room(max(qa) + n)
        _, B, H, R, d = self.recent.shape
        P = self.rows[0].shape[3]
        key = (B, H, R, P, tuple(idx), n, tuple(a), tuple(qa))

        def build():
            blk = np.arange(n)[None, None, :]
            seq, head = np.array(idx)[:, None, None], np.arange(H)[None, :, None]
            src = (seq * H + head) * R + np.array(a)[:, None, None]
            dst = (seq * H + head) * P + np.array(qa)[:, None, None]
            # flat row indices over both sides (keys then values): one gather, one scatter per buffer
            side = np.arange(2)[:, None]
            src, dst = (src + blk).reshape(1, -1), (dst + blk).reshape(1, -1)
            return (mx.array((side * B * H * R + src).reshape(-1).astype(np.int32)),
                    [mx.array((side[:lead] * B * H * P + dst).reshape(-1).astype(np.int32)) for lead in (1, 2)],
                    None if len(idx) == B else mx.array(np.array(idx, np.int32)))

        src, dst, subset = _PACK_INDEX.get(key, build)
        x = mx.take(self.recent.reshape(2 * B * H * R, d), src, axis=0).reshape(2, len(idx), H, n, d)
        lam = None if self._lam2 is None else (self._lam2 if subset is None else mx.take(self._lam2, subset, axis=1))
        k, v = first.k, first.v
        rotate = cfg.rotation != "none"
        if len(self.rows) == 1:
            blocks = [dispatch.quantize_rows(x, k.bits, cfg.group_size, clip=k.clip, lam=lam, signs=self._signs2,
                                             rotate=rotate, joined=True, align=cfg.scale_alignment)]
        else:  # views of each side (an integer index would gather)
            lams = (None, None) if lam is None else halves(lam)
            blocks = [dispatch.quantize_rows(y, side.bits, cfg.group_size, clip=side.clip,
                                             lam=None if side.lam is None else side_lam, signs=side.signs,
                                             rotate=rotate, joined=True, align=align)[None]
                      for y, side, side_lam, align in zip(halves(x), (k, v), lams, cfg.scale_alignment)]
        rows = []
        for r, b in zip(self.rows, blocks):
            lead, width = r.shape[0], r.shape[-1]
            flat = r.reshape(lead * B * H * P, width)
            flat[dst[lead - 1]] = b.reshape(-1, width)
            rows.append(flat.reshape(r.shape))
        self.rows = tuple(rows)
        for i, c, target in due:
            self.q_end[i] = c.q_end = target

    def _compact(self):
        """Drop each sequence's full-precision rows older than its trim reserve (one
        gather over the batch), growing the buffer if that frees no room."""
        keep = [max(r, q - c.reserve) for r, q, c in zip(self.recent_start, self.q_end, self.caches)]
        drop = [k - r for k, r in zip(keep, self.recent_start)]
        cap = self.recent.shape[3]
        need = max(o - k for o, k in zip(self.offsets, keep)) + 1
        new_cap = max(cap, _round_up(need + RECENT_SPARE, self.caches[0].recent_step))
        j = np.arange(new_cap)[None, :] + np.array(drop)[:, None]
        idx = mx.array(np.minimum(j, cap - 1).astype(np.int32).reshape(1, len(drop), 1, new_cap, 1))
        self.recent = mx.take_along_axis(self.recent, idx, axis=3)
        self.recent_start = keep

    def _pack(self, i: int, c, target: int):
        """Quantize sequence ``i``'s rows ``[q_end, target)`` with its own statistics (the
        cache's own quantize pass, over a view of the stacked window)."""
        s = self.config.sink_tokens
        a, b = self.q_end[i] - self.recent_start[i], target - self.recent_start[i]
        qa, qb = self.q_end[i] - s, target - s
        self._packed_room(qb)
        if _estimates_now(c):
            self._estimate(i, c)
        c._kv_recent = self.recent[:, i : i + 1]
        c.k.recent, c.v.recent = halves(c._kv_recent)
        try:
            block = c._quantize_rows(a, b)
        finally:
            c._kv_recent = c.k.recent = c.v.recent = None
        # one write of both sides stacked, or one per side
        blocks = [block] if len(self.rows) == 1 else [x[None] for x in block]
        for r, x in zip(self.rows, blocks):
            r[:, i : i + 1, :, qa:qb] = x
        self.q_end[i] = c.q_end = target

    def _estimate(self, i: int, c):
        """``positional``: sequence ``i``'s statistics, estimated as its cache estimates them
        (:meth:`OIQKVCache.estimate_on_window`) on its rows in the stacked window, which
        are then centered, with its sinks."""
        c.estimate_on_window(*halves(self.recent[:, i : i + 1]), self.recent_start[i])
        mk, mv = (ZERO if side.mean is None else side.mean for side in (c.k, c.v))
        for name in ("recent", "sinks"):
            x = getattr(self, name)
            x[:, i : i + 1] = center_pair(self.dtype)(x[0:1, i : i + 1], x[1:2, i : i + 1], mk, mv, SELECT_FIRST)
            setattr(self, name, x)
        self._views()

    # -- what attention reads -------------------------------------------------

    def attention_segments(self):
        """``(segments, mask, ranges)``: ``(sink_k, sink_v, quant, recent_k, recent_v)`` over every
        sequence, the additive mask ``(B, 1, 1, T)`` (0: attend, -inf: not) that shows each its own
        rows (the reference path's), and the same rows as ``(B, 3)`` int32 ranges (the decode
        kernel's, which then reads no other row: ``decode_attention``'s ``ranges``): the sinks,
        its packed rows before the q_end the step found, its full-precision rows from there
        on (the rows a step packs are attended exactly, as one sequence alone does;
        ``positional``: packed, before the q_end after the write)."""
        if self._segments is not None:
            return self._segments
        s = self.config.sink_tokens
        # positional: a step reads what the caches hold after its write
        found = self.attend_from is not None and not self.config.positional
        start = self.attend_from if found else self.q_end
        n_p = max(q - s for q in start)
        a0 = min(q - r for q, r in zip(start, self.recent_start))
        b0 = max(o - r for o, r in zip(self.offsets, self.recent_start))
        sink_k, sink_v = (self.k.sink, self.v.sink) if s else (None, None)
        quant = self._scales = None
        if n_p > 0:
            g = self.config.group_size
            if len(self.rows) == 1:
                codes, scales = split_rows(self.rows[0][:, :, :, :n_p], self.k.dim, self.k.bits, g)
                (kc, vc), (ks, vs) = halves(codes), halves(scales)
                self._scales = scales
            else:
                (kc, ks), (vc, vs) = (split_rows(r[0, :, :, :n_p], side.dim, side.bits, g)
                                      for r, side in zip(self.rows, (self.k, self.v)))
            quant = (kc, ks, vc, vs)
        recent_k, recent_v = halves(self.recent[:, :, :, a0:b0])
        # additive float32 (0: attend, -inf: not), the dtype the decode kernel reads: no conversion
        key = (s, n_p, a0, b0, tuple(start), tuple(self.recent_start), tuple(self.offsets))
        mask = _MASK.get(key, lambda: self._mask(s, n_p, a0, b0, start))
        ranges = _RANGES.get(key, lambda: mx.array(np.array(
            [[q - s, q - r - a0, o - r - a0] for q, r, o in zip(start, self.recent_start, self.offsets)], np.int32)))
        self.offset = mask.shape[-1]
        self._segments = ((sink_k, sink_v, quant, recent_k, recent_v), mask, ranges)
        return self._segments

    def _mask(self, s: int, n_p: int, a0: int, b0: int, start):
        B = len(self.caches)
        cols = np.full((B, s + n_p + (b0 - a0)), -np.inf, np.float32)
        cols[:, :s] = 0.0
        for i in range(B):
            cols[i, s : s + start[i] - s] = 0.0
            lo, hi = start[i] - self.recent_start[i], self.offsets[i] - self.recent_start[i]
            cols[i, s + n_p + lo - a0 : s + n_p + hi - a0] = 0.0
        return mx.array(cols.reshape(B, 1, 1, -1))

    def release(self):
        """Attention has read this step's segments."""
        self.attend_from = self._segments = None

    def packed_scales(self, n: int):
        """Both sides' scales stacked, when keys and values share one packed buffer; else None."""
        return self._scales[..., :n, :] if n > 0 and self._scales is not None else None


def _pad_rows(x: mx.array, rows: int) -> mx.array:
    """``x`` with zero rows appended on axis 3 up to ``rows``."""
    n = x.shape[3]
    if n == rows:
        return x
    return mx.pad(x, [(0, 0)] * 3 + [(0, rows - n), (0, 0)])


