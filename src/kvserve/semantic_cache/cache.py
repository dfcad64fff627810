"""The cache's policy over the store: similarity threshold, TTL, and a size cap in entries and bytes
(least recently used first)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from kvserve.semantic_cache.base import open_store
from kvserve.semantic_cache.key import CacheKey, tenant_id


@dataclass
class Hit:
    response: dict
    similarity: float
    query: str  # the cached question the hit matched
    seconds: float  # what generating it took


class SemanticCache:
    def __init__(self, path: str | None, dim: int, threshold: float = 0.9, ttl: float = 3600.0,
                 max_entries: int = 100_000, max_bytes: int = 1 << 30):
        """path: a SQLite file, a Redis URL (redis://host:port/db: shared by every server on it), or
        None (in memory)."""
        self.store = open_store(path, dim, max_entries)
        self.threshold, self.ttl = threshold, ttl
        self.max_entries, self.max_bytes = max_entries, max_bytes

    def lookup(self, key: CacheKey, embedding: np.ndarray, threshold: float | None = None,
               now: float | None = None) -> Hit | None:
        now = time.time() if now is None else now
        found = self.store.nearest(key.digest, embedding, now)
        if found is None:
            return None
        row, similarity = found
        if similarity < (self.threshold if threshold is None else threshold):
            return None
        self.store.touch(row.id, now)
        return Hit(json.loads(row.response), similarity, row.query, row.seconds)

    def insert(self, key: CacheKey, tenant: str | None, query: str, embedding: np.ndarray, response: dict,
               ttl: float | None = None, seconds: float = 0.0) -> None:
        self.store.add(key.digest, tenant_id(tenant), query, json.dumps(response), embedding,
                       self.ttl if ttl is None else ttl, seconds)
        self._evict()

    def _evict(self) -> None:
        self.store.expire(time.time())
        while True:
            entries, nbytes = self.store.totals()
            # nothing left to evict: counts a Redis that evicts on its own has left too high
            if (entries <= self.max_entries and nbytes <= self.max_bytes) or not entries:
                return
            if not self.store.evict_oldest(max(1, entries // 100)):
                return

    def size(self, tenant: str | None) -> dict:
        entries, nbytes = self.store.totals(tenant_id(tenant))
        return {"entries": entries, "bytes": nbytes}

    def totals(self) -> tuple[int, int]:
        return self.store.totals()

    def clear(self, tenant: str | None) -> int:
        return self.store.clear(tenant_id(tenant))

    def close(self) -> None:
        self.store.close()
