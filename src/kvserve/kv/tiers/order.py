"""RetentionOrder: which entry a full tier drops first, by the same rule as the device pool.

Lowest retention priority first, least recently used first within one priority; an entry past its
expiry (wall-clock seconds, so that it means the same after a restart and on another server) sits
below every priority, the earliest expiry first. Entries without a retention (written before
tiers carried one) are given `LOWEST`, below every priority a request can set.

One OrderedDict per priority present (a handful in practice) and a heap of expiries whose stale
entries (a re-put moved or dropped the key) are skipped when they surface and swept out when they
outnumber the live ones. Not thread-safe: the tier calls it under its own lock.
"""
from __future__ import annotations

import heapq
import math
import time
from bisect import insort
from collections import OrderedDict
from typing import Callable, Iterator, NamedTuple

from kvserve.core.cache_retention import DEFAULT_PRIORITY

LOWEST = -1  # below every request priority: entries of unknown retention (an older format)
_COMPACT_MIN = 1024


class Retention(NamedTuple):
    """An entry's retention as a tier keeps it: priority and wall-clock expiry (inf: none)."""
    priority: int = DEFAULT_PRIORITY
    expires: float = math.inf


DEFAULT = Retention()


class RetentionOrder:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._levels: dict[int, OrderedDict[bytes, int]] = {}  # priority -> key -> size, LRU first
        self._order: list[int] = []  # priorities with a non-empty level, ascending
        self._meta: dict[bytes, tuple[int, float, int]] = {}  # key -> (priority, expires, seq)
        self._deadlines: list[tuple[float, int, bytes]] = []  # (expires, seq, key)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._meta)

    def size(self, key: bytes) -> int | None:
        meta = self._meta.get(key)
        return None if meta is None else self._levels[meta[0]][key]

    def retention(self, key: bytes) -> Retention | None:
        meta = self._meta.get(key)
        return None if meta is None else Retention(meta[0], meta[1])

    def add(self, key: bytes, size: int, retention: Retention = DEFAULT) -> None:
        """Insert `key` as the most recently used of its priority. A key already present keeps
        the higher of its priority and the new one (a block shared by several requests keeps
        the highest among them), unless its own has expired; the later expiry wins at equal
        priority."""
        priority, expires = retention
        old = self._meta.get(key)
        if old is not None:
            old_p, old_exp, _ = old
            if old_p > priority and old_exp > self.clock():
                priority, expires = old_p, old_exp
            elif old_p == priority:
                expires = max(expires, old_exp)
            size = self.pop(key)
        self._insert(key, size, priority, expires)

    def touch(self, key: bytes) -> None:
        """A hit: the key becomes the most recently used of its priority."""
        meta = self._meta.get(key)
        if meta is not None:
            self._levels[meta[0]].move_to_end(key)

    def pop(self, key: bytes) -> int | None:
        """Remove `key`; its size, or None when absent."""
        meta = self._meta.pop(key, None)
        if meta is None:
            return None
        level = self._levels[meta[0]]
        size = level.pop(key)
        if not level:
            del self._levels[meta[0]]
            self._order.remove(meta[0])
        return size

    def victim(self) -> bytes | None:
        """The key to drop next (not removed), or None when empty."""
        d = self._deadlines
        now = self.clock()
        while d:
            expires, seq, key = d[0]
            meta = self._meta.get(key)
            if meta is None or meta[2] != seq:  # stale: moved or dropped since
                heapq.heappop(d)
                continue
            if expires <= now:
                return key
            break
        if not self._order:
            return None
        return next(iter(self._levels[self._order[0]]))

    def pop_victim(self) -> tuple[bytes, int] | None:
        key = self.victim()
        return None if key is None else (key, self.pop(key))

    def ordered(self) -> list[bytes]:
        """Every key, in the order they would be dropped now (for tests and inspection)."""
        now = self.clock()
        expired = sorted((m[1], m[2], k) for k, m in self._meta.items() if m[1] <= now)
        out = [k for _, _, k in expired]
        gone = set(out)
        for p in self._order:
            out += [k for k in self._levels[p] if k not in gone]
        return out

    def clear(self) -> None:
        self.__init__(self.clock)

    def _insert(self, key: bytes, size: int, priority: int, expires: float) -> None:
        seq = self._seq = self._seq + 1
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = OrderedDict()
            insort(self._order, priority)
        level[key] = size
        self._meta[key] = (priority, expires, seq)
        if expires != math.inf:
            heapq.heappush(self._deadlines, (expires, seq, key))
            if len(self._deadlines) > 2 * len(self._meta) + _COMPACT_MIN:
                self._deadlines = [e for e in self._deadlines
                                   if self._meta.get(e[2], (0, 0, -1))[2] == e[1]]
                heapq.heapify(self._deadlines)
