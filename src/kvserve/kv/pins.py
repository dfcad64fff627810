"""Pinned prefixes: full cached blocks an operator asked to keep resident.

A pin holds one reference on each of its blocks, as a running request does, so the eviction
policy never sees them (it only orders blocks with ref 0) and every policy, LRU or priority,
keeps them without a special class. Unpinning drops the references: the blocks become ordinary
cached blocks, evicted in their turn. Two pins of the same prefix share its blocks (each holds its
own reference); pinned bytes count each block once. Plain data, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.kv.block_pool import Block, BlockPool


@dataclass
class Pin:
    pin_id: str
    cache_salt: str | None  # whose: the tenant's salt its block hashes carry
    blocks: list["Block"] = field(default_factory=list)


class PinTable:
    def __init__(self, pool: "BlockPool") -> None:
        self.pool = pool
        self.pins: dict[str, Pin] = {}

    def pin(self, pin_id: str, cache_salt: str | None, blocks: list["Block"]) -> Pin:
        """Hold `blocks` (full blocks of the prefix cache, in prefix order) under `pin_id`."""
        if pin_id in self.pins:
            raise ValueError(f"pin {pin_id!r} exists")
        for b in blocks:
            if b.block_hash is None:
                raise ValueError(f"block {b.block_id} is not a full cached block; only those can be pinned")
            self.pool.touch(b)
            b.hits -= 1  # a pin is not a prefix-cache hit (the dashboard counts those)
        pin = self.pins[pin_id] = Pin(pin_id, cache_salt, list(blocks))
        return pin

    def unpin(self, pin_id: str) -> Pin | None:
        pin = self.pins.pop(pin_id, None)
        if pin is not None and pin.blocks:
            # Tail first, as requests free theirs: the prefix outlives its extensions.
            self.pool.free(reversed(pin.blocks), None)
        return pin

    def owners(self) -> dict[int, int]:
        """References the pins hold, by block id (the integrity check's count)."""
        out: dict[int, int] = {}
        for pin in self.pins.values():
            for b in pin.blocks:
                out[b.block_id] = out.get(b.block_id, 0) + 1
        return out

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len({b.block_id for pin in self.pins.values() for b in pin.blocks})
