"""The KV caches: one sequence (:class:`OIQKVCache`), a batch (:class:`BatchOIQKVCache`), the
stacked decode of a batch, attention over a cache's segments, and the cache file format."""

from .batch import BatchOIQKVCache
from .sequence import OIQKVCache

__all__ = ["BatchOIQKVCache", "OIQKVCache"]
