"""Entries in Redis, shared by every server pointed at it (`--semantic-cache redis://host:port/db`).

Each entry is a hash `<prefix>e:<id>` (ids from one INCR, never reused) holding the question, the
answer and the embedding's bytes; a sorted set per key digest (by id) and a set per tenant list
the ids, a sorted set orders them by last use (LRU) and one by expiry, and one hash keeps the
entry and byte counts. Each key digest also has a version: the id of its last entry added, and a
number from the same INCR when one was last deleted. Adding and deleting are Lua scripts, so two
servers racing on one entry count it once and leave no half-listed entry.

A lookup reads the key's version (one round trip). When entries were only added since this server
last looked, it reads the ids above the last it knew; after a delete, all the key's ids. It
fetches the embeddings it has not seen (entries never change, so a server keeps them by id), then
scans with one matrix product over the key's embeddings: a key's entries are
one tenant's one conversation and settings, and the scan needs no index kept in step across
servers (bench/NOTES.md has the figures). The best candidate's row is then read back and checked:
deleted or expired by any server, it is not served.

Expiry is checked on read and swept by whichever server inserts (Redis's own key expiry would
drop an entry without its counts). Redis down, at start-up or later: a warning once, every call
raises StoreUnavailable (a miss for the request) without touching the network until a backoff
interval has passed, and the first call that answers logs the recovery.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np
import redis
from redis.exceptions import RedisError, ResponseError

from kvserve.errors import ConfigError
from kvserve.semantic_cache.base import Row, Store, StoreUnavailable, check_location, entry_bytes

logger = logging.getLogger("kvserve.semantic_cache")

_ADD = """
local p = ARGV[1]
local id = redis.call('INCR', p .. 'next')
redis.call('HSET', p .. 'e:' .. id, 'key', ARGV[2], 'tenant', ARGV[3], 'query', ARGV[4], 'response', ARGV[5],
           'embedding', ARGV[6], 'created', ARGV[7], 'expires', ARGV[8], 'seconds', ARGV[9], 'nbytes', ARGV[10])
redis.call('ZADD', p .. 'k:' .. ARGV[2], id, id)
redis.call('HSET', p .. 'v:' .. ARGV[2], 'added', id)
redis.call('SADD', p .. 't:' .. ARGV[3], id)
redis.call('ZADD', p .. 'used', ARGV[7], id)
redis.call('ZADD', p .. 'exp', ARGV[8], id)
redis.call('HINCRBY', p .. 'totals', 'n', 1)
redis.call('HINCRBY', p .. 'totals', 'b', ARGV[10])
redis.call('HINCRBY', p .. 'totals', 'n:' .. ARGV[3], 1)
redis.call('HINCRBY', p .. 'totals', 'b:' .. ARGV[3], ARGV[10])
return id
"""

_DELETE = """
local p = ARGV[1]
local n = 0
local changed = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local f = redis.call('HMGET', p .. 'e:' .. id, 'key', 'tenant', 'nbytes')
  if f[1] then
    redis.call('DEL', p .. 'e:' .. id)
    redis.call('ZREM', p .. 'k:' .. f[1], id)
    changed[f[1]] = true
    redis.call('SREM', p .. 't:' .. f[2], id)
    redis.call('HINCRBY', p .. 'totals', 'n', -1)
    redis.call('HINCRBY', p .. 'totals', 'b', -tonumber(f[3]))
    redis.call('HINCRBY', p .. 'totals', 'n:' .. f[2], -1)
    redis.call('HINCRBY', p .. 'totals', 'b:' .. f[2], -tonumber(f[3]))
    n = n + 1
  end
  redis.call('ZREM', p .. 'used', id)
  redis.call('ZREM', p .. 'exp', id)
end
if next(changed) then
  local stamp = redis.call('INCR', p .. 'next')
  for key in pairs(changed) do
    if redis.call('ZCARD', p .. 'k:' .. key) == 0 then
      redis.call('DEL', p .. 'v:' .. key)
    else
      redis.call('HSET', p .. 'v:' .. key, 'deleted', stamp)
    end
  end
end
return n
"""

_GROUPS = 1024  # keys whose matrix a server keeps between lookups
_FIELDS = ("key", "tenant", "query", "response", "embedding", "created", "expires", "seconds")


class RedisStore(Store):
    def __init__(self, url: str, dim: int, max_entries: int = 100_000, *, prefix: str = "kvserve-semantic:",
                 socket_timeout: float = 0.25, backoff_initial: float = 0.5, backoff_max: float = 30.0):
        self.url, self.dim, self.prefix = url, dim, prefix
        check_location(url)
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                                            health_check_interval=0)
        self._add = self._client.register_script(_ADD)
        self._delete = self._client.register_script(_DELETE)
        # embeddings by id, at most as many as the cache keeps: entries never change once written
        self._vectors: OrderedDict[int, tuple[np.ndarray, float]] = OrderedDict()
        self._max_vectors = max_entries
        # key digest -> (last added, last deleted, (its entries' ids, expiry times, embeddings))
        self._groups: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at, self._backoff = 0.0, backoff_initial
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        try:
            self._call(self._client.ping, refusal=True)
        except ResponseError as e:  # it answered and refused: a setting to fix, not an outage
            raise ConfigError(f"--semantic-cache {url!r}: Redis refused the connection ({e}); check the "
                              f"database index and credentials") from None
        except StoreUnavailable:
            pass  # warned; the cache starts as misses and finds Redis when it comes back

    # ----- Redis calls, with the outage handling -----

    def _call(self, fn, *args, refusal: bool = False, **kwargs):
        """fn's result; StoreUnavailable when Redis is down or refuses (refusal: re-raise that)."""
        with self._lock:
            if self._down_since is not None and time.monotonic() < self._retry_at:
                raise StoreUnavailable(f"Redis at {self.url} is down")
        try:
            result = fn(*args, **kwargs)
        except ResponseError as e:
            if refusal:
                raise
            # it answered and refused this command (e.g. OOM under noeviction): not an outage
            raise StoreUnavailable(f"Redis at {self.url} refused: {e}") from None
        except (RedisError, OSError) as e:
            self._mark_down(e)
            raise StoreUnavailable(f"Redis at {self.url}: {e}") from None
        if self._down_since is not None:
            with self._lock:
                outage, self._down_since, self._backoff = time.monotonic() - self._down_since, None, self.backoff_initial
            logger.info("semantic cache: Redis at %s reachable again after %.1fs", self.url, outage)
        return result

    def _mark_down(self, e: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            if self._down_since is None:
                self._down_since, self._backoff = now, self.backoff_initial
                logger.warning("semantic cache: Redis at %s unavailable (%s); every lookup is a miss until it "
                               "answers (retrying with backoff up to %gs)", self.url, e, self.backoff_max)
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max)
            self._retry_at = now + self._backoff

    def _pipeline(self, commands) -> list:
        def run():
            pipe = self._client.pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            return pipe.execute()
        return self._call(run)

    # ----- the interface -----

    def add(self, key, tenant, query, response, embedding, ttl, seconds) -> int:
        now = time.time()
        vec = np.asarray(embedding, np.float32).reshape(-1)
        return int(self._call(self._add, args=[self.prefix, key, tenant, query, response, vec.tobytes(), now,
                                               now + ttl, seconds, entry_bytes(query, response, vec)]))

    def nearest(self, key: str, embedding: np.ndarray, now: float) -> tuple[Row, float] | None:
        added, deleted = self._call(self._client.hmget, f"{self.prefix}v:{key}", "added", "deleted")
        if added is None:
            return None
        group = self._group(key, int(added), int(deleted or 0))
        if group is None:
            return None
        ids, expires, matrix = group
        vec = np.asarray(embedding, np.float32).reshape(-1)
        sims = np.where(expires > now, matrix @ vec, -np.inf)
        best = np.argpartition(-sims, 3)[:4] if len(sims) > 4 else np.arange(len(sims))
        for j in best[np.argsort(-sims[best])]:  # the best whose row is still there
            if sims[j] == -np.inf:
                break
            row = self._row(int(ids[j]))
            if row is not None and row.key == key and row.expires > now:
                return row, float(row.embedding @ vec)
        return None

    def _group(self, key: str, added: int, deleted: int):
        """(ids, expiry times, embeddings as rows) of the key's entries as of its version."""
        with self._lock:
            cached = self._groups.get(key)
        if cached is not None and cached[:2] == (added, deleted):
            return cached[2]
        zset = f"{self.prefix}k:{key}"
        if cached is not None and cached[1] == deleted and cached[2] is not None:
            old = cached[2]  # only additions since: read the ids above the last one known
            ids = [int(i) for i in self._call(self._client.zrangebyscore, zset, f"({cached[0]}", "+inf")]
        else:
            old, ids = None, [int(i) for i in self._call(self._client.zrange, zset, 0, -1)]
        self._fetch([i for i in ids if i not in self._vectors])
        new = [(i, v) for i in ids if (v := self._vectors.get(i)) is not None]
        parts = [old] if old is not None else []
        if new:
            parts.append((np.array([i for i, _ in new]), np.array([v[1] for _, v in new]),
                          np.stack([v[0] for _, v in new])))
        group = tuple(np.concatenate(x) for x in zip(*parts)) if parts else None
        # ids added after the version was read are in: the next read starts above them
        added = max([added, *ids])
        with self._lock:
            self._groups[key] = (added, deleted, group)
            self._groups.move_to_end(key)
            while len(self._groups) > _GROUPS:
                self._groups.popitem(last=False)
        return group

    def _fetch(self, ids: list[int]) -> None:
        if not ids:
            return
        got = self._pipeline([("hmget", f"{self.prefix}e:{i}", "embedding", "expires") for i in ids])
        for i, (blob, expires) in zip(ids, got):
            if blob is not None:  # gone: deleted by a server since the ids were read
                self._vectors[i] = (np.frombuffer(blob, np.float32), float(expires))
        while len(self._vectors) > self._max_vectors:
            self._vectors.popitem(last=False)

    def _row(self, id: int) -> Row | None:
        f = self._call(self._client.hmget, f"{self.prefix}e:{id}", *_FIELDS)
        if f[0] is None:
            return None
        return Row(id, f[0].decode(), f[1].decode(), f[2].decode(), f[3].decode(), np.frombuffer(f[4], np.float32),
                   float(f[5]), float(f[6]), float(f[7]))

    def touch(self, id: int, now: float) -> None:
        self._call(self._client.zadd, f"{self.prefix}used", {str(id): now}, xx=True)

    def _delete_ids(self, ids) -> int:
        if not ids:
            return 0
        for i in ids:
            self._vectors.pop(int(i), None)
        return int(self._call(self._delete, args=[self.prefix, *ids]))

    def expire(self, now: float) -> int:
        return self._delete_ids(self._call(self._client.zrangebyscore, f"{self.prefix}exp", "-inf", now, 0, 1000))

    def evict_oldest(self, n: int) -> int:
        return self._delete_ids(self._call(self._client.zrange, f"{self.prefix}used", 0, n - 1))

    def totals(self, tenant: str | None = None) -> tuple[int, int]:
        fields = ("n", "b") if tenant is None else (f"n:{tenant}", f"b:{tenant}")
        n, b = self._call(self._client.hmget, f"{self.prefix}totals", *fields)
        return int(n or 0), int(b or 0)

    def clear(self, tenant: str) -> int:
        ids = list(self._call(self._client.smembers, f"{self.prefix}t:{tenant}"))
        return sum(self._delete_ids(ids[i:i + 1000]) for i in range(0, len(ids), 1000))

    def close(self) -> None:
        try:
            self._client.close()
        except (RedisError, OSError):
            pass
