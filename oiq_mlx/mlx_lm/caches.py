"""OIQ prompt caches for mlx-lm models: :func:`make_oiq_cache` turns a model's full-attention
``KVCache`` layers into :class:`~oiq_mlx.cache.OIQKVCache`, and the helpers every front end uses
on such a list (:func:`end_prefill`, :func:`kv_memory`, layer indices, head size)."""

from __future__ import annotations

import sys
import warnings

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

from ..cache.entries import float16_model_nbytes
from ..cache.sequence import OIQKVCache
from ..core.config import OIQConfig
from .routing import install, model_type, unsupported_reason


def model_head_dim(model) -> int | None:
    """Head dimension from the model's args (None when it cannot be told)."""
    args = getattr(model, "args", None)
    hd = getattr(args, "head_dim", None)
    if hd:
        return int(hd)
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    if hidden and heads:
        return int(hidden) // int(heads)
    return None


def make_oiq_cache(model, config: OIQConfig | None = None, *, verbose: bool = False, first_layer: int = 0,
                   base: list | None = None) -> list:
    """A prompt cache for ``model`` whose full-attention layers store OIQ.

    Raises ``ValueError`` naming the model type and the code at fault for a
    model OIQ cannot serve (see :func:`unsupported_reason`).

    Built from ``model.make_cache()`` (or mlx-lm's default) so every layer
    keeps its kind: each plain ``KVCache`` becomes an :class:`OIQKVCache`;
    sliding-window ``RotatingKVCache`` layers (Gemma 3 local layers), SSM and
    other caches stay mlx-lm's own, in full precision, and are reported with a
    warning (``verbose``: a line on stderr either way).  Accepted by
    ``mlx_lm.generate``, ``stream_generate`` and ``generate_step`` as
    ``prompt_cache=``.

    ``first_layer``: the layer index (``OIQKVCache.layer_idx``, which seeds
    the signs) of the first cache, for a pipeline stage whose model holds
    only later layers (``oiq_mlx.mlx_lm.sharding``).  ``base``: the model's own
    caches to convert, for a caller that replaces ``model.make_cache``
    (default ``make_prompt_cache(model)``).
    """
    config = config if config is not None else OIQConfig()
    install()
    head_dim = model_head_dim(model)
    if head_dim is not None:
        config.storage_dim(head_dim)
    base = make_prompt_cache(model) if base is None else base
    kept = {}
    counter = iter(range(first_layer, 10**9))

    def convert(c):
        if type(c) is KVCache:
            return OIQKVCache(config, layer_idx=next(counter), head_dim=head_dim)
        if isinstance(c, CacheList):
            c.caches = tuple(convert(x) for x in c.caches)
            return c
        next(counter)
        kept[type(c).__name__] = kept.get(type(c).__name__, 0) + 1
        return c

    cache = [convert(c) for c in base]
    n_oiq = sum(isinstance(c, OIQKVCache) for c in cache)
    if n_oiq == 0:
        raise ValueError("this model has no full-attention KVCache layers for OIQ to replace")
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"oiq_mlx cannot serve model type {model_type(model)!r}: {reason}")
    if kept:
        desc = ", ".join(f"{n} x {name}" for name, n in kept.items())
        msg = f"oiq_mlx: {n_oiq} layers use OIQKVCache; kept in full precision: {desc}"
        warnings.warn(msg, stacklevel=2)
    elif verbose:
        print(f"oiq_mlx: {n_oiq} layers use OIQKVCache", file=sys.stderr)
    if config.layer_bits:
        oiq_layers = {c.layer_idx for c in leaves(cache) if isinstance(c, OIQKVCache)}
        stray = [t[0] for t in config.layer_bits if t[0] not in oiq_layers]
        if stray:
            raise ValueError(f"layer_bits names layers {stray} that do not use OIQ in this model "
                             f"(its OIQ layers: {sorted(oiq_layers)})")
    return cache


def leaves(caches):
    """Every cache in ``caches`` with ``CacheList`` members flattened, in the
    order :func:`make_oiq_cache` numbers them (``OIQKVCache.layer_idx``)."""
    for c in caches:
        if isinstance(c, CacheList):
            yield from leaves(c.caches)
        else:
            yield c


def end_prefill(cache: list):
    """End the prompt's prefill in every OIQ layer of ``cache``
    (:meth:`OIQKVCache.end_prefill`, ``exact_prefill``): for callers that write
    more than one token per call after a prompt (chunked scoring; speculative
    decoding's ``trim`` after its first verify call ends it by itself), which
    would otherwise keep the rows in full precision up to ``exact_prefill``
    tokens, and before saving a prompt cache."""
    for c in leaves(cache):
        if isinstance(c, OIQKVCache):
            c.end_prefill()


def oiq_layer_indices(model) -> list[int]:
    """Layer indices (as ``OIQKVCache.layer_idx`` and ``OIQConfig.layer_bits``
    count them) of the caches :func:`make_oiq_cache` turns into OIQ."""
    return [i for i, c in enumerate(leaves(make_prompt_cache(model))) if type(c) is KVCache]


def _fp16_equivalent(c) -> int:
    """Bytes float16 keys and values of the tokens ``c`` holds take, with no
    spare capacity: the same count for every cache kind."""
    if isinstance(c, CacheList):
        return sum(_fp16_equivalent(x) for x in c.caches)
    if isinstance(c, OIQKVCache):
        if c.empty():
            return 0
        b, h = c.batch_heads
        return c.offset * b * h * (c.k.head_dim + c.v.head_dim) * 2
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
        return c.nbytes  # no per-token keys and values (e.g. SSM state): counted as held
    b, h, capacity = keys.shape[:3]
    # a KVCache allocates ahead of its offset; a RotatingKVCache holds at most its window
    tokens = min(c.offset, capacity)
    return tokens * b * h * (keys.shape[-1] + values.shape[-1]) * 2


def kv_memory(cache: list) -> dict:
    """``{"held": bytes of every array the cache holds (allocated capacity
    included), "fp16": bytes float16 keys and values of the tokens it holds
    would take (no spare capacity)}``, summed over layers."""
    return {
        "held": sum(c.nbytes for c in cache),
        "fp16": sum(_fp16_equivalent(c) for c in cache),
    }


def float16_model_bytes(cache: list) -> int:
    """``kv_memory(cache)["held"]`` with every full-precision key and value counted at 2 bytes:
    what the cache holds for a float16 model (a Mac's usual) when this machine ran the model
    in float32.  OIQ's packed rows and statistics are counted as held."""
    return sum(_float16_model(c) for c in cache)


def _float16_model(c) -> int:
    if isinstance(c, CacheList):
        return sum(_float16_model(x) for x in c.caches)
    if isinstance(c, OIQKVCache):
        return float16_model_nbytes(c)
    keys = getattr(c, "keys", None)
    if isinstance(keys, mx.array) and mx.issubdtype(keys.dtype, mx.floating):
        return c.nbytes * 2 // keys.dtype.size
    return c.nbytes


def cache_tokens(cache: list) -> int:
    """Tokens held by the longest layer of ``cache``."""
    return max((c.offset for c in cache if hasattr(c, "offset")), default=0)
