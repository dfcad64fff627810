"""LRU: cached blocks evicted least recently used first (the default, and vLLM's order).

One OrderedDict (the policy *is* one, keyed by block id): empty blocks at its front, cached ones
appended at its back as their last user leaves, so popping the front is the whole policy. Being
the dict itself lets the block pool's hot paths use its C methods directly: a Python call per
block cost 24-33 % of allocate + free (bench/NOTES.md, "Cache retention: LRU stays the pool's fast
path").
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable

from kvserve.kv.eviction.base import EvictionPolicy

if TYPE_CHECKING:
    from kvserve.kv.block_pool import Block


class LRU(EvictionPolicy, OrderedDict):
    name = "lru"

    def __init__(self, blocks: Iterable["Block"] = ()) -> None:
        OrderedDict.__init__(self, ((b.block_id, b) for b in blocks))

    def push_empty(self, block: "Block") -> None:
        self[block.block_id] = block
        self.move_to_end(block.block_id, last=False)

    def push_cached(self, block: "Block") -> None:
        self[block.block_id] = block

    def take(self, block: "Block") -> None:
        del self[block.block_id]

    def take_next(self) -> "Block":
        return self.popitem(last=False)[1]

    __len__ = OrderedDict.__len__
    __contains__ = OrderedDict.__contains__

    def ordered(self) -> list["Block"]:
        return list(self.values())

    def reset(self, blocks: Iterable["Block"]) -> None:
        self.clear()
        self.update((b.block_id, b) for b in blocks)
