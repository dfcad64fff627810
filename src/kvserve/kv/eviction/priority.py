"""Priority: cached blocks evicted lowest retention priority first, least recently used first
within one priority; a block past its TTL (block.expires) sits below every priority.

Empty blocks: an OrderedDict, as LRU's front. Cached blocks: one OrderedDict per priority (LRU
order within), the priorities present kept sorted (a handful in practice, so insort is cheap).
Expiry is noticed lazily, when a block must be evicted: a heap of deadlines moves the blocks past
theirs into the expired class, itself a heap by recency (the order their last users left), so
expired blocks go least recently used first too. Heap entries of blocks taken back by a prefix hit
stay until they surface (they are recognised by a stale sequence number), and the heaps are
rebuilt when stale entries outnumber live ones.
"""
from __future__ import annotations

import heapq
import math
import time
from bisect import insort
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterable

from kvserve.kv.eviction.base import EvictionPolicy

if TYPE_CHECKING:
    from kvserve.kv.block_pool import Block

_COMPACT_MIN = 1024


class Priority(EvictionPolicy):
    name = "priority"

    def __init__(self, blocks: Iterable["Block"] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._empty: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)
        self._levels: dict[int, OrderedDict[int, Block]] = {}
        self._order: list[int] = []  # priorities with a non-empty level, ascending
        self._where: dict[int, int] = {}  # cached block id -> its level (not yet expired)
        self._expired: dict[int, Block] = {}
        self._expired_heap: list[tuple[int, int]] = []  # (seq, block id)
        self._deadlines: list[tuple[float, int, int]] = []  # (expires, seq, block id)
        self._seq: dict[int, int] = {}  # cached block id -> when its last user left (a counter)
        self._next_seq = 0
        self.last_expired = False  # whether the last block take_next() evicted was past its TTL

    def push_empty(self, block: "Block") -> None:
        self._empty[block.block_id] = block
        self._empty.move_to_end(block.block_id, last=False)

    def push_cached(self, block: "Block") -> None:
        bid, seq = block.block_id, self._next_seq
        self._next_seq = seq + 1
        self._seq[bid] = seq
        level = self._levels.get(block.priority)
        if level is None:
            level = self._levels[block.priority] = OrderedDict()
            insort(self._order, block.priority)
        level[bid] = block
        self._where[bid] = block.priority
        if block.expires != math.inf:
            heapq.heappush(self._deadlines, (block.expires, seq, bid))
            if len(self._deadlines) > 2 * len(self._where) + _COMPACT_MIN:
                self._deadlines = [e for e in self._deadlines if self._live_deadline(e)]
                heapq.heapify(self._deadlines)

    def take(self, block: "Block") -> None:
        bid = block.block_id
        if self._empty.pop(bid, None) is not None:
            return
        self._seq.pop(bid)
        p = self._where.pop(bid, None)
        if p is None:
            del self._expired[bid]
            if len(self._expired_heap) > 2 * len(self._expired) + _COMPACT_MIN:
                self._expired_heap = [(s, b) for s, b in self._expired_heap
                                      if b in self._expired and self._seq.get(b) == s]
                heapq.heapify(self._expired_heap)
        else:
            self._take(p, bid)

    def take_next(self) -> "Block":
        self.last_expired = False
        if self._empty:
            return self._empty.popitem(last=False)[1]
        self._expire(self.clock())
        while self._expired_heap:
            seq, bid = heapq.heappop(self._expired_heap)
            if bid in self._expired and self._seq.get(bid) == seq:
                del self._seq[bid]
                self.last_expired = True
                return self._expired.pop(bid)
        if not self._order:
            raise RuntimeError("eviction policy: no block to hand out")
        p = self._order[0]
        level = self._levels[p]
        bid, block = level.popitem(last=False)
        if not level:
            del self._levels[p]
            self._order.pop(0)
        del self._where[bid]
        del self._seq[bid]
        return block

    def __len__(self) -> int:
        return len(self._empty) + len(self._where) + len(self._expired)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._empty or block_id in self._where or block_id in self._expired

    def ordered(self) -> list["Block"]:
        self._expire(self.clock())
        out = list(self._empty.values())
        out += sorted(self._expired.values(), key=lambda b: self._seq[b.block_id])
        for p in self._order:
            out += self._levels[p].values()
        return out

    def reset(self, blocks: Iterable["Block"]) -> None:
        self.__init__(blocks, self.clock)

    def _take(self, p: int, bid: int) -> "Block":
        level = self._levels[p]
        block = level.pop(bid)
        if not level:
            del self._levels[p]
            self._order.remove(p)
        return block

    def _live_deadline(self, entry: tuple[float, int, int]) -> bool:
        _, seq, bid = entry
        return bid in self._where and self._seq.get(bid) == seq

    def _expire(self, now: float) -> None:
        """Move every cached block whose TTL has run out into the expired class."""
        d = self._deadlines
        while d and d[0][0] <= now:
            entry = heapq.heappop(d)
            if self._live_deadline(entry):
                _, seq, bid = entry
                block = self._take(self._where.pop(bid), bid)
                self._expired[bid] = block
                heapq.heappush(self._expired_heap, (seq, bid))
