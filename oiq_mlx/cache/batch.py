"""BatchOIQKVCache: mlx-lm's batch-cache contract over one OIQ cache per sequence.

mlx-lm's continuous batching (``BatchGenerator``, checked against mlx-lm
0.32.2) merges the per-sequence caches of one layer with ``merge``, right-pads
prompts of different lengths (``prepare(lengths=, right_padding=)`` ...
``finalize``), drops finished sequences with ``filter``, adds new ones with
``extend`` and hands a finished sequence's cache back with ``extract``.

Here the batch keeps every sequence's own :class:`~oiq_mlx.cache.OIQKVCache`
(own offset, sinks, centering statistics, packed segment and window) and
writes to each only that sequence's real rows: padding never reaches a
sequence's storage, statistics or sinks, so each sequence is stored exactly
as it would be if it ran alone.  Prompt chunks are written and attended per
sequence (:func:`oiq_mlx.cache.attention.oiq_batch_attention`, each sequence with its
slice of the batch mask).  Decode steps (one token per sequence) run over
storage stacked across the sequences (:mod:`oiq_mlx.cache.stacked`): one write and one
attention pass for the whole batch, each sequence still seeing only its own
rows; the storage goes back to the sequences' caches whenever the batch does
anything else (a prompt chunk, ``extend``, ``trim``, a mask) or a sequence leaves
it (``extract``, which copies that sequence out).

The module imports no other oiq_mlx module at import time, so that
``OIQKVCache.merge`` can name this class without an import cycle.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


def detached_copy(cache):
    """A copy of an OIQ cache that later writes to either one do not reach the other.

    MLX arrays are values: ``x[...]`` is a new handle on the same data, and
    ``x[a:b] = y`` on one handle rebinds only that handle, so no data is copied.
    """
    new = copy.copy(cache)
    new.k, new.v = copy.copy(cache.k), copy.copy(cache.v)
    for holder in (new, new.k, new.v):
        for name, value in vars(holder).items():
            if isinstance(value, mx.array):
                setattr(holder, name, value[...])
    return new


def _what_state(v) -> str:
    """What a state that is not a batch's looks like it is, for the error."""
    if isinstance(v, (list, tuple)) and v and isinstance(v[-1], str):
        return " holding one OIQKVCache's state (a single sequence's cache, not a batch)"
    if isinstance(v, (list, tuple)) and v and all(isinstance(a, mx.array) for a in v):
        return " holding the stacked decode storage (a batch saved while decoding: unstack() it before saving)"
    return ""


class BatchOIQKVCache(_BaseCache):
    """A batch of OIQ caches of one layer (``B`` sequences).

    ``offset`` is the ``(B,)`` array of per-sequence lengths (rotary
    positions), as in mlx-lm's ``BatchKVCache``.  :meth:`make_mask` gives a
    boolean ``(B, 1, N, T)`` mask whose row ``i`` holds sequence ``i``'s keys
    right-aligned in the last ``offset[i]`` columns (after this step's write).
    """

    # the class of the sequences' caches (OIQKVCache): oiq_mlx.cache.sequence, which imports
    # this module, sets it; from_state builds them
    sequence_class = None

    def __init__(self, caches):
        self.caches = list(caches)
        # real tokens each sequence still has in a right-padded prompt
        # (prepare .. finalize); None outside one
        self._remaining = None
        # while the batch decodes: its storage stacked across sequences (oiq_mlx.cache.stacked)
        self.stacked = None

    def unstack(self):
        """Give the sequences' caches their storage back (no-op when not stacked)."""
        if self.stacked is not None:
            self.stacked.unstack()
            self.stacked = None

    def __deepcopy__(self, memo):
        self.unstack()
        new = BatchOIQKVCache(detached_copy(c) for c in self.caches)
        new._remaining = None if self._remaining is None else list(self._remaining)
        return new

    @classmethod
    def merge(cls, caches):
        """One batch over ``caches`` (OIQ caches of the same layer), which stay untouched."""
        caches = list(caches)
        if not caches:
            raise ValueError("merge needs at least one cache")
        first = caches[0]
        for c in caches:
            if type(c) is not type(first) or c.config != first.config or c.layer_idx != first.layer_idx:
                raise ValueError(
                    "merge needs OIQ caches of one layer with one config; got "
                    f"{type(c).__name__} layer {getattr(c, 'layer_idx', None)} next to "
                    f"{type(first).__name__} layer {first.layer_idx}"
                )
        return cls(detached_copy(c) for c in caches)

    # -- the batch contract -------------------------------------------------

    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches], dtype=mx.int32)

    def _rows(self, N: int) -> list[int]:
        """Real rows of each sequence in a step of ``N`` positions."""
        if self._remaining is None:
            return [N] * len(self.caches)
        return [min(N, r) for r in self._remaining]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and max(left_padding, default=0) > 0:
            raise ValueError(
                "BatchOIQKVCache takes right-padded prompts (prepare(lengths=, right_padding=)), "
                "as mlx-lm's BatchGenerator sends them; left padding is not supported"
            )
        if lengths is None:
            return
        self.unstack()
        lengths = [int(x) for x in lengths]
        if len(lengths) != len(self.caches):
            raise ValueError(f"prepare got {len(lengths)} lengths for a batch of {len(self.caches)}")
        if right_padding is not None:
            right_padding = [int(x) for x in right_padding]
            if len(right_padding) != len(lengths) or len(set(a + b for a, b in zip(lengths, right_padding))) != 1:
                raise ValueError(f"lengths {lengths} + right_padding {right_padding} must be equal for every sequence")
        self._remaining = lengths

    def finalize(self):
        if self._remaining is not None and any(self._remaining):
            left = self._remaining
            self._remaining = None
            raise ValueError(f"finalize before the prompt was written: {left} real tokens were never written")
        self._remaining = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, L = keys.shape[0], keys.shape[2]
        if B != len(self.caches):
            raise ValueError(f"keys hold {B} sequences, this batch {len(self.caches)}")
        if L == 1 and self._remaining is None:
            from .stacked import StackedDecode, stackable

            if self.stacked is None and stackable(self.caches):
                self.stacked = StackedDecode.stack(self.caches)
            if self.stacked is not None:
                self.stacked.update(keys, values)
                return self, self
        self.unstack()
        rows = self._rows(L)
        for i, (c, n) in enumerate(zip(self.caches, rows)):
            if n:
                c.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
        if self._remaining is not None:
            self._remaining = [r - n for r, n in zip(self._remaining, rows)]
        return self, self

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Mask of the next ``N``-position step (called before it is written).

        Query ``j`` of sequence ``i`` sits at position ``offset[i] + j`` and
        sees its keys at positions ``<= offset[i] + j`` (and within
        ``window_size``).  Padding queries (past a sequence's real rows) see
        every key, so no row of the softmax is empty.  ``None`` for one query
        per sequence without a window (every key visible), as mlx-lm does.
        """
        if N == 1 and window_size is None and not return_array:
            return None
        starts = [c.offset for c in self.caches]
        ends = [a + n for a, n in zip(starts, self._rows(N))]
        T = max(1, *ends)
        off = mx.array(starts, dtype=mx.int32)
        key_pos = mx.arange(T)[None, :] - (T - mx.array(ends, dtype=mx.int32))[:, None]
        k = key_pos[:, None, :]
        q = (off[:, None] + mx.arange(N)[None, :])[:, :, None]
        mask = (k >= 0) & (k <= q)
        if window_size is not None:
            mask = mask & (q - k < window_size)
        return mx.expand_dims(mask, 1)

    def filter(self, batch_indices):
        if isinstance(batch_indices, mx.array):
            batch_indices = batch_indices.tolist()
        if self.stacked is not None:
            if batch_indices:
                self.stacked.filter(batch_indices)
            else:
                self.stacked = None  # no sequence left: nothing to give back
        self.caches = [self.caches[int(i)] for i in batch_indices]
        if self._remaining is not None:
            self._remaining = [self._remaining[int(i)] for i in batch_indices]

    def extend(self, other):
        if not isinstance(other, BatchOIQKVCache):
            raise ValueError(f"cannot extend a BatchOIQKVCache with {type(other).__name__}")
        if (self._remaining is None) != (other._remaining is None):
            raise ValueError("cannot extend a batch in the middle of a padded prompt with one that is not")
        if self.stacked is not None and other._remaining is None:
            from .stacked import StackedDecode, stackable

            # sequences joining a decoding batch are appended to its stacked storage
            if other.stacked is None and stackable(other.caches):
                other.stacked = StackedDecode.stack(other.caches)
            if other.stacked is not None and self.stacked.fits(other.stacked):
                self.stacked.extend(other.stacked)
                other.stacked = None
                self.caches += other.caches
                return
        self.unstack()
        other.unstack()
        self.caches += other.caches
        if self._remaining is not None:
            self._remaining += other._remaining

    def extract(self, idx: int):
        """Sequence ``idx``'s cache, intact, as a single-sequence OIQ cache
        that later writes to this batch do not change."""
        if self.stacked is not None:
            return self.stacked.extract(idx, detached_copy)
        return detached_copy(self.caches[idx])

    def size(self) -> int:
        return max((c.offset for c in self.caches), default=0)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.unstack()
        return max((c.trim(n) for c in self.caches), default=0)

    @property
    def state(self):
        """One :attr:`OIQKVCache.state` per sequence (what ``save_prompt_cache`` writes and
        :meth:`from_state` reads back).  While the batch decodes stacked it is the stacked
        storage instead (what evaluating the state must evaluate, without a copy per step):
        call :meth:`unstack` before saving a batch that is decoding."""
        if self.stacked is not None:
            return self.stacked.state
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v):
        if (not isinstance(v, (list, tuple)) or not v
                or not all(isinstance(s, (list, tuple)) and s and isinstance(s[-1], str) for s in v)):
            raise ValueError(
                "BatchOIQKVCache state refused: state must be a non-empty list of OIQKVCache states (one per "
                f"sequence, each ending in its metadata string); got {type(v).__name__}" + _what_state(v))
        caches = [self.sequence_class.from_state(s) for s in v]
        first = caches[0]
        for i, c in enumerate(caches):
            if c.config != first.config or c.layer_idx != first.layer_idx:
                raise ValueError(f"BatchOIQKVCache state refused: sequence {i} is layer {c.layer_idx} with another "
                                 f"config than sequence 0 (layer {first.layer_idx}); a batch holds one layer")
        self.__init__(caches)

    @property
    def keys(self):
        """The first sequence's :attr:`OIQKVCache.keys`: mlx-lm's pipeline models
        chain their send to the last local cache through it, and evaluating
        :attr:`state` (what the batch generator does after each prefill chunk)
        evaluates that sequence's state, hence the send."""
        return self.caches[0].keys

    @keys.setter
    def keys(self, value):
        self.caches[0].keys = value

    @property
    def nbytes(self) -> int:
        if self.stacked is not None:
            return self.stacked.nbytes
        return sum(c.nbytes for c in self.caches)
