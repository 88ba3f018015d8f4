"""The one place oiq_mlx reaches into mlx-lm's attention and cache registry.

* mlx-lm models call ``scaled_dot_product_attention`` imported *by name* from
  ``mlx_lm.models.base`` into each model module; :func:`install` wraps it in
  ``base`` and in every loaded ``mlx_lm.models.*`` module so that OIQ caches
  go to :func:`oiq_mlx.cache.attention.oiq_attention`.  Every other cache reaches
  the original function unchanged.  Idempotent.
* ``load_prompt_cache`` finds cache classes with ``globals()[name]`` inside
  ``mlx_lm.models.cache``; :func:`install` registers ``OIQKVCache`` and ``BatchOIQKVCache``
  there (:func:`oiq_mlx.mlx_lm.prompt_files.load_cache_file` checks a file before that lookup).
* :func:`capture_attention_inputs` records what each attention call receives
  (calibration and evaluation read it).

``import oiq_mlx`` runs :func:`install`, so a saved OIQ cache loads and a
hand-built ``[OIQKVCache(cfg, layer_idx=i) ...]`` works in any mlx-lm model
module, loaded before or after (a module imported later binds the wrapped
function from ``base``).

Only models whose attention hands the cache's return value to that function
can use an OIQ cache; :func:`unsupported_reason` reads the attention code of
a model's classes to tell, and ``make_oiq_cache`` refuses the others.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap

import mlx.core as mx
import mlx_lm.models.base as _base
import mlx_lm.models.cache as _cache_mod
from mlx_lm.models.cache import make_prompt_cache

from ..cache.attention import oiq_attention, oiq_batch_attention
from ..cache.batch import BatchOIQKVCache
from ..cache.sequence import OIQKVCache

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
    _cache_mod.BatchOIQKVCache = BatchOIQKVCache
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


def model_type(model) -> str:
    for name in ("args", "config", "model_args"):
        model_type = getattr(getattr(model, name, None), "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return type(model).__module__


def capture_attention_inputs(model, tokens) -> list[dict]:
    """Run ``model`` on ``tokens`` with an fp cache and record, per attention
    call (= per layer, in order), the post-RoPE ``queries``, the ``keys`` and
    ``values`` the fp cache returned, ``scale`` and the layer index."""
    install()
    records, originals = [], {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("mlx_lm.models.") and hasattr(module, "scaled_dot_product_attention"):
            originals[name] = module.scaled_dot_product_attention
    cache = make_prompt_cache(model)
    index = {id(c): i for i, c in enumerate(cache)}

    def recorder(original):
        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            records.append({"layer": index.get(id(cache)), "queries": queries, "keys": keys, "values": values,
                            "scale": scale, "sinks": sinks, "cache_type": type(cache).__name__})
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return sdpa

    try:
        for name, fn in originals.items():
            sys.modules[name].scaled_dot_product_attention = recorder(fn)
        mx.eval(model(mx.array(list(tokens))[None], cache=cache))
    finally:
        for name, fn in originals.items():
            sys.modules[name].scaled_dot_product_attention = fn
    return records
