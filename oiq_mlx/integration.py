"""The one module that touches mlx-lm internals.

* mlx-lm models call ``scaled_dot_product_attention`` imported *by name* from
  ``mlx_lm.models.base`` into each model module; :func:`install` wraps it in
  ``base`` and in every loaded ``mlx_lm.models.*`` module so that OIQ caches
  go to :func:`oiq_mlx.attention.oiq_attention`.  Every other cache reaches
  the original function unchanged.  Idempotent.
* ``load_prompt_cache`` finds cache classes with ``globals()[name]`` inside
  ``mlx_lm.models.cache``; :func:`install` registers ``OIQKVCache`` there.
"""

from __future__ import annotations

import sys
import warnings

import mlx_lm.models.base as _base
import mlx_lm.models.cache as _cache_mod
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

from .attention import oiq_attention, oiq_batch_attention
from .batch_cache import BatchOIQKVCache
from .cache import OIQKVCache
from .config import OIQConfig

_ORIGINAL = getattr(_base.scaled_dot_product_attention, "__oiq_original__", _base.scaled_dot_product_attention)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` with OIQ caches routed to OIQ attention."""
    if isinstance(cache, OIQKVCache):
        return oiq_attention(queries, cache, scale=scale, mask=mask, sinks=sinks)
    if isinstance(cache, BatchOIQKVCache):
        return oiq_batch_attention(queries, cache, scale=scale, mask=mask, sinks=sinks)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


scaled_dot_product_attention.__oiq_original__ = _ORIGINAL


def install() -> int:
    """Route mlx-lm attention and cache loading through oiq_mlx; returns the
    number of modules patched by this call (0 when already installed)."""
    _cache_mod.OIQKVCache = OIQKVCache
    patched = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models.")):
            continue
        if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
            module.scaled_dot_product_attention = scaled_dot_product_attention
            patched += 1
    return patched


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


def make_oiq_cache(model, config: OIQConfig | None = None, *, verbose: bool = False, base: list | None = None) -> list:
    """A prompt cache for ``model`` whose full-attention layers store OIQ.

    Built from ``model.make_cache()`` (or mlx-lm's default) so every layer
    keeps its kind: each plain ``KVCache`` becomes an :class:`OIQKVCache`;
    sliding-window ``RotatingKVCache`` layers (Gemma 3 local layers), SSM and
    other caches stay mlx-lm's own, in full precision, and are reported with a
    warning (``verbose``: a line on stderr either way).  Accepted by
    ``mlx_lm.generate``, ``stream_generate`` and ``generate_step`` as
    ``prompt_cache=``.  ``base``: the model's own caches to convert, for a
    caller that replaces ``model.make_cache`` (default ``make_prompt_cache(model)``).
    """
    config = config if config is not None else OIQConfig()
    install()
    head_dim = model_head_dim(model)
    if head_dim is not None:
        config.storage_dim(head_dim)
    base = make_prompt_cache(model) if base is None else base
    kept = {}
    counter = iter(range(10**9))

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
    if kept:
        desc = ", ".join(f"{n} x {name}" for name, n in kept.items())
        msg = f"oiq_mlx: {n_oiq} layers use OIQKVCache; kept in full precision: {desc}"
        warnings.warn(msg, stacklevel=2)
    elif verbose:
        print(f"oiq_mlx: {n_oiq} layers use OIQKVCache", file=sys.stderr)
    if n_oiq == 0:
        raise ValueError("this model has no full-attention KVCache layers for OIQ to replace")
    if config.layer_bits:
        oiq_layers = {c.layer_idx for c in _leaves(cache) if isinstance(c, OIQKVCache)}
        stray = [t[0] for t in config.layer_bits if t[0] not in oiq_layers]
        if stray:
            raise ValueError(f"layer_bits names layers {stray} that do not use OIQ in this model "
                             f"(its OIQ layers: {sorted(oiq_layers)})")
    return cache


def _leaves(caches):
    """Every cache in ``caches`` with ``CacheList`` members flattened, in the
    order :func:`make_oiq_cache` numbers them (``OIQKVCache.layer_idx``)."""
    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(c.caches)
        else:
            yield c


def oiq_layer_indices(model) -> list[int]:
    """Layer indices (as ``OIQKVCache.layer_idx`` and ``OIQConfig.layer_bits``
    count them) of the caches :func:`make_oiq_cache` turns into OIQ."""
    return [i for i, c in enumerate(_leaves(make_prompt_cache(model))) if type(c) is KVCache]


def _fp16_equivalent(c) -> int:
    if isinstance(c, OIQKVCache):
        if c.empty():
            return 0
        b, h = c.batch_heads
        return c.offset * b * h * (c.k.head_dim + c.v.head_dim) * 2
    if isinstance(c, CacheList):
        return sum(_fp16_equivalent(x) for x in c.caches)
    keys = getattr(c, "keys", None)
    if keys is None or not hasattr(keys, "dtype") or not hasattr(c, "values"):
        return c.nbytes
    return c.nbytes * 2 // keys.dtype.size


def kv_memory(cache: list) -> dict:
    """``{"held": bytes the cache holds, "fp16": what float16 K/V of the same
    tokens would hold}`` summed over layers (allocated capacity included in
    ``held``; full-precision layers counted at float16 in ``fp16``)."""
    return {
        "held": sum(c.nbytes for c in cache),
        "fp16": sum(_fp16_equivalent(c) for c in cache),
    }


def cache_tokens(cache: list) -> int:
    """Tokens held by the longest layer of ``cache``."""
    return max((c.offset for c in cache if hasattr(c, "offset")), default=0)
