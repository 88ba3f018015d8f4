"""OIQKVCache: an mlx-lm KV cache that stores rotated, quantized keys and values.

Token positions of one layer fall into three segments, in temporal order:

* ``[0, S)``: sink tokens, full precision (``sink_tokens``);
* ``[S, q_end)``: packed codes + float16 group scales (DESIGN section 3);
* ``[q_end, offset)``: the recent window, full precision (``window``, and
  everything while ``offset <= quantize_after``).

Every segment is stored *rotated* (and, with centering, minus the layer's
rotated mean), so attention works in one domain: the query is rotated once,
the output un-rotated once (``attention.py``).  The full-precision buffer also
keeps ``trim_reserve`` tokens that were already quantized, so ``trim`` of up to
that many tokens restores the exact state a cache that never saw them has.
Attention reads :meth:`OIQKVCache.attention_segments`, in which the tokens of
the current ``update_and_fetch`` are full precision even when the call (a
prompt longer than the window) already quantized them.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from . import dispatch
from .batch_cache import BatchOIQKVCache, detached_copy
from .codec import bytes_per_token, dequantize
from .config import OIQConfig
from .rotation import random_signs, rotate, unrotate

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# Flushes of at most this many rows quantize keys and values in one call
# (decode); larger ones (prefill) skip the concatenation copy.
_STACK_MAX_ROWS = 64


def layer_seed(seed: int, layer_idx: int, which: int) -> int:
    """Seed of the sign vector of one layer's keys (which=0) or values (which=1)."""
    return (seed * 1_000_003 + layer_idx) * 2 + which


def pad_last(x: mx.array, dim: int) -> mx.array:
    if x.shape[-1] == dim:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dim - x.shape[-1])])


def _grow(buf, used: int, needed: int, step: int, shape_tail, dtype, batch_heads):
    """Return ``buf`` with capacity >= needed, keeping its first ``used`` rows."""
    if buf is not None and needed <= buf.shape[2]:
        return buf
    cap = -(-needed // step) * step
    new = mx.zeros((*batch_heads, cap, *shape_tail), dtype)
    if buf is not None and used:
        new[:, :, :used] = buf[:, :, :used]
    return new


class _Side:
    """Storage of one side (keys or values) of one layer."""

    def __init__(self, bits: int, group_size: int, clip: bool, center: bool, scale_power: float = 0.0):
        self.bits, self.group_size, self.clip, self.center = bits, group_size, clip, center
        self.scale_power = scale_power
        self.head_dim = self.dim = None
        self.signs = self.mean = self.lam = None
        self.rotated = True
        self.codes = self.scales = None
        self.sink = None
        self.recent = None

    def init(self, x: mx.array, signs: mx.array, dim: int, rotated: bool):
        self.head_dim, self.dim, self.signs, self.rotated = x.shape[-1], dim, signs, rotated

    def rotate(self, x: mx.array) -> mx.array:
        return rotate(x, self.signs) if self.rotated else x.astype(mx.float32)

    def unrotate(self, y: mx.array) -> mx.array:
        return unrotate(y, self.signs) if self.rotated else y.astype(mx.float32)

    def to_storage(self, x: mx.array, first: bool, skip: int = 0) -> mx.array:
        """Pad, center, scale per channel and rotate new vectors ``(B, H, L, d)`` (fp32).

        On the first chunk the per-channel mean ``m`` and scale ``lam`` are
        estimated, from its tokens past the first ``skip`` (the sink tokens,
        kept in full precision anyway, whose outlying keys and values would
        pull the mean away from the tokens that get quantized); every vector
        is stored as ``r((x - m) / lam)`` and ``mean``
        holds ``r(m / lam)`` in the same domain, so that a query scaled by
        ``lam`` and rotated scores ``q . x`` up to the per-query constant
        ``q . m`` (which softmax ignores).
        """
        x = pad_last(x, self.dim).astype(mx.float32)
        if first:
            ref = x[:, :, skip:] if x.shape[2] > skip else x
            m = mx.mean(ref, axis=2, keepdims=True) if self.center else None
            if self.scale_power > 0:
                centered = ref if m is None else ref - m
                rms = mx.sqrt(mx.mean(mx.square(centered), axis=2, keepdims=True))
                # only channels louder than the head's median are shrunk: quiet
                # channels are never amplified, and magnitudes only decrease
                median = mx.sort(rms, axis=-1)[..., self.dim // 2 : self.dim // 2 + 1] + 1e-6
                self.lam = mx.power(mx.maximum(rms, median) / median, self.scale_power)
            if m is not None:
                self.mean = self.rotate(m if self.lam is None else m / self.lam)
        if self.mean is not None:
            x = x - (self.unrotate(self.mean) if self.lam is None else self.unrotate(self.mean) * self.lam)
        if self.lam is not None:
            x = x / self.lam
        return self.rotate(x)

    def nbytes(self) -> int:
        arrays = (self.codes, self.scales, self.sink, self.recent, self.mean, self.signs, self.lam)
        return sum(a.nbytes for a in arrays if a is not None)


class OIQKVCache(_BaseCache):
    """mlx-lm cache contract (``update_and_fetch``, ``offset``, ``state``,
    ``from_state``, ``trim``, ``make_mask``, ``nbytes``...) over OIQ storage.

    ``update_and_fetch`` returns ``(self, self)``: attention reads the cache
    directly through :func:`oiq_mlx.attention.oiq_attention`, which
    ``oiq_mlx.integration`` routes mlx-lm's ``scaled_dot_product_attention`` to.
    """

    step = 256
    recent_step = 64

    def __init__(self, config: OIQConfig | None = None, *, layer_idx: int = 0, head_dim: int | None = None):
        self.config = config if config is not None else OIQConfig()
        if not isinstance(self.config, OIQConfig):
            raise ValueError(f"config must be an OIQConfig, got {type(self.config).__name__}")
        if head_dim is not None:
            self.config.storage_dim(head_dim)
        self.layer_idx = int(layer_idx)
        self.offset = 0
        self.q_end = self.config.sink_tokens
        self.recent_start = self.config.sink_tokens
        self.dtype = None
        # this call's rotated keys/values in full precision, kept only when some of
        # them were quantized before attention reads them (see attention_segments)
        self._fresh = None
        cfg = self.config
        k_bits, v_bits = cfg.bits_for_layer(self.layer_idx)
        self.k = _Side(k_bits, cfg.group_size, cfg.clip, cfg.center_keys, cfg.key_scaling)
        self.v = _Side(v_bits, cfg.group_size, cfg.clip, cfg.center_values)

    # -- writing -----------------------------------------------------------

    def _init_storage(self, keys: mx.array, values: mx.array):
        cfg = self.config
        self.dtype = keys.dtype
        for which, (side, x) in enumerate(((self.k, keys), (self.v, values))):
            dim = cfg.storage_dim(x.shape[-1])
            if cfg.rotation == "hadamard":
                signs = random_signs(layer_seed(cfg.seed, self.layer_idx, which), dim)
            else:
                signs = mx.ones((dim,), mx.float32)
            side.init(x, signs, dim, cfg.rotation != "none")

    def _check(self, keys, values):
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, mx.array) or x.ndim != 4:
                raise ValueError(f"{name} must be an mx.array of shape (B, n_kv_heads, L, head_dim)")
            if not mx.issubdtype(x.dtype, mx.floating):
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on (B, n_kv_heads, L)")
        if self.dtype is not None:
            expected = (self.batch_heads, self.k.head_dim, self.v.head_dim)
            got = (tuple(keys.shape[:2]), keys.shape[-1], values.shape[-1])
            if got != expected:
                raise ValueError(f"this cache holds (B, H), k_dim, v_dim = {expected}, got {got}")

    @property
    def batch_heads(self):
        return tuple(self.k.sink.shape[:2]) if self.k.sink is not None else None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check(keys, values)
        first = self.dtype is None
        if first:
            self._init_storage(keys, values)
        cfg, start, L = self.config, self.offset, keys.shape[2]
        bh = tuple(keys.shape[:2])
        n_sink = max(0, min(cfg.sink_tokens, start + L) - start)
        if L > n_sink:
            self._reserve_recent(start + L, bh)
        fresh = []
        for side, x in ((self.k, keys), (self.v, values)):
            y = side.to_storage(x, first, skip=n_sink).astype(self.dtype)
            fresh.append(y)
            if side.sink is None:
                side.sink = mx.zeros((*bh, cfg.sink_tokens, side.dim), self.dtype)
            if n_sink:
                side.sink[:, :, start : start + n_sink] = y[:, :, :n_sink]
            if L > n_sink:
                a = start + n_sink - self.recent_start
                side.recent[:, :, a : a + L - n_sink] = y[:, :, n_sink:]
        self.offset = start + L
        self._flush(bh)
        self._fresh = (start, *fresh) if self.q_end > max(start, cfg.sink_tokens) else None
        return self, self

    def _reserve_recent(self, end: int, bh):
        """Make the full-precision buffers hold positions up to ``end``,
        dropping rows older than the trim reserve when reallocating."""
        rec = self.k.recent
        if rec is not None and end - self.recent_start <= rec.shape[2]:
            return
        self._compact(end, bh)

    def _compact(self, end: int, bh):
        keep_from = max(self.recent_start, self.q_end - self.config.trim_reserve)
        drop, used = keep_from - self.recent_start, self.offset - self.recent_start
        cap = -(-(end - keep_from) // self.recent_step) * self.recent_step
        for side in (self.k, self.v):
            new = mx.zeros((*bh, cap, side.dim), self.dtype)
            if side.recent is not None and used > drop:
                new[:, :, : used - drop] = side.recent[:, :, drop:used]
            side.recent = new
        self.recent_start = keep_from

    def _flush(self, bh):
        """Quantize tokens that left the full-precision window."""
        cfg = self.config
        if self.offset <= cfg.quantize_after:
            return
        target = max(cfg.sink_tokens, self.offset - cfg.window)
        if target <= self.q_end:
            return
        a, b = self.q_end - self.recent_start, target - self.recent_start
        qa, qb = self.q_end - cfg.sink_tokens, target - cfg.sink_tokens
        for side, (codes, scales) in zip((self.k, self.v), self._quantize_rows(a, b)):
            side.codes = _grow(side.codes, qa, qb, self.step, codes.shape[-1:], mx.uint32, bh)
            side.scales = _grow(side.scales, qa, qb, self.step, scales.shape[-1:], mx.float16, bh)
            side.codes[:, :, qa:qb] = codes
            side.scales[:, :, qa:qb] = scales
        self.q_end = target
        # rows older than the trim reserve are dead: drop them once a step of
        # them accumulates, so full-precision capacity stays near window + reserve
        if self.q_end - cfg.trim_reserve - self.recent_start >= self.recent_step:
            self._compact(self.offset, bh)

    def _quantize_rows(self, a: int, b: int):
        """``(codes, scales)`` of keys and of values for rows ``[a, b)`` of the window buffers.

        At decode one or two rows leave the window per step, where the cost is
        the number of ops, not the data: keys and values of the same bits and
        width then go through one quantize call (it works per token and group,
        so the result is identical) instead of two.
        """
        k, v, cfg = self.k, self.v, self.config
        if b - a > _STACK_MAX_ROWS or (k.bits, k.dim, k.clip) != (v.bits, v.dim, v.clip):
            return [dispatch.quantize(s.recent[:, :, a:b], s.bits, cfg.group_size, clip=s.clip) for s in (k, v)]
        n = k.recent.shape[0]
        rows = mx.concatenate([k.recent[:, :, a:b], v.recent[:, :, a:b]], axis=0)
        codes, scales = dispatch.quantize(rows, k.bits, cfg.group_size, clip=k.clip)
        return [(codes[:n], scales[:n]), (codes[n:], scales[n:])]

    # -- reading -----------------------------------------------------------

    def segments(self):
        """Stored data for attention, each in the rotated (centered) domain.

        Returns ``(sink_k, sink_v, quant, recent_k, recent_v)``; ``quant`` is
        None or ``(k_codes, k_scales, v_codes, v_scales)`` sliced to the used
        length; any full-precision part may be None when empty.
        """
        cfg = self.config
        n_sink = min(cfg.sink_tokens, self.offset)
        sink_k = self.k.sink[:, :, :n_sink] if n_sink else None
        sink_v = self.v.sink[:, :, :n_sink] if n_sink else None
        n_q = self.q_end - cfg.sink_tokens if self.offset > cfg.sink_tokens else 0
        quant = None
        if n_q > 0:
            quant = (self.k.codes[:, :, :n_q], self.k.scales[:, :, :n_q], self.v.codes[:, :, :n_q], self.v.scales[:, :, :n_q])
        a, b = max(self.q_end, cfg.sink_tokens) - self.recent_start, self.offset - self.recent_start
        recent_k = self.k.recent[:, :, a:b] if b > a else None
        recent_v = self.v.recent[:, :, a:b] if b > a else None
        return sink_k, sink_v, quant, recent_k, recent_v

    def attention_segments(self):
        """What attention reads: :meth:`segments`, except that the tokens written
        by the last ``update_and_fetch`` are always full precision.

        A call that writes more tokens than the window holds (a prompt, a
        chunk) quantizes some of them before its own queries attend to them.
        Those queries get the exact keys and values instead, as a
        full-precision cache would give them: prefill attention is exact, so
        quantization error never flows into the keys and values of later
        layers during prefill; it only affects queries of later calls.  The
        full-precision copy is the call's own input, held until the next
        write and released by :meth:`release_fresh` once attention has read it.
        """
        segs = self.segments()
        fresh = self._fresh
        if fresh is None or fresh[0] + fresh[1].shape[2] != self.offset:
            return segs
        start, fk, fv = fresh
        sink_k, sink_v, quant, _, _ = segs
        cut = max(start, self.config.sink_tokens)  # sinks are stored exactly already
        n_q = cut - self.config.sink_tokens
        if quant is not None:
            quant = tuple(a[:, :, :n_q] for a in quant) if n_q > 0 else None
        a = cut - start
        return sink_k, sink_v, quant, fk[:, :, a:], fv[:, :, a:]

    def release_fresh(self):
        """Drop the full-precision copy of the last write (attention calls this)."""
        self._fresh = None

    def dequantized_kv(self):
        """All keys and values as the attention sees them, un-rotated, float32,
        ``(B, H, offset, d)``.  For evaluation and tests, not for decoding."""
        sink_k, sink_v, quant, recent_k, recent_v = self.segments()
        out = []
        for side, parts in ((self.k, (sink_k, quant and quant[:2], recent_k)), (self.v, (sink_v, quant and quant[2:], recent_v))):
            chunks = []
            for i, p in enumerate(parts):
                if p is None:
                    continue
                if i == 1:
                    p = dequantize(*p, bits=side.bits, group_size=self.config.group_size)
                chunks.append(p.astype(mx.float32))
            y = mx.concatenate(chunks, axis=2)
            if side.mean is not None:
                y = y + side.mean
            y = side.unrotate(y)
            if side.lam is not None:
                y = y * side.lam
            out.append(y[..., : side.head_dim])
        return tuple(out)

    # -- mlx-lm contract -----------------------------------------------------

    def size(self):
        return self.offset

    def empty(self):
        return self.dtype is None

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, int(n)))
        self._fresh = None
        self.offset -= n
        cfg = self.config
        if self.offset < self.recent_start:
            # every full-precision row is gone: the buffer restarts here
            self.recent_start = max(self.offset, cfg.sink_tokens)
        if self.offset <= cfg.quantize_after:
            wanted = cfg.sink_tokens
        else:
            wanted = max(cfg.sink_tokens, self.offset - cfg.window)
        # quantized tokens still held in full precision return to the window
        self.q_end = max(cfg.sink_tokens, min(self.q_end, self.offset, max(wanted, self.recent_start)))
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def __deepcopy__(self, memo):
        # mlx-lm's prompt cache deep-copies caches; mx.Dtype cannot be, and
        # arrays are values, so new handles on the same data are a full copy
        return detached_copy(self)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching hook: one :class:`~oiq_mlx.batch_cache.BatchOIQKVCache` over ``caches``."""
        return BatchOIQKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        """Bytes of every array this cache holds (allocated capacity included)."""
        return self.k.nbytes() + self.v.nbytes()

    def quantized_nbytes_formula(self) -> int:
        """What the quantized segment must occupy: capacity x bytes_per_token x B x H."""
        if self.k.codes is None:
            return 0
        b, h, cap = self.k.codes.shape[:3]
        per = bytes_per_token(self.k.dim, self.k.bits, self.config.group_size)
        per += bytes_per_token(self.v.dim, self.v.bits, self.config.group_size)
        return b * h * cap * per

    @property
    def state(self):
        sink_k, sink_v, quant, _, _ = self.segments()
        n_q = 0 if quant is None else quant[0].shape[2]
        keep = slice(0, 0)
        if self.k.recent is not None:
            keep = slice(0, self.offset - self.recent_start)
        arrays = []
        for side in (self.k, self.v):
            arrays += [
                None if side.codes is None else side.codes[:, :, :n_q],
                None if side.scales is None else side.scales[:, :, :n_q],
                side.sink,
                None if side.recent is None else side.recent[:, :, keep],
                side.signs,
                side.mean,
                side.lam,
            ]
        meta = {
            "config": self.config.to_json(),
            "layer_idx": self.layer_idx,
            "offset": self.offset,
            "q_end": self.q_end,
            "recent_start": self.recent_start,
            "dtype": None if self.dtype is None else str(self.dtype).split(".")[-1],
            "head_dims": [self.k.head_dim, self.v.head_dim],
            "dims": [self.k.dim, self.v.dim],
        }
        return arrays + [json.dumps(meta)]

    @state.setter
    def state(self, v):
        meta = json.loads(v[-1])
        self.__init__(OIQConfig.from_json(meta["config"]), layer_idx=meta["layer_idx"])
        self.offset, self.q_end, self.recent_start = meta["offset"], meta["q_end"], meta["recent_start"]
        self.dtype = None if meta["dtype"] is None else _DTYPES[meta["dtype"]]
        for i, side in enumerate((self.k, self.v)):
            codes, scales, sink, recent, signs, mean, lam = v[7 * i : 7 * i + 7]
            side.codes, side.scales, side.sink, side.recent = codes, scales, sink, recent
            side.signs, side.mean, side.lam = signs, mean, lam
            side.head_dim, side.dim = meta["head_dims"][i], meta["dims"][i]
            side.rotated = self.config.rotation != "none"
            if side.codes is not None and side.codes.shape[2] == 0:
                side.codes = side.scales = None
