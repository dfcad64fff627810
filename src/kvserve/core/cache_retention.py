"""Cache retention of one request: how long, and ahead of what, the blocks it leaves in the prefix
cache stay there.

`priority` (0..100, default 50): among cached blocks, a lower priority is evicted first, the least
recently used first within one priority. `ttl_s`: seconds after the block's last use at which it
drops below every priority (evicted before any block still within its TTL); None keeps the
priority for good. A block used by several requests keeps the highest priority among them.
Plain data, no torch; the KV cache manager applies it (kv/eviction/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PRIORITY, MAX_PRIORITY = 0, 100
DEFAULT_PRIORITY = 50
_KEYS = ("priority", "ttl_s")


class CacheRetentionError(ValueError):
    """An invalid cache_retention value; the message starts with the field it names."""


@dataclass(frozen=True)
class CacheRetention:
    priority: int = DEFAULT_PRIORITY
    ttl_s: float | None = None

    def as_dict(self) -> dict:
        return {"priority": self.priority, "ttl_s": self.ttl_s}


DEFAULT = CacheRetention()


def parse_cache_retention(value, field: str = "cache_retention") -> CacheRetention | None:
    """A request's `cache_retention` (a dict, a CacheRetention or None) -> CacheRetention; None
    when unset."""
    if value is None:
        return None
    if isinstance(value, CacheRetention):
        priority, ttl = value.priority, value.ttl_s
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise CacheRetentionError(f"{field} keys {', '.join(unknown)} not understood "
                                      f"(its keys: {', '.join(_KEYS)})")
        priority, ttl = value.get("priority", DEFAULT_PRIORITY), value.get("ttl_s")
    else:
        raise CacheRetentionError(f"{field} must be an object such as {{\"priority\": 80, \"ttl_s\": 600}}, "
                                  f"got {value!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise CacheRetentionError(f"{field}.priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] "
                                  f"(higher stays cached longer; default {DEFAULT_PRIORITY}), got {priority!r}")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl < 0:
            raise CacheRetentionError(f"{field}.ttl_s must be a number of seconds >= 0 (or null: no expiry), "
                                      f"got {ttl!r}")
        ttl = float(ttl)
    return CacheRetention(priority, ttl)
