"""Eviction policies of the block pool's free queue, one file each (base.py: the interface)."""
from __future__ import annotations

import time
from typing import Callable, Iterable

from kvserve.kv.eviction.base import EvictionPolicy
from kvserve.kv.eviction.lru import LRU
from kvserve.kv.eviction.priority import Priority

POLICIES = ("lru", "priority")


def make_policy(name: str, blocks: Iterable, clock: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    if name == "lru":
        return LRU(blocks)
    if name == "priority":
        return Priority(blocks, clock)
    raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, got {name!r}")
