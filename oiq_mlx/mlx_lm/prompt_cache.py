"""``OIQPromptCache``: mlx-lm's server prompt cache for OIQ caches, its entries packed and sharing rows.

mlx-lm's server (``mlx_lm.server``, checked against mlx-lm 0.32.2) saves a sequence's cache at
the end of each prompt segment (a checkpoint: the system prompt, the user turn) and when the
sequence finishes, in an ``LRUPromptCache`` bounded by entries (``--prompt-cache-size``) and
bytes (``--prompt-cache-bytes``, counted with ``nbytes``).  For caches it can trim, mlx-lm then
drops the checkpoints inside a finished sequence and serves them by trimming it back.  Here,
for OIQ caches:

* by default the same: a chat keeps one entry, and a request that leaves it is served from it
  trimmed back.  A trim deeper than the trim reserve is not what the cache was at that length
  (:func:`trim_is_exact`): the rows packed since stay packed, so the request reads the last
  ``window`` rows before the cut packed where a fresh prefill holds them in full precision.  A
  shorter entry that the request extends is preferred to such a trim;
* with ``keep_checkpoints`` (``oiq-server --keep-checkpoints``) the checkpoints are kept and a
  longer entry is trimmed only exactly, else a checkpoint serves the request, or a fresh prefill;
* every entry is a packed, compact copy (:func:`oiq_mlx.cache.entries.packed_entry`): the live
  sequence is not changed, and an entry holds its tokens at about what a finished sequence holds;
* an entry whose packed rows are bit-identical to the first rows of a longer entry (the server's
  ``positional`` caches: always) holds them as views of that entry's, in either order of
  insertion, and takes a copy of its own when that entry leaves the cache: kept checkpoints, a
  checkpoint inserted after a longer entry it prefixes, the entries of caches mlx-lm cannot
  trim (a model with sliding-window layers);
* bytes are counted as held: shared rows once, with the entry that holds their buffer.  The byte
  bound holds at every insertion (mlx-lm applies it only when a request joins the batch).

:meth:`OIQPromptCache.memory` reports what the cache holds (the server's ``/v1/oiq/memory``),
and each insertion logs a line.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from ..cache.batch import BatchOIQKVCache
from ..cache.entries import own_packed_rows, packed_entry, packed_nbytes, packed_rows, packed_rows_match, \
    share_packed_rows
from ..cache.sequence import OIQKVCache
from .caches import float16_model_bytes, kv_memory

NO_BOUND = 1 << 63  # LRUPromptCache's max_bytes when none is given


def oiq_caches(prompt_cache) -> list:
    return [c for c in prompt_cache if isinstance(c, (OIQKVCache, BatchOIQKVCache))]


def trim_is_exact(prompt_cache, n: int) -> bool:
    """True when trimming ``n`` tokens leaves every OIQ cache of ``prompt_cache`` as it was
    when it held that many tokens: the rows that were then full precision are still held
    in full precision (at most the trim reserve deep)."""
    for c in oiq_caches(prompt_cache):
        if isinstance(c, BatchOIQKVCache):
            return False
        offset = c.offset - n
        if offset > c.config.sink_tokens and c.packed_end(offset) < c.recent_start:
            return False
    return True


@dataclasses.dataclass(eq=False)
class Entry(LRUPromptCache.CacheEntry):
    """An entry of :class:`OIQPromptCache`: mlx-lm's ``CacheEntry`` (``nbytes``: what it is
    counted at) and what sharing needs."""

    model: Any = None
    tokens: tuple = ()
    oiq: bool = False  # holds OIQ caches (packed entries, which may share rows)
    fp16: int = 0  # float16 keys and values of its tokens
    own: int = 0  # bytes it holds with its packed rows its own
    own_float16_model: int = 0  # the same with full-precision rows at 2 bytes a value
    packed: int = 0  # bytes of its packed rows
    owner: "Entry | None" = None  # the longer entry whose packed rows it holds views of
    sharers: list = dataclasses.field(default_factory=list)  # entries holding views of its rows

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def extends(self, other: "Entry") -> bool:
        """True when ``other`` holds a strict prefix of this entry's tokens (same model)."""
        n = len(other.tokens)
        return other.model == self.model and n < len(self.tokens) and self.tokens[:n] == other.tokens

    @property
    def held(self) -> int:
        return self.own - (self.packed if self.owner is not None else 0)

    @property
    def float16_model(self) -> int:
        return self.own_float16_model - (self.packed if self.owner is not None else 0)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


class OIQPromptCache(LRUPromptCache):
    """mlx-lm's ``LRUPromptCache`` with packed OIQ entries that share rows (module docstring).

    Caches of other kinds (``--no-oiq``) are kept as mlx-lm keeps them.  Every entry leaves
    through :meth:`_evict` or a replacement, which hands shared rows over.  ``lock`` guards
    the cache between the generation thread and :meth:`memory` (an HTTP thread).
    """

    def __init__(self, max_size: int = 10, max_bytes: int | None = None, *, keep_checkpoints: bool = False):
        super().__init__(max_size, NO_BOUND if max_bytes is None else int(max_bytes))
        self.keep_checkpoints = keep_checkpoints
        self.lock = threading.RLock()
        self._entries: list[Entry] = []

    # -- accounting ----------------------------------------------------------

    def _count(self, entry: Entry, delta: int) -> None:
        self._n_bytes += delta
        self._n_bytes_by_type[entry.cache_type] += delta

    def _recount(self, entry: Entry) -> None:
        """Count ``entry`` at what it holds now (after it shared or took back its rows)."""
        self._count(entry, entry.held - entry.nbytes)
        entry.nbytes = entry.held

    # -- sharing -------------------------------------------------------------

    @staticmethod
    def _layers(short: Entry, long: Entry):
        return [(a, b) for a, b in zip(short.prompt_cache, long.prompt_cache) if isinstance(a, OIQKVCache)]

    def _rows_match(self, short: Entry, long: Entry) -> bool:
        if len(short.prompt_cache) != len(long.prompt_cache):
            return False
        pairs = self._layers(short, long)
        return bool(pairs) and all(isinstance(b, OIQKVCache) and packed_rows_match(a, b) for a, b in pairs)

    def _attach(self, sharer: Entry, owner: Entry) -> None:
        """``sharer`` (whose rows match ``owner``'s first rows) holds views of ``owner``'s rows."""
        for a, b in self._layers(sharer, owner):
            share_packed_rows(a, b)
        sharer.owner = owner
        owner.sharers.append(sharer)
        self._recount(sharer)

    def _share(self, new: Entry) -> None:
        """Share packed rows between ``new`` and the entries it prefixes or extends."""
        held = [e for e in self._entries if e.oiq]
        roots = []
        for e in held:
            root = e.owner or e
            if e.extends(new) and root not in roots:
                roots.append(root)
        for root in roots:
            if self._rows_match(new, root):
                self._attach(new, root)
                break
        target = new.owner or new
        for p in sorted(held, key=lambda e: -len(e.tokens)):
            if p.owner is None and p is not target and new.extends(p) and self._rows_match(p, target):
                for q in p.sharers:  # views of p's rows, which are target's first rows
                    for a, b in self._layers(q, target):
                        share_packed_rows(a, b)
                    q.owner = target
                    target.sharers.append(q)
                p.sharers = []
                self._attach(p, target)

    def _forget(self, entry: Entry) -> None:
        """``entry`` has left the trie and the LRU order: stop counting it and give the entries
        holding views of its rows rows of their own (the longest a copy, the others views of it)."""
        self._count(entry, -entry.nbytes)
        if entry in self._entries:
            self._entries.remove(entry)
        if entry.owner is not None:
            entry.owner.sharers.remove(entry)
            entry.owner = None
        heirs = sorted(entry.sharers, key=lambda e: -len(e.tokens))
        entry.sharers = []
        if not heirs:
            return
        heir = heirs[0]
        for c in heir.prompt_cache:
            if isinstance(c, OIQKVCache):
                own_packed_rows(c)
        heir.owner = None
        self._recount(heir)
        for s in heirs[1:]:
            pairs = self._layers(s, heir)
            if all(packed_rows(a) <= packed_rows(b) for a, b in pairs):
                for a, b in pairs:
                    share_packed_rows(a, b)
                s.owner = heir
                heir.sharers.append(s)
            else:
                for a, _ in pairs:
                    own_packed_rows(a)
                s.owner = None
                self._recount(s)

    def _evict(self) -> None:
        model, tokens = self._lru.pop()
        self._forget(self._trie.pop(model, tokens))

    # -- mlx-lm's interface ---------------------------------------------------

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type: str = "assistant"):
        # the copy (for --no-positional, a quantize pass over the prompt) before taking the lock,
        # which memory() (an HTTP thread) waits for
        tokens = list(tokens)
        oiq = bool(oiq_caches(prompt_cache))
        given = kv_memory(prompt_cache)
        caches = [packed_entry(c) if isinstance(c, OIQKVCache) else c for c in prompt_cache]
        mem = kv_memory(caches)
        entry = Entry(caches, mem["held"], cache_type, model=model, tokens=tuple(tokens), oiq=oiq,
                      fp16=mem["fp16"], own=mem["held"], own_float16_model=float16_model_bytes(caches),
                      packed=sum(packed_nbytes(c) for c in caches if isinstance(c, OIQKVCache)))
        with self.lock:
            prev = self._trie.add(model, tokens, entry)
            if prev is not None:
                self._lru.remove(model, tokens)
                self._forget(prev)
            self._lru.push(model, tokens, cache_type)
            self._count(entry, entry.nbytes)
            if can_trim_prompt_cache(caches) and not (oiq and self.keep_checkpoints):
                # as mlx-lm: a cache that can be trimmed back replaces the entries it extends
                # (shortest first: an entry goes before the one whose rows it views, no copy made)
                for n, e in self._trie.pop_prefixes(model, tokens):
                    self._lru.remove(model, tokens[:n])
                    self._forget(e)
            if oiq:
                self._share(entry)
            self._entries.append(entry)
            while len(self._lru) > self.max_size or (self._n_bytes > self.max_bytes and len(self._lru)):
                self._evict()
            self._log_insert(entry, given)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None):
        with self.lock:
            n_sequences = max(0, n_sequences) if n_sequences is not None else NO_BOUND
            n_bytes = max(0, n_bytes) if n_bytes is not None else NO_BOUND
            while len(self._lru) > n_sequences or (self._n_bytes > n_bytes and len(self._lru)):
                self._evict()

    def fetch_nearest_cache(self, model, tokens):
        with self.lock:
            found = self._trie.search(model, tokens)
            short = len(found.shorter) if found.shorter is not None else 0
            if found.exact is None and found.longer is not None and found.common_prefix > short:
                longer = self._trie.get(found.model, found.longer).prompt_cache
                prefix = min(len(tokens) - 1, found.common_prefix)
                if oiq_caches(longer) and not trim_is_exact(longer, len(found.longer) - prefix):
                    # an exact shorter entry before an inexact trim; with no shorter entry, the
                    # trim (one entry per chat) or, keeping checkpoints, a fresh prefill
                    if not short:
                        return (None, tokens) if self.keep_checkpoints else super().fetch_nearest_cache(model, tokens)
                    shorter = self._trie.get(found.model, found.shorter)
                    return copy.deepcopy(shorter.prompt_cache), tokens[short:]
            return super().fetch_nearest_cache(model, tokens)

    # -- what it holds --------------------------------------------------------

    def held_entries(self) -> list[Entry]:
        """Every entry, in the order they were inserted."""
        with self.lock:
            return list(self._entries)

    def memory(self) -> dict:
        """What the prompt cache holds: ``bytes`` (what the byte bound counts: shared rows once),
        ``float16_model_bytes`` (the same with full-precision rows at 2 bytes a value, as a
        float16 model holds them), ``fp16_bytes`` (float16 keys and values of the tokens held,
        an entry inside a longer one counted once, as mlx-lm keeps a float16 cache),
        ``shared_bytes`` (rows entries hold as views of a longer entry's), the bounds, and one
        item per entry."""
        with self.lock:
            entries = self.held_entries()
            items = [{"type": e.cache_type, "tokens": len(e.tokens), "bytes": e.nbytes,
                      "float16_model_bytes": e.float16_model, "fp16_bytes": e.fp16,
                      "shared_bytes": e.packed if e.owner is not None else 0} for e in entries]
            outer = [e for e in entries if not any(o.extends(e) for o in entries)]
            return {
                "entries": len(entries),
                "bytes": self._n_bytes,
                "float16_model_bytes": sum(i["float16_model_bytes"] for i in items),
                "fp16_bytes": sum(e.fp16 for e in outer),
                "shared_bytes": sum(i["shared_bytes"] for i in items),
                "max_bytes": None if self.max_bytes >= NO_BOUND else self.max_bytes,
                "max_entries": self.max_size,
                "by_type": self.stats_by_type(),
                "items": items,
            }

    def _log_insert(self, entry: Entry, given: dict) -> None:
        if entry.fp16 <= 0:
            return
        where = "kept" if self._trie_holds(entry) else "evicted at once (over the bounds)"
        shared = f", {_mb(entry.packed)} of it shared with a longer entry" if entry.owner is not None else ""
        total = self.memory()
        logging.info(
            "oiq_mlx: prompt cache: %s entry of %d tokens %s: holds %s, %.3fx fp16 (%.3fx as a float16 model)%s; "
            "the sequence held %s (%.3fx fp16). Prompt cache: %d %s, %s, %.3fx fp16 (%.3fx as a float16 "
            "model), bound %s", entry.cache_type, len(entry.tokens), where, _mb(entry.nbytes),
            entry.nbytes / entry.fp16, entry.float16_model / entry.fp16, shared, _mb(given["held"]),
            given["held"] / max(1, given["fp16"]), total["entries"],
            "entry" if total["entries"] == 1 else "entries", _mb(total["bytes"]),
            total["bytes"] / max(1, total["fp16_bytes"]), total["float16_model_bytes"] / max(1, total["fp16_bytes"]),
            "none" if total["max_bytes"] is None else _mb(total["max_bytes"]))

    def _trie_holds(self, entry: Entry) -> bool:
        try:
            return self._trie.get(entry.model, list(entry.tokens)) is entry
        except KeyError:
            return False
