"""Prompt-cache files read with every part checked before any cache is built.

mlx-lm's ``load_prompt_cache`` trusts the file's own bookkeeping: the class of each layer is
looked up with ``globals()[name]`` inside ``mlx_lm.models.cache`` (a name such as
``load_prompt_cache`` finds a function, and an unknown one raises a bare ``KeyError``), the
metadata strings are rebuilt with ``chr`` over whatever array the file holds, and ``zip`` of the
class list with the states drops the layers one list has more of.  :func:`load_cache_file` reads
the same files (``save_prompt_cache`` writes them) and refuses, with a ``ValueError`` naming the
part at fault, a file whose class list, scalar list or arrays do not fit together; each state is
then checked by its class (:meth:`OIQKVCache.from_state` checks every field, ``files.py``).
``oiq_mlx.load_prompt_cache`` and ``oiq-generate --prompt-cache-file`` load through it.
:func:`save_cache_file` (``oiq_mlx.save_prompt_cache``) is mlx-lm's ``save_prompt_cache`` after
giving a decoding batch's sequences their storage back, so every cache it is given loads again.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx.utils import tree_unflatten

from ..cache.batch import BatchOIQKVCache
from ..cache.sequence import OIQKVCache
from .caches import leaves


def save_cache_file(path, cache: list, metadata: dict | None = None) -> None:
    """mlx-lm's ``save_prompt_cache(path, cache, metadata)``.  A :class:`BatchOIQKVCache` that is
    decoding holds its storage stacked across the sequences, and its ``state`` is that storage
    (what mlx-lm evaluates every step, so it is not copied per step); it is unstacked first, which
    changes nothing it holds, so that the file has one state per sequence and loads."""
    for c in leaves(cache):
        if isinstance(c, BatchOIQKVCache):
            c.unstack()
    mlx_cache.save_prompt_cache(path, cache, {} if metadata is None else metadata)


def cache_classes() -> dict:
    """Cache classes a file may name: mlx-lm's (every class of ``mlx_lm.models.cache`` with
    ``from_state``) and oiq_mlx's."""
    known = {name: obj for name, obj in vars(mlx_cache).items()
             if isinstance(obj, type) and callable(getattr(obj, "from_state", None)) and not name.startswith("_")}
    known.update(OIQKVCache=OIQKVCache, BatchOIQKVCache=BatchOIQKVCache)
    return known


def _refuse(path, what: str) -> ValueError:
    return ValueError(f"prompt cache file {path} refused: {what}")


def _scalar(path, arrays: dict, pos, kind):
    """The value ``save_prompt_cache`` turned into array ``pos`` of kind ``kind``."""
    if not isinstance(pos, str) or pos not in arrays:
        raise _refuse(path, f"scalar list names array {pos!r}, which the file does not hold")
    a = arrays[pos]
    if kind == "string":
        if a.ndim != 1 or not mx.issubdtype(a.dtype, mx.integer):
            raise _refuse(path, f"string {pos} must be a 1-D integer array of character codes, got {a.dtype} "
                                f"{tuple(a.shape)}")
        codes = a.tolist()
        if any(c < 0 or c > 0x10FFFF for c in codes):
            raise _refuse(path, f"string {pos} holds codes that are not characters")
        return "".join(chr(c) for c in codes)
    if kind == "scalar":
        if a.size != 1:
            raise _refuse(path, f"scalar {pos} must hold one value, got {a.dtype} {tuple(a.shape)}")
        return a.item()
    if kind == "none":
        if a.size != 0:
            raise _refuse(path, f"none {pos} must be an empty array, got {a.dtype} {tuple(a.shape)}")
        return None
    raise _refuse(path, f"scalar list gives array {pos} the unknown kind {kind!r} (string, scalar or none)")


def load_cache_file(path, return_metadata: bool = False):
    """``mlx_lm``'s ``load_prompt_cache`` with the file checked first (see the module docstring).

    Returns the list of caches, and the user metadata too with ``return_metadata``.  Raises
    ``ValueError`` naming the part at fault (and ``OSError`` for a file that cannot be read).
    """
    path = str(path)
    try:
        arrays, raw = mx.load(path, return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise _refuse(path, f"not a readable safetensors file ({e})") from None
    if not isinstance(arrays, dict) or not isinstance(raw, dict):
        raise _refuse(path, "not a safetensors file of named arrays")
    try:
        tree = tree_unflatten(list(raw.items()))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise _refuse(path, f"its metadata keys are not save_prompt_cache's ({e})") from None
    if not isinstance(tree, list) or len(tree) != 3:
        raise _refuse(path, "its metadata must be [user metadata, cache classes, scalars] as save_prompt_cache "
                            "writes it")
    metadata, classes, scalars = tree
    if not isinstance(metadata, dict):
        raise _refuse(path, f"user metadata must be a mapping, got {type(metadata).__name__}")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise _refuse(path, "cache class list must be a non-empty list of class names")
    known = cache_classes()
    for i, name in enumerate(classes):
        if name not in known:
            raise _refuse(path, f"layer {i} names cache class {name!r}, which is not a cache class of mlx-lm or "
                                f"oiq_mlx (known: {', '.join(sorted(known))})")
    if not isinstance(scalars, list) or not scalars or scalars[0] != "":
        raise _refuse(path, "scalar list must start with an empty string, as save_prompt_cache writes it")
    arrays = dict(arrays)
    for entry in scalars[1:]:
        if not isinstance(entry, list) or len(entry) != 2:
            raise _refuse(path, f"scalar list entry {entry!r} is not [array name, kind]")
        arrays[entry[0]] = _scalar(path, arrays, *entry)
    try:
        states = tree_unflatten(list(arrays.items()))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise _refuse(path, f"its array names are not save_prompt_cache's ({e})") from None
    if not isinstance(states, list) or len(states) != len(classes):
        n = len(states) if isinstance(states, list) else "?"
        raise _refuse(path, f"holds the states of {n} layers but names {len(classes)} cache classes")
    cache = []
    for i, (name, state) in enumerate(zip(classes, states)):
        try:
            cache.append(known[name].from_state(state))
        except ValueError as e:
            if known[name] in (OIQKVCache, BatchOIQKVCache):  # their errors name the field at fault
                raise _refuse(path, f"layer {i} ({name}): {e}") from None
            raise _refuse(path, f"layer {i} ({name}): its state is not one {name} saves ({e})") from None
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            # mlx-lm's classes take their state apart without checking it
            raise _refuse(path, f"layer {i} ({name}): its state is not one {name} saves "
                                f"({type(e).__name__}: {e})") from None
    return (cache, metadata) if return_metadata else cache
