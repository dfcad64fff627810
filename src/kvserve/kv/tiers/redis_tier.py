"""Redis tier (`--kv-redis-url`): a KV block pool shared by every server that points at it.

A Redis that is down or slow must cost the engine a recompute, never a stall or a crash. So:
short socket timeouts; on a failure the tier counts the error, logs once per outage (not per
call), and stops calling Redis for a backoff interval that doubles while it stays down; during
that interval gets are misses and puts are dropped without touching the network. The first
call after the interval probes again, and a success logs the recovery and resets the backoff.

Keys are `prefix + fingerprint digest + chain hash` (binary), so engines with different models or
KV layouts share one Redis without seeing each other's blocks. An optional TTL bounds how long
blocks stay; otherwise Redis's own maxmemory policy (allkeys-lru suits a cache) evicts. A block
whose retention has a TTL (`cache_retention.ttl_s`) gets the time it has left as its Redis expiry
(the shorter of the two when both are set). Priorities do not reach Redis's eviction: kvserve
never trims a shared Redis; what it drops when full is its maxmemory policy's choice, so the
priority gate on writing down (--kv-offload-min-priority) is what keeps low-priority blocks out.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from kvserve.config import ConfigError
from kvserve.kv.tiers.base import Buffer, EngineFingerprint, KVTier, TierUsage
from kvserve.kv.tiers.order import DEFAULT, Retention

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SCHEMES = ("redis", "rediss", "unix")


class _Unavailable:
    """Returned by _call when Redis failed or is in backoff (distinct from a None reply)."""


_UNAVAILABLE = _Unavailable()


class RedisTier(KVTier):
    name = "redis"
    medium = "REDIS"  # Redis's own maxmemory evictions are not seen here: only this side's deletes

    def __init__(self, fingerprint: EngineFingerprint, url: str, *, socket_timeout: float = 0.25,
                 ttl_seconds: float | None = None, key_prefix: bytes = b"kvserve:",
                 backoff_initial: float = 0.5, backoff_max: float = 30.0):
        parts = urlsplit(url)
        if parts.scheme not in _SCHEMES:
            raise ConfigError(f"--kv-redis-url {url!r} is not a Redis URL; use redis://host:port/db, "
                              f"rediss://... for TLS, or unix:///path/to/redis.sock")
        db = parts.path.strip("/")
        if parts.scheme != "unix" and db and not db.isdigit():
            raise ConfigError(f"--kv-redis-url {url!r}: the database {db!r} is not a number; use redis://host:port/0")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ConfigError(f"the Redis tier TTL must be > 0 seconds (got {ttl_seconds}); omit it to keep "
                              f"blocks until Redis evicts them")
        super().__init__(fingerprint)
        self.url = url
        self.ttl_ms = None if ttl_seconds is None else max(1, int(ttl_seconds * 1000))
        self._key_prefix = key_prefix + fingerprint.digest
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        # One immediate retry on a connection error re-dials a connection the server dropped
        # (e.g. after a Redis restart); timeouts are not retried, they already cost socket_timeout.
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                health_check_interval=0)
        except ValueError as e:  # the client's URL parser: port or db not a number, out of range
            raise ConfigError(f"--kv-redis-url {url!r}: {e}; use redis://host:port/db") from None
        self._state_lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = backoff_initial
        self._last_usage = TierUsage(0, None, 0)
        try:  # find out now (and log once) if Redis is unreachable
            self._call(self._client.ping, _refusal=True)
        except ResponseError as e:  # it answered, and refused us: a setting to fix, not an outage
            raise ConfigError(f"--kv-redis-url {url!r}: Redis refused the connection ({e}); check the "
                              f"database index and credentials") from None

    @property
    def available(self) -> bool:
        """False while the tier treats Redis as down (between a failure and a successful probe)."""
        return self._down_since is None

    def redis_key(self, key: bytes) -> bytes:
        return self._key_prefix + key

    def _call(self, fn: Callable[..., T], *args: Any, _refusal: bool = False, **kwargs: Any) -> T | _Unavailable:
        """fn's result, or _UNAVAILABLE; _refusal: re-raise Redis refusing the command."""
        with self._state_lock:
            if self._down_since is not None and time.monotonic() < self._retry_at:
                return _UNAVAILABLE
        try:
            result = fn(*args, **kwargs)
        except ResponseError as exc:
            if _refusal:
                raise
            # Redis answered, refusing this command (e.g. "OOM command not allowed" when full
            # under noeviction): the put fails, reads go on; it is not an outage.
            logger.debug("Redis KV tier at %s refused a command: %s", self.url, exc)
            return _UNAVAILABLE
        except (RedisError, OSError) as exc:
            self._mark_down(exc)
            return _UNAVAILABLE
        if self._down_since is not None:
            self._mark_up()
        return result

    def _mark_down(self, exc: BaseException) -> None:
        self._count(errors=1)
        now = time.monotonic()
        with self._state_lock:
            if self._down_since is None:
                self._down_since = now
                self._backoff = self.backoff_initial
                logger.warning("Redis KV tier at %s unavailable (%s); serving without it (blocks are "
                               "recomputed) and retrying with backoff up to %gs", self.url, exc, self.backoff_max)
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max)
            self._retry_at = now + self._backoff

    def _mark_up(self) -> None:
        with self._state_lock:
            if self._down_since is None:
                return
            outage = time.monotonic() - self._down_since
            self._down_since = None
            self._backoff = self.backoff_initial
        logger.info("Redis KV tier at %s reachable again after %.1fs", self.url, outage)

    def expiry_ms(self, retention: Retention) -> int | None:
        """The Redis expiry of an entry: the tier's TTL and the block's time left, the shorter;
        0 when the block's retention has already run out (not worth a round trip)."""
        ttl = self.ttl_ms
        if retention.expires != math.inf:
            left = int((retention.expires - time.time()) * 1000)
            if left <= 0:
                return 0
            ttl = left if ttl is None else min(ttl, left)
        return ttl

    def _store(self, key: bytes, header: bytes, payload: Buffer, retention: Retention = DEFAULT) -> bool:
        px = self.expiry_ms(retention)
        if px == 0:
            return False
        # Redis takes one value: join header and payload (one copy, same as the wire would need).
        value = b"".join((header, memoryview(payload).cast("B")))
        result = self._call(self._client.set, self.redis_key(key), value, px=px)
        return result is not _UNAVAILABLE and bool(result)

    def _load(self, key: bytes) -> Buffer | None:
        return self._load_many([key])[0]

    def _load_many(self, keys: list[bytes]) -> list[Buffer | None]:
        if not keys:
            return []
        result = self._call(self._client.mget, [self.redis_key(k) for k in keys])
        if result is _UNAVAILABLE:
            return [None] * len(keys)
        return list(result)

    def _contains(self, key: bytes) -> bool:
        result = self._call(self._client.exists, self.redis_key(key))
        return result is not _UNAVAILABLE and bool(result)

    def _delete(self, key: bytes) -> bool:
        result = self._call(self._client.delete, self.redis_key(key))
        return result is not _UNAVAILABLE and bool(result)

    def _usage(self) -> TierUsage:
        """Server-wide figures (the pool is shared): used_memory, maxmemory (None when unlimited),
        and the key count. The last known figures while Redis is down."""
        info = self._call(self._client.info, "memory")
        size = self._call(self._client.dbsize) if not isinstance(info, _Unavailable) else _UNAVAILABLE
        if isinstance(info, _Unavailable) or isinstance(size, _Unavailable):
            return self._last_usage
        capacity = int(info.get("maxmemory", 0)) or None
        self._last_usage = TierUsage(int(info.get("used_memory", 0)), capacity, int(size))
        return self._last_usage

    def _close(self) -> None:
        try:
            self._client.close()
        except (RedisError, OSError):
            pass
