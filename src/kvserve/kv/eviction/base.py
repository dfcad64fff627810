"""The interface of the block pool's free queue: the blocks with ref 0, and which one allocate()
hands out next.

Every policy hands out empty blocks first (the one emptied last goes first), so no cached content
is given up while an empty block remains; the policies differ only in which *cached* block they
evict. A policy never sees blocks in use: running requests' blocks cannot be evicted.
Plain data, no torch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from kvserve.kv.block_pool import Block


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def push_empty(self, block: "Block") -> None:
        """A block with no content: handed out before any cached one."""

    @abstractmethod
    def push_cached(self, block: "Block") -> None:
        """A block whose last user left, still holding content (block.priority, block.expires set)."""

    @abstractmethod
    def take(self, block: "Block") -> None:
        """A prefix hit takes the (cached) block back into use."""

    @abstractmethod
    def take_next(self) -> "Block":
        """The next block to hand out: an empty one, else the cached one to evict."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    @abstractmethod
    def ordered(self) -> Iterable["Block"]:
        """Every block held, in the order take_next() would hand them out now."""

    def reset(self, blocks: Iterable["Block"]) -> None:
        """Only the given (empty) blocks, handed out in the order given."""
        for block in reversed(list(blocks)):
            self.push_empty(block)
