"""Helpers the cache classes share: buffer growth, key/value halves, centering, host-side memos,
the seeds and sign vectors of a layer."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..core.config import OIQConfig
from ..core.rotation import random_signs

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

def layer_seed(seed: int, layer_idx: int, which: int) -> int:
    """Seed of the sign vector of one layer's keys (which=0) or values (which=1)."""
    return (seed * 1_000_003 + layer_idx) * 2 + which


def expected_signs(config: OIQConfig, layer_idx: int, which: int, dim: int) -> mx.array:
    """The sign vector ``(dim,)`` of one layer's keys (which=0) or values (which=1)."""
    if config.rotation == "hadamard":
        return random_signs(layer_seed(config.seed, layer_idx, which), dim)
    return mx.ones((dim,), mx.float32)


def pad_last(x: mx.array, dim: int) -> mx.array:
    if x.shape[-1] == dim:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dim - x.shape[-1])])


def grow(buf, used: int, needed: int, step: int, shape_tail, dtype, lead, limit: int | None = None):
    """Return ``buf`` ``(*lead, rows, *shape_tail)`` with capacity >= needed rows (a
    multiple of ``step``, at most ``limit``), keeping its first ``used`` rows."""
    axis = len(lead)
    if buf is not None and needed <= buf.shape[axis]:
        return buf
    cap = -(-needed // step) * step
    if limit is not None:
        cap = min(cap, limit)
    return kept_rows(buf, 0, used, (*lead, cap, *shape_tail), dtype, axis)


def kept_rows(buf, start: int, end: int, shape, dtype, axis: int = -2) -> mx.array:
    """A new buffer of ``shape`` holding rows ``[start, end)`` of ``buf`` along ``axis`` first:
    those rows copied once and only the rest zero-filled (not a zero fill of the whole buffer,
    then a copy over it)."""
    if buf is None or end <= start:
        return mx.zeros(shape, dtype)
    axis %= len(shape)
    kept = buf[(slice(None),) * axis + (slice(start, end),)]
    rest = shape[axis] - (end - start)
    if not rest:
        return mx.array(kept)
    return mx.concatenate([kept, mx.zeros((*shape[:axis], rest, *shape[axis + 1:]), dtype)], axis=axis)


def pair_tables(k, v):
    """``(lam, signs)`` of one quantize pass over keys and values stacked on a new first axis: both
    sides' key scales ``(2, B, H, 1, d)`` (ones for a side without; None when neither has any)
    and signs ``(2, 1, 1, 1, d)``, as a cache's own stacked pass and a stacked batch's use them."""
    lam = None
    if k.lam is not None or v.lam is not None:
        ref = k.lam if k.lam is not None else v.lam
        lam = mx.stack([mx.ones_like(ref) if s.lam is None else s.lam for s in (k, v)])
    return lam, mx.stack([k.signs, v.signs]).reshape(2, 1, 1, 1, -1)


def write_rows(buf: mx.array, start: int, rows: mx.array, axis: int = 2) -> mx.array:
    """``buf`` with ``rows`` written from row ``start`` along ``axis``, in a buffer of its own.
    An update that covers all of ``buf`` comes back from MLX as the update itself, and a view
    (a few sink or window rows of a prompt's call) would keep the whole array it views alive:
    that one is copied."""
    if rows.shape == buf.shape:
        return mx.array(rows, dtype=buf.dtype)
    buf[(slice(None),) * axis + (slice(start, start + rows.shape[axis]),)] = rows
    return buf


def halves(a: mx.array):
    """The two rows of ``a`` along its first axis (keys, values) as views."""
    return a[0:1].reshape(a.shape[1:]), a[1:2].reshape(a.shape[1:])


@functools.lru_cache(maxsize=None)
def center_pair(dtype):
    """Both sides' new rows minus their means, in ``dtype``, stacked on a new first
    axis by one elementwise pass (``select`` broadcasts ``[True, False]``)."""

    def center(k, v, mk, mv, select):
        # k, v come with the new axis already (a view): inside, elementwise only, one fused pass
        return mx.where(select, k.astype(mx.float32) - mk, v.astype(mx.float32) - mv).astype(dtype)

    return mx.compile(center, shapeless=True)


@functools.lru_cache(maxsize=None)
def center_one(dtype):
    return mx.compile(lambda x, m: (x.astype(mx.float32) - m).astype(dtype), shapeless=True)


class HostMemo:
    """The last array(s) built on the host for a key.  Every layer of a model's call builds
    the same masks and indices from the same positions: the first layer builds and uploads
    them, the others reuse them."""

    def __init__(self):
        self.key = self.value = None

    def get(self, key, build):
        if key != self.key:
            self.key, self.value = key, build()
        return self.value


POSITIONAL = HostMemo()

# built whole (not a lazy reshape): a lazy module constant belongs to the importing thread's
# stream, and mlx-lm's server evaluates caches on its generation thread
SELECT_FIRST = mx.array(np.array([True, False]).reshape(2, 1, 1, 1, 1))
ZERO = mx.array(0.0, mx.float32)


def check_update(cache, keys, values):
    """ValueError, saying what is wrong, for keys and values ``cache.update_and_fetch`` cannot take."""
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, mx.array) or x.ndim != 4:
            raise ValueError(f"{name} must be an mx.array of shape (B, n_kv_heads, L, head_dim)")
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on (B, n_kv_heads, L)")
    if cache.head_dim is not None and keys.shape[-1] != cache.head_dim:
        raise ValueError(f"this cache was made for head_dim {cache.head_dim}, got keys of {keys.shape[-1]}")
    if cache.dtype is not None:
        expected = (cache.batch_heads, cache.k.head_dim, cache.v.head_dim)
        got = (tuple(keys.shape[:2]), keys.shape[-1], values.shape[-1])
        if got != expected:
            raise ValueError(f"this cache holds (B, H), k_dim, v_dim = {expected}, got {got}")
