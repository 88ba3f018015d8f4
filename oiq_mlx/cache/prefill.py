"""How an :class:`~oiq_mlx.cache.sequence.OIQKVCache` ends a prompt's prefill and estimates
its statistics: :class:`PromptPacking` is mixed into ``OIQKVCache`` and holds no state of its
own; its methods read and write the counters and buffers that ``sequence.py`` lays out.

A prompt's rows are packed in pieces of at most :data:`PIECE_ROWS` rows, each evaluated before
the next is built (:func:`eval_now`), so that packing a long prompt needs temporaries of one
piece, not of the prompt, and the full-precision rows of one layer are freed before the next
layer packs (DESIGN.md section 5).  The quantizer works per row and group, so the pieces give
the codes and scales one pass over all rows gives.
"""

from __future__ import annotations

import mlx.core as mx

from .common import SELECT_FIRST, ZERO, center_one, center_pair, halves

# rows of one side packed per evaluated piece when a call packs more than a decode block
PIECE_ROWS = 512

_TRACING = "[eval] Attempting to eval an array during function transformations"


def eval_now(arrays) -> None:
    """Evaluate ``arrays`` now, unless the caller is being traced (``mx.compile``,
    ``mx.export_function``), where they stay lazy: the values are the same either way, only
    when memory is freed changes."""
    try:
        mx.eval(arrays)
    except ValueError as e:
        if not str(e).startswith(_TRACING):
            raise


class PromptPacking:
    """Ending the prefill (``exact_prefill``) and estimating the statistics of
    :class:`~oiq_mlx.cache.sequence.OIQKVCache` (a mixin)."""

    def end_prefill(self):
        """``exact_prefill``: end the prompt's prefill now.  The rows it kept in full precision
        are packed as a prompt written in one call leaves them, with the statistics estimated on
        all of them (the sinks left out, as the first call's estimate leaves them out), and the
        full-precision buffer drops what is packed.  Called by the first one-token call, by a
        call that would take the cache past ``exact_prefill`` tokens (before they write), and by
        ``trim`` (speculative decoding trims after each verify call; a prefill never trims);
        call it before saving a prompt's cache or to free memory early.  A no-op once ended."""
        if not self._prefilling:
            return
        self._prefilling = False
        if self.dtype is None or self.offset == 0:
            return  # nothing waited: the call ending it estimates on its own rows
        n_sink = min(self.config.sink_tokens, self.offset)
        if self.recent_start == 0 and n_sink:
            # the prompt waited from position 0 (update_and_fetch): its sinks go to a buffer of
            # their own (a copy: a view would keep the whole prompt buffer alive)
            for side in (self.k, self.v):
                side.sink = mx.array(side.recent[:, :, :n_sink])
        if self.k.needs_statistics or self.v.needs_statistics:
            # the rows held are the prompt's: estimated as the first call's rows would be
            # had the prompt come in one call (its sinks left out unless it is all sinks)
            for side in (self.k, self.v):
                if side.needs_statistics:
                    if self.recent_start == 0:
                        rows = side.recent[:, :, : self.offset]  # the sinks are held there too
                    elif side.recent is not None and self.offset > n_sink:
                        rows = mx.concatenate([side.sink[:, :, :n_sink],
                                               side.recent[:, :, : self.offset - self.recent_start]], axis=2)
                    else:
                        rows = side.sink[:, :, :n_sink]
                    side.estimate(rows, n_sink)
            self._stacked = None
            self._shift_held(center=True)
        self._attend_from = self._fresh = None
        bh = self.batch_heads
        self._flush(bh)
        if self._keep_from() > self.recent_start:
            self._compact(self.offset, bh)
        # this layer's prompt rows are packed and its full-precision buffer cut to the window
        # now, before the next layer's are: the old buffer is freed here, not when the step's
        # whole graph runs with every layer's old buffer and new packed rows alive at once
        eval_now([a for side in (self.k, self.v) for a in side.arrays()])

    @property
    def prefilling(self) -> bool:
        """True while ``exact_prefill`` keeps the prompt's rows in full precision
        (until :meth:`end_prefill`)."""
        return self._prefilling

    def _estimate_positional(self):
        """``positional``: before the first block is packed, estimate the statistics and
        center every full-precision row held, as if they had been centered when written."""
        self.estimate_on_window(self.k.recent, self.v.recent, self.recent_start)
        self._shift_held(center=True)

    def estimate_on_window(self, k_recent, v_recent, recent_start: int):
        """``positional``: estimate the statistics on the rows from the sinks up to
        :attr:`statistics_end` of full-precision buffers ``(B, H, rows, d)`` whose first row
        is position ``recent_start`` (this cache's, or its slice of a stacked batch's)."""
        s = self.config.sink_tokens
        lo, hi = max(s, recent_start) - recent_start, self.statistics_end - recent_start
        for side, rows in ((self.k, k_recent), (self.v, v_recent)):
            if side.needs_statistics:
                side.estimate(rows[:, :, lo:hi], 0)
        self._stacked = None

    def _shift_held(self, center: bool):
        """Subtract (``center``) or add back the sides' means from every full-precision row
        held: the sinks, the window buffer and the rows a call holds aside.  Centering goes
        through the same pass as rows written after the statistics exist, so a row stores
        the same value whichever came first."""
        k, v = self.k, self.v
        if k.mean is None and v.mean is None:
            return
        mk, mv = (ZERO if side.mean is None else side.mean for side in (k, v))

        def shift(x, m):
            if center:
                return center_one(self.dtype)(x, m)
            return (x.astype(mx.float32) + m).astype(self.dtype)

        k.sink, v.sink = shift(k.sink, mk), shift(v.sink, mv)
        if self._kv_recent is not None:
            if center:
                self._kv_recent = center_pair(self.dtype)(self._kv_recent[0:1], self._kv_recent[1:2], mk, mv,
                                                           SELECT_FIRST)
            else:
                self._kv_recent = mx.stack([shift(x, m) for x, m in zip(halves(self._kv_recent), (mk, mv))])
            k.recent, v.recent = halves(self._kv_recent)
        elif k.recent is not None:
            k.recent, v.recent = shift(k.recent, mk), shift(v.recent, mv)
        if self._fresh is not None:
            self._fresh = (shift(self._fresh[0], mk), shift(self._fresh[1], mv))

    def _reset_statistics(self):
        """``positional``: nothing is packed any more, so the statistics, estimated on rows
        that may since have been trimmed away, are estimated again when a block is next packed."""
        self._shift_held(center=False)
        for side in (self.k, self.v):
            side.mean = side.lam = None
        self._stacked = None
