"""The one module that touches mlx-lm internals.

* mlx-lm models call ``scaled_dot_product_attention`` imported *by name* from
  ``mlx_lm.models.base`` into each model module; :func:`install` wraps it in
  ``base`` and in every loaded ``mlx_lm.models.*`` module so that OIQ caches
  go to :func:`oiq_mlx.attention.oiq_attention`.  Every other cache reaches
  the original function unchanged.  Idempotent.
* ``load_prompt_cache`` finds cache classes with ``globals()[name]`` inside
  ``mlx_lm.models.cache``; :func:`install` registers ``OIQKVCache`` there.

``import oiq_mlx`` runs :func:`install`, so a saved OIQ cache loads and a
hand-built ``[OIQKVCache(cfg, layer_idx=i) ...]`` works in any mlx-lm model
module, loaded before or after (a module imported later binds the wrapped
function from ``base``).

Only models whose attention hands the cache's return value to that function
can use an OIQ cache; :func:`unsupported_reason` reads the attention code of
a model's classes to tell, and :func:`make_oiq_cache` refuses the others.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import warnings

import mlx.core as mx
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
    number of modules patched by this call (0 when already installed).

    Every loaded module that bound mlx-lm's ``scaled_dot_product_attention``
    by name is patched: mlx-lm's model modules, and a user's model module
    imported before oiq_mlx.
    """
    _cache_mod.OIQKVCache = OIQKVCache
    patched = 0
    for module in list(sys.modules.values()):
        # vars(), not getattr(): a module-level __getattr__ must not run (lazy imports)
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("scaled_dot_product_attention") is _ORIGINAL:
            module.scaled_dot_product_attention = scaled_dot_product_attention
            patched += 1
    return patched


def _following(fn, stmt, parent) -> list:
    """Statements that run after ``stmt`` in function ``fn`` (loops aside): the
    rest of its block, then the rest of every enclosing block."""
    out, node = [], stmt
    while node is not fn:
        owner = parent[node]
        for field in ("body", "orelse", "finalbody"):
            block = getattr(owner, field, None)
            if isinstance(block, list) and node in block:
                out += block[block.index(node) + 1 :]
                break
        node = owner
    return out


def _is_fast_sdpa(call) -> bool:
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and (
        call.func.attr == "scaled_dot_product_attention"
        and isinstance(call.func.value, ast.Attribute) and call.func.value.attr == "fast"
    )


@functools.lru_cache(maxsize=None)
def _cache_result_uses(cls) -> tuple[int, tuple[str, ...]] | None:
    """How the methods of ``cls`` (its own source) use what ``update_and_fetch`` returns.

    Returns ``(n, problems)`` (None when the source cannot be read): ``n``
    updates whose keys/values reach mlx-lm's
    ``scaled_dot_product_attention`` (called by that name), and one line per
    use that needs them as arrays (indexing, matmul, ``mx.fast`` attention,
    passing them to another function); an OIQ cache returns itself there.
    Reading ``.dtype`` is allowed: :class:`OIQKVCache` has the keys' dtype.
    """
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    tree = ast.parse(src)
    routed, problems = 0, []
    where = f"{cls.__module__}.{cls.__qualname__}"
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        parent = {c: n for n in ast.walk(fn) for c in ast.iter_child_nodes(n)}
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "update_and_fetch"):
                continue
            stmt = parent.get(call)
            targets = stmt.targets if isinstance(stmt, ast.Assign) and stmt.value is call else []
            names = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            if not names or not all(isinstance(e, ast.Name) for e in names):
                problems.append(f"{where}.{fn.name}: the result of update_and_fetch is not kept in variables")
                continue
            names = {e.id for e in names}
            reaches = False
            for later in _following(fn, stmt, parent):
                for use in ast.walk(later):
                    if not (isinstance(use, ast.Name) and use.id in names and isinstance(use.ctx, ast.Load)):
                        continue
                    user = parent.get(use)
                    if isinstance(user, ast.Attribute) and user.attr == "dtype":
                        continue
                    user = parent.get(user) if isinstance(user, ast.keyword) else user
                    if isinstance(user, ast.Call) and isinstance(user.func, ast.Name) and (
                        user.func.id == "scaled_dot_product_attention"
                    ):
                        reaches = True
                        continue
                    what = "calls mx.fast.scaled_dot_product_attention itself" if _is_fast_sdpa(user) else (
                        f"uses `{use.id}` as an array")
                    code = (ast.get_source_segment(src, user) or use.id).split("\n")[0]
                    problem = f"{where}.{fn.name} {what}: `{code}`"
                    if problem not in problems:
                        problems.append(problem)
            routed += reaches
    return routed, tuple(problems)


def unsupported_reason(model) -> str | None:
    """Why an OIQ cache cannot serve ``model``, or None when it can.

    An :class:`OIQKVCache` returns itself from ``update_and_fetch`` and is read
    by OIQ attention, which mlx-lm's ``scaled_dot_product_attention`` is routed
    to.  The classes of ``model``'s modules are read (their source, with
    :mod:`ast`) for what their attention does with the returned keys/values:
    anything but passing them to that function (gemma2 multiplies them with
    the queries itself, plamo2 calls ``mx.fast.scaled_dot_product_attention``,
    DeepSeek-V3's MLA cache holds latents, Gemma 4 shares them across layers)
    makes the model unsupported, as does a module whose
    ``scaled_dot_product_attention`` is not mlx-lm's.
    """
    classes = {}
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls.__module__.split(".")[0] not in ("mlx", "builtins"):
                classes[cls] = None
    routed, problems, unread = 0, [], []
    for cls in classes:
        uses = _cache_result_uses(cls)
        if uses is None:
            unread.append(f"{cls.__module__}.{cls.__qualname__}")
            continue
        n, found = uses
        problems += found
        if n:
            module = sys.modules.get(cls.__module__)
            if getattr(module, "scaled_dot_product_attention", None) is not scaled_dot_product_attention:
                problems.append(f"{cls.__module__} has its own scaled_dot_product_attention, which OIQ does not reach")
        routed += n
    if problems:
        more = f"; and {len(problems) - 2} more" if len(problems) > 2 else ""
        return ("its attention needs the keys/values the cache returns as arrays, which an OIQ cache does not "
                "return (it is read only through mlx-lm's scaled_dot_product_attention): "
                + "; ".join(problems[:2]) + more)
    if not routed:
        unread = f" (the source of {', '.join(unread)} cannot be read to check)" if unread else ""
        return ("no attention of this model passes its cache's keys/values to mlx-lm's scaled_dot_product_attention"
                + unread)
    return None


def _model_type(model) -> str:
    for name in ("args", "config", "model_args"):
        model_type = getattr(getattr(model, name, None), "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return type(model).__module__


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
    only later layers (``oiq_mlx.distributed``).  ``base``: the model's own
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
        raise ValueError(f"oiq_mlx cannot serve model type {_model_type(model)!r}: {reason}")
    if kept:
        desc = ", ".join(f"{n} x {name}" for name, n in kept.items())
        msg = f"oiq_mlx: {n_oiq} layers use OIQKVCache; kept in full precision: {desc}"
        warnings.warn(msg, stacklevel=2)
    elif verbose:
        print(f"oiq_mlx: {n_oiq} layers use OIQKVCache", file=sys.stderr)
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


def end_prefill(cache: list):
    """End the prompt's prefill in every OIQ layer of ``cache``
    (:meth:`OIQKVCache.end_prefill`, ``exact_prefill``): for callers that write
    more than one token per call after a prompt (chunked scoring, speculative
    decoding's verify calls), which would otherwise keep the rows in full
    precision up to ``exact_prefill`` tokens, and before saving a prompt cache."""
    for c in _leaves(cache):
        if isinstance(c, OIQKVCache):
            c.end_prefill()


def oiq_layer_indices(model) -> list[int]:
    """Layer indices (as ``OIQKVCache.layer_idx`` and ``OIQConfig.layer_bits``
    count them) of the caches :func:`make_oiq_cache` turns into OIQ."""
    return [i for i, c in enumerate(_leaves(make_prompt_cache(model))) if type(c) is KVCache]


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


def cache_tokens(cache: list) -> int:
    """Tokens held by the longest layer of ``cache``."""
    return max((c.offset for c in cache if hasattr(c, "offset")), default=0)
