"""An aggregated picture of the KV pool for the dashboard: the block map in cells and the cached
prefixes as a radix tree. Computed only when asked (one pass over the blocks), never in a step;
the output is small whatever the pool size.

Tenants: a prefix tree hangs from its root hash, which folds in the tenant's cache salt. Only the
trees under the viewer's own root come back with token ids; the others are reported as counts.
"""
from __future__ import annotations

import time

from kvserve.kv.block_pool import Block, BlockPool

FREE, CACHED, USED, SHARED, PINNED = range(5)  # a cell's counts, in this order
STATES = 5
MAX_CELLS = 16384
TEXT_TOKENS = 48  # token ids sent per tree node (the page shows their text, shortened)


def block_map(pool: BlockPool, cells: int, pinned: dict[int, int] | None = None) -> dict:
    """Blocks aggregated into at most `cells` cells of consecutive block ids; per cell the count
    of free, cached (evictable), used (one user), shared (several users) and pinned blocks.
    `pinned`: the references pins hold, by block id (PinTable.owners()); a block held by a pin
    alone is pinned, one a request reads as well counts as that request's (used or shared)."""
    n = pool.num_blocks
    per = -(-n // max(1, min(cells, n, MAX_CELLS)))
    cells = -(-n // per)
    counts = [0] * (STATES * cells)
    pinned = pinned or {}
    for b in pool.blocks:
        r = b.ref_cnt - pinned.get(b.block_id, 0)
        if r:
            state = SHARED if r > 1 else USED
        elif b.ref_cnt:
            state = PINNED
        else:
            state = CACHED if b.parent_hash is not None else FREE
        counts[STATES * (b.block_id // per) + state] += 1
    return {"num_blocks": n, "blocks_per_cell": per, "cells": cells, "states": STATES, "counts": counts}


def prefix_tree(pool: BlockPool, own_roots: set[bytes], top: int = 8, max_depth: int = 6,
                max_nodes: int = 64) -> dict:
    """The cached prefixes as a radix tree: a node is a run of blocks with no branch inside it
    (tokens, blocks, hits of its first block, seconds since last use; 0 while in use), children
    sorted by the blocks under them, `top` at most at each level and `max_nodes` in all. Other
    tenants: counts only."""
    kids: dict[int, list[Block]] = {}
    roots: dict[bytes, list[Block]] = {}
    for b in pool.blocks:
        if b.parent_hash is None:
            continue
        parent = pool.cached.get(b.parent_hash)
        if parent is None or parent is b:
            roots.setdefault(b.parent_hash, []).append(b)
        else:
            kids.setdefault(parent.block_id, []).append(b)
    # Subtree sizes, hits and last use, bottom up without recursion (chains can be thousands deep).
    size: dict[int, int] = {}
    last: dict[int, float] = {}
    order = [b for top_blocks in roots.values() for b in top_blocks]
    i = 0
    while i < len(order):
        order.extend(kids.get(order[i].block_id, ()))
        i += 1
    now = time.monotonic()
    for b in reversed(order):
        used = now if b.ref_cnt else b.last_used
        s, t = 1, used
        for c in kids.get(b.block_id, ()):
            s += size[c.block_id]
            t = max(t, last[c.block_id])
        size[b.block_id], last[b.block_id] = s, t

    budget = [max_nodes]

    def node(b: Block, depth: int) -> dict:
        budget[0] -= 1
        run, tokens = [b], len(b.token_ids)
        while len(kids.get(run[-1].block_id, ())) == 1:
            run.append(kids[run[-1].block_id][0])
            tokens += len(run[-1].token_ids)
        ids = [t for blk in run for t in blk.token_ids[:TEXT_TOKENS]][:TEXT_TOKENS]
        children = sorted(kids.get(run[-1].block_id, ()), key=lambda c: -size[c.block_id])
        out = {"tokens": tokens, "blocks": len(run), "subtree_blocks": size[b.block_id], "hits": b.hits,
               "idle_s": round(now - last[b.block_id], 1), "in_use": any(x.ref_cnt for x in run),
               "token_ids": ids, "more_children": max(0, len(children) - top), "children": []}
        for c in children[:top] if depth < max_depth else ():
            if budget[0] <= 0:
                break
            out["children"].append(node(c, depth + 1))
        out["more_children"] = len(children) - len(out["children"])
        return out

    own = sorted((b for h, bs in roots.items() if h in own_roots for b in bs), key=lambda b: -size[b.block_id])
    others = [b for h, bs in roots.items() if h not in own_roots for b in bs]
    prefixes = [node(b, 0) for b in own[:top]]
    return {"prefixes": prefixes, "more_prefixes": len(own) - len(prefixes),
            "own_blocks": sum(size[b.block_id] for b in own),
            "others": {"tenants": sum(1 for h in roots if h not in own_roots), "prefixes": len(others),
                       "blocks": sum(size[b.block_id] for b in others), "hits": sum(b.hits for b in others)}}


def request_rows(kv, running: list, waiting: list, own_salt: str | None, limit: int) -> dict:
    """Running then waiting requests: prompt, output and cached tokens, blocks held, state. Another
    tenant's request shows its figures but not its id."""
    rows = []
    for state, reqs in (("running", running), ("waiting", waiting)):
        for req in reqs:
            if len(rows) >= limit:
                break
            own = req.cache_salt == own_salt
            rows.append({"id": req.request_id if own else None, "state": state if not req.num_preemptions
                         or state == "running" else "preempted", "prompt_tokens": req.num_prompt_tokens,
                         "output_tokens": req.num_output_tokens, "cached_tokens": max(0, req.num_cached_tokens),
                         "blocks": len(kv.req_blocks.get(req.request_id, ())), "preemptions": req.num_preemptions})
    return {"rows": rows, "running": len(running), "waiting": len(waiting)}


def kv_snapshot(kv, running: list, waiting: list, cells: int, top: int, own_salt: str | None,
                max_requests: int) -> dict:
    """Everything the dashboard asks the engine core for, in one call between two steps."""
    from kvserve.kv.hashing import root_hash
    own_roots = {root_hash(kv.kv_cache_dtype, own_salt, None)}
    t0 = time.perf_counter()
    out = {"block_map": block_map(kv.pool, cells, kv.pins.owners()), "block_size": kv.block_size,
           "prefix_tree": prefix_tree(kv.pool, own_roots, top) if kv.enable_caching else None,
           "requests": request_rows(kv, running, waiting, own_salt, max_requests)}
    out["snapshot_ms"] = round((time.perf_counter() - t0) * 1000, 3)
    return out
