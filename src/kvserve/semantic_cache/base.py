"""The one interface the cache's stores share, and the choice between them: a Redis URL opens the
shared Redis store (redis_store.py), anything else the embedded SQLite one (store.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class StoreUnavailable(RuntimeError):
    """The store cannot be reached now (Redis down): the request is generated, as a miss."""


@dataclass
class Row:
    id: int
    key: str
    tenant: str
    query: str
    response: str
    embedding: np.ndarray
    created: float
    expires: float
    seconds: float  # what generating the response took: the time a hit saves


class Store(ABC):
    @abstractmethod
    def add(self, key: str, tenant: str, query: str, response: str, embedding: np.ndarray, ttl: float,
            seconds: float) -> int: ...

    @abstractmethod
    def nearest(self, key: str, embedding: np.ndarray, now: float) -> tuple[Row, float] | None:
        """The live entry under `key` closest to `embedding`, with its cosine similarity."""

    @abstractmethod
    def touch(self, id: int, now: float) -> None:
        """Mark an entry used (least recently used goes first)."""

    @abstractmethod
    def expire(self, now: float) -> int:
        """Delete the entries expired at `now`; how many went."""

    @abstractmethod
    def evict_oldest(self, n: int) -> int:
        """Delete the `n` least recently used entries."""

    @abstractmethod
    def totals(self, tenant: str | None = None) -> tuple[int, int]:
        """(entries, bytes), of one tenant or all."""

    @abstractmethod
    def clear(self, tenant: str) -> int:
        """Delete one tenant's entries; how many went."""

    @abstractmethod
    def close(self) -> None: ...


def entry_bytes(query: str, response: str, embedding: np.ndarray) -> int:
    return len(query.encode()) + len(response.encode()) + embedding.nbytes


def check_location(location: str) -> None:
    """A ConfigError for a Redis URL that cannot be parsed (a path is checked when opened)."""
    if not location.startswith(REDIS_SCHEMES):
        return
    from urllib.parse import urlsplit

    from redis.connection import parse_url

    from kvserve.errors import ConfigError
    db = urlsplit(location).path.strip("/")
    if not location.startswith("unix://") and db and not db.isdigit():
        raise ConfigError(f"--semantic-cache {location!r}: the database {db!r} is not a number; use "
                          f"redis://host:port/db")
    try:
        parse_url(location)
    except ValueError as e:
        raise ConfigError(f"--semantic-cache {location!r}: {e}; use redis://host:port/db") from None


def open_store(location: str | None, dim: int, max_entries: int = 100_000) -> Store:
    """location: a Redis URL, a SQLite file, or None (SQLite in memory)."""
    if location and location.startswith(REDIS_SCHEMES):
        from kvserve.semantic_cache.redis_store import RedisStore
        return RedisStore(location, dim, max_entries)
    from kvserve.semantic_cache.store import SQLiteStore
    return SQLiteStore(location, dim)
