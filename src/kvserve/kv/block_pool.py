"""BlockPool: the fixed set of KV blocks, their reference counts and the prefix-cache index.

A block is in exactly one of three states:
  used    ref_cnt > 0: in some request's block table;
  cached  ref_cnt == 0 but holding K/V the prefix cache can still serve (it sits in the free queue);
  free    ref_cnt == 0 and empty.
The free queue holds both cached and free blocks. Empty blocks are handed out before any cached
content is given up; which cached block goes first is the eviction policy's (kv/eviction/): LRU by
default, or by the retention priority and TTL requests give their blocks (`cache_retention`). The
pool starts with LRU and moves to the priority policy the first time a request frees blocks with a
retention other than the default, so a server whose requests set none keeps LRU's order and cost.

Index: full blocks by chain hash (`cached`), and every block holding tokens by the hash of the
prefix it extends (`children`). The second index is what lets a new request reuse the first
tokens of a *partial* block, or of a full block it only shares in part.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvserve.core.cache_retention import DEFAULT as DEFAULT_RETENTION
from kvserve.core.cache_retention import DEFAULT_PRIORITY, CacheRetention
from kvserve.kv.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventSink
from kvserve.kv.eviction import make_policy
from kvserve.kv.eviction.lru import LRU
from kvserve.kv.eviction.priority import Priority

UNSET = -1  # a block's priority before any request has left it


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Chain hash of the prefix this block extends (root hash for a request's first block);
    # None while the block holds no committed tokens.
    parent_hash: bytes | None = None
    # Token ids whose K/V are written in this block (only tracked with prefix caching on).
    token_ids: list[int] = field(default_factory=list)
    # Set when the block is full and registered in the prefix-cache index.
    block_hash: bytes | None = None
    num_filled: int = 0  # slots holding K/V (tracked with and without prefix caching)
    # For the dashboard's prefix tree: prefix-cache hits on this content, and when its last user left.
    hits: int = 0
    last_used: float = 0.0
    # Retention of its content (core/cache_retention.py): the highest priority among the requests
    # that used it (UNSET until the first leaves it), and when that lapses (monotonic s; inf: never).
    priority: int = UNSET
    expires: float = math.inf

    @property
    def has_content(self) -> bool:
        return self.parent_hash is not None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int,
                 on_evict: Callable[[Block], None] | None = None, events: KVEventSink | None = None,
                 eviction_policy: str = "lru", clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.clock = clock
        self.free_queue = make_policy(eviction_policy, self.blocks, clock)
        # The LRU policy is an OrderedDict: the hot paths below use its methods directly.
        self._lru = isinstance(self.free_queue, LRU)
        self.cached: dict[bytes, Block] = {}
        self.children: dict[bytes, dict[int, Block]] = {}
        self.num_cached_free = 0  # blocks with ref 0 that still hold content
        # Slots holding K/V in blocks in use (ref > 0), kept as they change: token occupancy in
        # O(1) each step, where summing it meant walking every block of every request.
        self.num_filled_used = 0
        self.num_evictions = 0
        # Evictions by the evicted block's class (retention_class); under LRU every block is "default".
        self.evictions_by_class: dict[str, int] = {}
        self.on_evict = on_evict  # called before a cached block's content is dropped (offload tiers)
        self.events = events  # BlockStored / BlockRemoved / AllBlocksCleared, medium "GPU"

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones plus evictable cached ones)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self) -> Block:
        if not self.free_queue:
            raise RuntimeError("BlockPool.allocate: no free block (caller must check num_free_blocks)")
        if self._lru:
            _, block = self.free_queue.popitem(last=False)
        else:
            block = self.free_queue.take_next()
        if block.has_content:
            self.num_cached_free -= 1
            self.num_evictions += 1
            if not self._lru:
                cls = "expired" if self.free_queue.last_expired else retention_class(block.priority)
                self.evictions_by_class[cls] = self.evictions_by_class.get(cls, 0) + 1
            if self.on_evict is not None:
                self.on_evict(block)
            self._drop_content(block)
        block.ref_cnt = 1
        block.num_filled = 0
        block.hits = 0
        return block

    def touch(self, block: Block) -> None:
        """Take a reference on a block found in the prefix cache."""
        if block.ref_cnt == 0:
            if self._lru:
                del self.free_queue[block.block_id]
            else:
                self.free_queue.take(block)
            if block.has_content:
                self.num_cached_free -= 1
            self.num_filled_used += block.num_filled
        block.ref_cnt += 1
        block.hits += 1

    def set_filled(self, block: Block, num_filled: int) -> None:
        """The block's slots holding K/V (a block in use)."""
        self.num_filled_used += num_filled - block.num_filled
        block.num_filled = num_filled

    @property
    def retained(self) -> bool:
        """Whether the priority policy orders the cached blocks (else LRU)."""
        return not self._lru

    def evictions(self) -> dict[str, int]:
        """Evictions so far by retention class ("expired", "low", "default", "high")."""
        if not self.retained:
            return {"default": self.num_evictions} if self.num_evictions else {}
        return dict(self.evictions_by_class)

    def free(self, blocks: Iterable[Block], retention: CacheRetention | None = DEFAULT_RETENTION) -> None:
        """Drop one reference on each block. Callers pass a request's blocks tail first, so that
        its least shareable blocks are evicted before its prefix. `retention`: the releasing
        request's (None: leave each block's as it is); the block keeps the higher of its own and
        this one while its own TTL runs."""
        if not self._lru or (retention is not None and retention is not DEFAULT_RETENTION
                             and (retention.priority != DEFAULT_PRIORITY or retention.ttl_s is not None)):
            self._free_retained(blocks, retention)
            return
        now = self.clock()
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.last_used = now
                self.num_filled_used -= block.num_filled
                queue[block.block_id] = block
                if block.has_content:
                    self.num_cached_free += 1
                else:
                    queue.move_to_end(block.block_id, last=False)

    def _free_retained(self, blocks: Iterable[Block], retention: CacheRetention | None) -> None:
        if not self.retained:
            self._use_priority()
        now = self.clock()
        if retention is not None:
            p = retention.priority
            expires = math.inf if retention.ttl_s is None else now + retention.ttl_s
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            if block.has_content:
                if retention is None:
                    if block.priority == UNSET:
                        block.priority = DEFAULT_PRIORITY
                elif p > block.priority or block.expires <= now:
                    block.priority, block.expires = p, expires
                elif p == block.priority and expires > block.expires:
                    block.expires = expires
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.last_used = now
                self.num_filled_used -= block.num_filled
                if block.has_content:
                    self.free_queue.push_cached(block)
                    self.num_cached_free += 1
                else:
                    self.free_queue.push_empty(block)

    def _use_priority(self) -> None:
        """Move from LRU to the priority policy, keeping the queue's order: every cached block so
        far has the default retention, so LRU order is the new policy's order too."""
        old = self.free_queue.ordered()
        self.free_queue = Priority((), self.clock)
        self._lru = False
        for block in old:
            if block.has_content:
                block.priority = DEFAULT_PRIORITY
                self.free_queue.push_cached(block)
        for block in reversed([b for b in old if not b.has_content]):
            self.free_queue.push_empty(block)
        if self.num_evictions:
            self.evictions_by_class["default"] = self.num_evictions

    # -- prefix-cache index ---------------------------------------------------------------------
    def record_tokens(self, block: Block, parent_hash: bytes, token_ids: list[int]) -> None:
        """Note the committed tokens of a block (it extends the prefix `parent_hash`)."""
        if block.parent_hash is None:
            block.parent_hash = parent_hash
            self.children.setdefault(parent_hash, {})[block.block_id] = block
        block.token_ids = token_ids

    def cache_full_block(self, block: Block, block_hash: bytes, parent_hash: bytes | None = None) -> bool:
        """Index a full block under its chain hash; `parent_hash` (None for a sequence's first
        block) is for the KV events only. True when the index did not hold that hash before."""
        existing = self.cached.get(block_hash)
        if existing is None:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.events is not None:
                self.events.add(BlockStored([block_hash], parent_hash, list(block.token_ids), self.block_size,
                                            None, MEDIUM_DEVICE))
            return True
        if existing is not block:
            # Computed twice concurrently: keep the first copy in the index; this one is just
            # private memory of its request and leaves the partial index too.
            self._drop_content(block)
        return False

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def candidates(self, parent_hash: bytes) -> Iterable[Block]:
        return self.children.get(parent_hash, {}).values()

    def reset_prefix_cache(self, keep: dict[int, int] | None = None) -> bool:
        """Drop every cached block not in use. False (and nothing dropped) if any block is used,
        except those `keep` holds (block id -> references: pinned prefixes), which stay."""
        keep = keep or {}
        if any(b.ref_cnt != keep.get(b.block_id, 0) for b in self.blocks if b.ref_cnt or b.block_id in keep):
            return False
        for block in self.blocks:
            if block.has_content and block.block_id not in keep:
                self._drop_content(block, quiet=not keep)  # else one AllBlocksCleared says it
        self.num_cached_free = 0
        if self.events is not None and not keep:
            self.events.add(AllBlocksCleared(MEDIUM_DEVICE))
        # Restore the plain id order so a reset pool behaves like a new one.
        self.free_queue.reset([b for b in self.blocks if b.block_id not in keep])
        return True

    def _drop_content(self, block: Block, quiet: bool = False) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None and not quiet:
                self.events.add(BlockRemoved([block.block_hash], MEDIUM_DEVICE))
        if block.parent_hash is not None:
            siblings = self.children.get(block.parent_hash)
            if siblings is not None:
                siblings.pop(block.block_id, None)
                if not siblings:
                    del self.children[block.parent_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = []
        block.priority = UNSET
        block.expires = math.inf


def retention_class(priority: int) -> str:
    """The metric label of a priority: below, at or above the default."""
    return "default" if priority == DEFAULT_PRIORITY else "low" if priority < DEFAULT_PRIORITY else "high"
