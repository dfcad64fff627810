"""The block pool's own cost per block: allocate + free, under the eviction policy given.

    python bench/block_pool.py [--policy lru|priority] [--rounds 5] [--blocks 4096]

Three loops over one pool, each timed per block handed out and given back (best of --rounds):
  empty      allocate 8 empty blocks, free them (no prefix content: caching off);
  evict      allocate 8 blocks, each evicting a cached one, give them content, free them;
  hit        take 8 cached blocks by prefix hit (touch), free them again.
With --policy priority, every free carries a retention (priority cycling 0..100, a TTL on half),
so the priority policy's bookkeeping runs on every block. Prints a table; writes
bench/results/block_pool_<policy>.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from kvserve.kv.block_pool import BlockPool  # noqa: E402

BATCH = 8


def make_pool(blocks: int, policy: str) -> BlockPool:
    if policy == "lru":
        return BlockPool(blocks, 16)
    return BlockPool(blocks, 16, eviction_policy=policy)


def retention(i: int, policy: str):
    if policy == "lru":
        return None
    from kvserve.core.cache_retention import CacheRetention
    return CacheRetention(priority=(i * 37) % 101, ttl_s=600.0 if i % 2 else None)


def loop_empty(pool: BlockPool, iters: int, policy: str) -> float:
    t0 = time.perf_counter()
    for i in range(iters):
        blocks = [pool.allocate() for _ in range(BATCH)]
        _free(pool, reversed(blocks), retention(i, policy))
    return time.perf_counter() - t0


def _free(pool: BlockPool, blocks, ret) -> None:
    if ret is None:
        pool.free(blocks)
    else:
        pool.free(blocks, ret)


def fill(pool: BlockPool, policy: str) -> None:
    """Every block cached, with content and a hash."""
    held = [pool.allocate() for _ in range(pool.num_blocks)]
    for b in held:
        h = hashlib.sha256(str(b.block_id).encode()).digest()
        pool.record_tokens(b, b"root", [b.block_id] * 16)
        pool.cache_full_block(b, h)
    for j in range(0, len(held), BATCH):
        _free(pool, reversed(held[j:j + BATCH]), retention(j, policy))


def loop_evict(pool: BlockPool, iters: int, policy: str) -> float:
    fill(pool, policy)
    hashes = [hashlib.sha256(b"x" + str(i).encode()).digest() for i in range(iters * BATCH)]
    t0 = time.perf_counter()
    k = 0
    for i in range(iters):
        blocks = [pool.allocate() for _ in range(BATCH)]
        for b in blocks:
            pool.record_tokens(b, b"root", [k] * 16)
            pool.cache_full_block(b, hashes[k])
            k += 1
        _free(pool, reversed(blocks), retention(i, policy))
    return time.perf_counter() - t0


def loop_hit(pool: BlockPool, iters: int, policy: str) -> float:
    fill(pool, policy)
    blocks = pool.blocks
    n = len(blocks)
    t0 = time.perf_counter()
    for i in range(iters):
        j = (i * BATCH * 7) % (n - BATCH)
        taken = blocks[j:j + BATCH]
        for b in taken:
            pool.touch(b)
        _free(pool, reversed(taken), retention(i, policy))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="lru", choices=["lru", "priority"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20_000)
    args = ap.parse_args()
    rows = {}
    for name, fn in (("empty", loop_empty), ("evict", loop_evict), ("hit", loop_hit)):
        best = min(fn(make_pool(args.blocks, args.policy), args.iters, args.policy) for _ in range(args.rounds))
        rows[name] = best / (args.iters * BATCH) * 1e9
    print(f"{'loop':<8} {'ns per block (allocate/touch + free)':>38}   policy={args.policy}")
    for name, ns in rows.items():
        print(f"{name:<8} {ns:>38.0f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"block_pool_{args.policy}.json"), "w") as f:
        json.dump({"policy": args.policy, "blocks": args.blocks, "iters": args.iters, "rounds": args.rounds,
                   "ns_per_block": rows, "machine": platform.processor() or platform.machine()}, f, indent=1)


if __name__ == "__main__":
    main()
