"""The KV cache manager's block accounting, checked from scratch: every reference has an owner (a
request's block table or a pin), the free queue holds exactly the unreferenced blocks in eviction
order, and the prefix index agrees with the blocks. It walks every block, so it runs only where asked,
after every step: tests, `kvserve simulate`, an engine built with `check_integrity`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.kv.manager import KVCacheManager


def check_integrity(kv: "KVCacheManager") -> None:
    """Raise AssertionError naming the first inconsistency in kv's block accounting."""
    pool = kv.pool
    owners: dict[int, int] = {}
    for rid, blocks in kv.req_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"request {rid} holds a block twice: {ids}"
        known = kv._block_ids.get(rid, [])
        assert ids[:len(known)] == known, f"request {rid}: block ids {known} noted, holds {ids}"
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for bid, n in kv.pins.owners().items():
        owners[bid] = owners.get(bid, 0) + n
        assert pool.blocks[bid].block_hash is not None, f"pinned block {bid} holds no full cached block"
    stale = set(kv._block_ids) - set(kv.req_blocks)
    assert not stale, f"block ids kept for requests holding no blocks: {sorted(stale)}"
    num_cached = 0
    for b in pool.blocks:
        assert b.ref_cnt >= 0, f"block {b.block_id} has negative ref_cnt {b.ref_cnt}"
        assert b.ref_cnt == owners.get(b.block_id, 0), (
            f"block {b.block_id}: ref_cnt {b.ref_cnt} but {owners.get(b.block_id, 0)} owners")
        in_queue = b.block_id in pool.free_queue
        assert in_queue == (b.ref_cnt == 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, in free queue {in_queue}"
        if b.ref_cnt > 1:
            assert b.block_hash is not None, f"block {b.block_id} shared by {b.ref_cnt} but not an immutable full block"
        if b.ref_cnt == 0 and b.has_content:
            num_cached += 1
        if b.block_hash is not None:
            assert pool.cached.get(b.block_hash) is b, f"block {b.block_id} hash not indexed"
            assert len(b.token_ids) == kv.block_size
        if b.has_content:
            assert pool.children.get(b.parent_hash, {}).get(b.block_id) is b
    assert num_cached == pool.num_cached_free, f"cached count {pool.num_cached_free} != {num_cached}"
    for h, b in pool.cached.items():
        assert b.block_hash == h
    used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    filled = sum(b.num_filled for b in pool.blocks if b.ref_cnt > 0)
    assert pool.num_filled_used == filled, f"filled slots counted {pool.num_filled_used}, held {filled}"
    if pool.retained:
        order = pool.free_queue.ordered()
        assert len(order) == pool.num_free_blocks, "eviction order lists every free block once"
        now = pool.clock()
        keys = [(-2, 0.0) if not b.has_content else (-1 if b.expires <= now else b.priority, b.last_used)
                for b in order]
        assert keys == sorted(keys), f"eviction order not by (expired, priority, last use): {keys}"
    free = pool.num_free_blocks - num_cached
    assert free + used + num_cached == pool.num_blocks, (free, used, num_cached, pool.num_blocks)
