"""KVCacheManager: block tables, prefix-cache lookups and allocation for requests.

Works on token ids and block ids only; the model runner owns the tensors. Protocol per request:
  hit = get_computed_blocks(req)          # on admission: longest cached prefix (may be empty)
  allocate_slots(req, n, hit) -> bool     # reserve blocks for n more tokens (False: no room)
  ... model runner writes the K/V ...
  commit(req)                             # after the step: record tokens, cache full blocks
  free(req)                               # finished, aborted or preempted
A prefix hit is full cached blocks (shared by reference) plus, optionally, the first tokens of one
more block copied into a fresh block of the request's own (copy-on-write), so a prefix that ends
mid-block loses nothing.

With offload tiers (`tiers`, a kvserve.kv.tiers.chain.TierChain), the lookup continues below the
device pool: the next full blocks found in host / disk / Redis are restored into fresh blocks
(`BlockRestore`s the runner applies before the forward) and become ordinary cached blocks when
the step commits. Evicted full blocks are handed down (`BlockOffload`s). Swap preemption stores a
victim's blocks, its last partial one included, as held host entries and restores them on resume.
Payloads stay opaque here: no tensors.

Releasing blocks while a sequence runs (kv/release.py): under a model's sliding window, or a
request's KV compression, blocks no future token attends to leave the block table as the
sequence advances. The table then holds only the blocks kept, and `released_tokens(req)` says how
many positions are missing from it (the runner offsets the new tokens' rotary positions by that
much; they are always after every released block). Released blocks stay in the prefix cache when
they are exact. A compressed sequence's KV stops being exact at its first release: what it
computes after that is never published to the prefix cache, so no other request can hit it.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

from kvserve.core.cache_retention import DEFAULT as DEFAULT_RETENTION
from kvserve.core.cache_retention import DEFAULT_PRIORITY
from kvserve.core.kv_compression import KVCompression
from kvserve.core.request import Request
from kvserve.core.step import BlockCopy, BlockOffload, BlockRestore
from kvserve.kv.block_pool import UNSET, Block, BlockPool
from kvserve.kv.events import KVEventSink
from kvserve.kv.hashing import extend_block_hashes, root_hash
from kvserve.kv.integrity import check_integrity
from kvserve.kv.pins import Pin, PinTable
from kvserve.kv.release import SLIDING_WINDOW, blocks_to_release, release_reason

if TYPE_CHECKING:
    from kvserve.kv.tiers.chain import TierChain

# Tier lookups read disk / Redis: remember the last few per waiting request across attempts.
_TIER_MEMO_SIZE = 16


class PrefixHit(NamedTuple):
    blocks: list[Block]  # full cached blocks, in order
    num_tokens: int  # tokens served: len(blocks) * block_size + partial_tokens
    partial_src: Block | None = None  # block whose first `partial_tokens` slots are copied
    partial_tokens: int = 0
    # Blocks fetched from offload tiers, restored after `blocks` (full blocks, except that a swap
    # resume may end with a partial one holding `restored_partial` tokens).
    restored: tuple = ()  # tuple[Fetched, ...]
    restored_partial: int = 0
    # Sliding window: the leading blocks of the prefix its first new token cannot see, not held
    # (`blocks` starts after them); their tokens still count in num_tokens.
    num_skipped: int = 0


class SwapRecord(NamedTuple):
    keys: tuple[bytes, ...]  # host-tier keys of the request's blocks, in order
    num_tokens: int  # tokens whose K/V they hold


EMPTY_HIT = PrefixHit([], 0)


@dataclass
class PrefixCacheStats:
    """Token counters, cumulative; new requests and preemption resumes apart."""
    queries: int = 0
    hits: int = 0
    resume_queries: int = 0
    resume_hits: int = 0
    partial_hit_tokens: int = 0  # part of `hits`/`resume_hits` served by copy-on-write
    tier_hits: dict[str, int] = field(default_factory=dict)  # part of both restored from a tier


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 kv_cache_dtype: str = "auto",
                 on_evict: Callable[[Block], None] | None = None,
                 tiers: "TierChain | None" = None, events: KVEventSink | None = None,
                 sliding_window: int | None = None, eviction_policy: str = "lru",
                 clock: Callable[[], float] | None = None, offload_min_priority: int = 0) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.kv_cache_dtype = kv_cache_dtype
        self.tiers = tiers
        self.offload_min_priority = offload_min_priority
        self._user_on_evict = on_evict
        offload = tiers is not None and enable_caching and bool(tiers.tiers)
        self.pool = BlockPool(num_blocks, block_size, on_evict=self._on_evict if offload else on_evict,
                              events=events if enable_caching else None, eviction_policy=eviction_policy,
                              **({"clock": clock} if clock is not None else {}))
        self.req_blocks: dict[str, list[Block]] = {}
        # Each request's block ids, extended as its blocks are (a request's blocks are only ever
        # appended, and dropped all at once): block_table() copies a list of ints instead of
        # reading every Block object every step.
        self._block_ids: dict[str, list[int]] = {}
        self._roots: dict[str, bytes] = {}
        self._committed: dict[str, int] = {}  # tokens recorded into blocks, per request
        # Per request with blocks restored from a tier: the block index after them (what commit()
        # registers before it is the cache read back, not a write).
        self._restored_upto: dict[str, int] = {}
        self._copies: list[BlockCopy] = []
        self._offloads: list[BlockOffload] = []
        self._restores: list[BlockRestore] = []
        self._pinned: list[Block] = []  # copy sources held until the step's copies have run
        self._swapped: dict[str, SwapRecord] = {}
        self._tier_memo: OrderedDict[str, tuple[tuple[bytes, ...], tuple]] = OrderedDict()
        self.stats = PrefixCacheStats()
        # Released blocks (see the module docstring): per request, the logical index of each
        # held block while it holds fewer than it has written, how many it released, whether
        # its KV is still exact (compression), and h2o's accumulated attention per held block.
        self._logical: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}
        self._inexact: set[str] = set()
        self._scores: dict[str, list[float]] = {}
        self.num_released: dict[str, int] = {}  # blocks released, by policy (metrics)
        self.pins = PinTable(self.pool)  # prefixes held resident (kv/pins.py)

    # -- lookup -------------------------------------------------------------------------------
    def _root(self, req: Request) -> bytes:
        root = self._roots.get(req.request_id)
        if root is None:
            root = root_hash(self.kv_cache_dtype, req.cache_salt, req.lora_id)
            self._roots[req.request_id] = root
        return root

    def get_computed_blocks(self, req: Request, use_tiers: bool = True) -> PrefixHit:
        """Longest cached prefix of `req`, leaving at least its last token to compute.
        use_tiers=False looks at the device pool only (cheap: for ranking, not admission)."""
        if self.req_blocks.get(req.request_id):
            return EMPTY_HIT
        swapped = self._swapped.get(req.request_id)
        if not self.enable_caching or req.skip_prefix_cache:
            return self._swap_hit(req, swapped, [], 0) if swapped and use_tiers else EMPTY_HIT
        bs = self.block_size
        tokens = req.all_token_ids
        max_hit = req.num_tokens - 1  # the last token is always computed: its logits are needed
        root = self._root(req)
        hashes = extend_block_hashes(req.block_hashes, root, tokens, bs)
        if self.sliding_window and swapped is None:
            blocks, skipped = self._window_hit(tokens, hashes, max_hit // bs)
        else:
            blocks, skipped = self._plain_hit(tokens, hashes, max_hit // bs), 0
        if use_tiers and swapped is not None and swapped.num_tokens > len(blocks) * bs:
            return self._swap_hit(req, swapped, blocks, len(blocks))
        restored: tuple = ()
        if use_tiers and self.tiers is not None and skipped + len(blocks) < max_hit // bs:
            first, stop = skipped + len(blocks), max_hit // bs
            restored = self._fetch(req, tuple(hashes[first:stop]), self._by_block(tokens, first, stop))
        matched = (skipped + len(blocks) + len(restored)) * bs
        want = tokens[matched:min(matched + bs, max_hit)]
        best, best_len = None, 0
        if want:
            n_full = skipped + len(blocks) + len(restored)
            parent = hashes[n_full - 1] if n_full else root
            # A quantized cache's partial block has no fixed stored form: exact residual rows
            # while open, padded codes once other requests' writes evict it from the residual
            # pool. Copying from one would make this prompt's numbers depend on what else ran;
            # full blocks are quantized once, from all their tokens, so copy only from those.
            whole_only = self.kv_cache_dtype != "auto"
            for cand in self.pool.candidates(parent):
                if whole_only and len(cand.token_ids) < bs:
                    continue
                n = _common_prefix_len(cand.token_ids, want)
                if n > best_len:
                    best, best_len = cand, n
        return PrefixHit(blocks, matched + best_len, best, best_len, restored, num_skipped=skipped)

    def _cached(self, tokens: list[int], hashes: list[bytes], i: int) -> Block | None:
        block = self.pool.lookup(hashes[i])
        # Token check: SHA-256 makes a mismatch impossible in practice; this makes it impossible.
        if block is None or block.token_ids != tokens[i * self.block_size:(i + 1) * self.block_size]:
            return None
        return block

    def _plain_hit(self, tokens: list[int], hashes: list[bytes], n: int) -> list[Block]:
        blocks: list[Block] = []
        for i in range(n):
            block = self._cached(tokens, hashes, i)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _window_hit(self, tokens: list[int], hashes: list[bytes], n: int) -> tuple[list[Block], int]:
        """Under a sliding window a prefix of L blocks only needs the blocks its next token sees
        (vLLM's sliding-window prefix caching): the longest L whose window blocks are all cached,
        even where blocks before them were evicted. Returns those blocks and how many before
        them are skipped."""
        found = [self._cached(tokens, hashes, i) for i in range(n)]
        run = 0
        best = (0, 0)
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            length = i + 1
            need = min(self._first_seen_block(length * self.block_size), length - 1)  # hold one at least
            if run >= length - need:
                best = (length, need)
        length, need = best
        return found[need:length], need

    def _first_seen_block(self, pos: int) -> int:
        """The first block a query at `pos` reads under the sliding window."""
        return max(0, pos - self.sliding_window + 1) // self.block_size

    def _by_block(self, tokens: list[int], first: int, stop: int) -> list[list[int]]:
        """Blocks first .. stop-1 of `tokens` (the last may be partial): what tier entries must hold."""
        bs = self.block_size
        return [tokens[i * bs:(i + 1) * bs] for i in range(first, stop)]

    def _fetch(self, req: Request, keys: tuple[bytes, ...], tokens: list[list[int]],
               host_only: bool = False) -> tuple:
        memo = self._tier_memo.get(req.request_id)
        if memo is not None and memo[0] == keys:
            return memo[1]
        fetched = tuple(self.tiers.fetch(keys, tokens, host_only=host_only))
        self._tier_memo[req.request_id] = (keys, fetched)
        self._tier_memo.move_to_end(req.request_id)
        while len(self._tier_memo) > _TIER_MEMO_SIZE:
            self._tier_memo.popitem(last=False)
        return fetched

    def _swap_hit(self, req: Request, swapped: SwapRecord, blocks: list[Block], start: int) -> PrefixHit:
        """Resume of a swapped-out request: device blocks as found, the rest from its held entries."""
        tokens = self._by_block(req.all_token_ids[:swapped.num_tokens], start, len(swapped.keys))
        fetched = self._fetch(req, swapped.keys[start:], tokens, host_only=True)
        bs = self.block_size
        complete = start + len(fetched) == len(swapped.keys)
        tail = swapped.num_tokens % bs if complete else 0
        num_tokens = (start + len(fetched)) * bs - ((bs - tail) if tail else 0)
        return PrefixHit(blocks, num_tokens, restored=fetched, restored_partial=tail)

    # -- allocation -----------------------------------------------------------------------------
    def num_blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit = EMPTY_HIT) -> int:
        """Blocks that must leave the free queue to admit `num_new_tokens` more tokens."""
        held = self.req_blocks.get(req.request_id, ())
        computed = hit.num_tokens if not held else req.num_computed_tokens
        gone = self._released.get(req.request_id, 0) if held else hit.num_skipped
        total = -(-(computed + num_new_tokens) // self.block_size) - gone
        reused_free = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        if not held and self._pins_copy_source(hit):
            reused_free += 1
        return max(0, total - len(held) - len(hit.blocks)) + reused_free

    def _pins_copy_source(self, hit: PrefixHit) -> bool:
        # Restores write before the step's copies run, so with tiers a free copy source is taken
        # out of the free queue until then: it must not be handed out as a restore target.
        return self.tiers is not None and hit.partial_src is not None and hit.partial_src.ref_cnt == 0

    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit = EMPTY_HIT) -> bool:
        return self.num_blocks_needed(req, num_new_tokens, hit) <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit = EMPTY_HIT) -> bool:
        """Reserve room for `num_new_tokens` tokens after the computed ones. On a new request
        `hit` (from get_computed_blocks) is taken. Returns False, changing nothing, if the pool
        has no room."""
        if not self.can_allocate(req, num_new_tokens, hit):
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        swapped = self._swapped.pop(req.request_id, None) if not blocks else None
        if swapped is not None:
            self.tiers.discard(swapped.keys)  # restored now, or recomputed: either way done with
            self.tiers.stats.swapped_in_blocks += len(hit.restored)
        if not blocks:
            self._tier_memo.pop(req.request_id, None)
            req.num_released_tokens = hit.num_skipped * self.block_size
        if not blocks and (hit.blocks or hit.partial_src is not None or hit.restored):
            for b in hit.blocks:
                self.pool.touch(b)
            blocks.extend(hit.blocks)
            self._committed[req.request_id] = (hit.num_skipped + len(hit.blocks)) * self.block_size
            if hit.num_skipped:
                self._released[req.request_id] = hit.num_skipped
            if self._pins_copy_source(hit):
                self.pool.touch(hit.partial_src)
                self._pinned.append(hit.partial_src)
            for f in hit.restored:
                # Registered in the prefix cache by commit() after the step, like computed blocks.
                dst = self.pool.allocate()
                self._restores.append(BlockRestore(dst.block_id, f.data, f.tier, f.key if f.stored else None))
                blocks.append(dst)
            if hit.restored:
                self.tiers.count_restored(hit.restored)
                self._restored_upto[req.request_id] = hit.num_skipped + len(hit.blocks) + len(hit.restored)
            if hit.partial_src is not None:
                # The copy runs before this step's forward; the source cannot be overwritten before
                # then even if it is evicted below, since K/V is only written during the forward.
                dst = self.pool.allocate()
                self._copies.append(BlockCopy(hit.partial_src.block_id, dst.block_id, hit.partial_tokens))
                blocks.append(dst)
            computed = hit.num_tokens
            self._count_hit(req, hit)
        else:
            if not blocks:
                self._count_hit(req, EMPTY_HIT)
            computed = req.num_computed_tokens
        total = -(-(computed + num_new_tokens) // self.block_size) - self._released.get(req.request_id, 0)
        while len(blocks) < total:
            blocks.append(self.pool.allocate())
        return True

    def _count_hit(self, req: Request, hit: PrefixHit) -> None:
        if not self.enable_caching:
            return
        s = self.stats
        if req.num_preemptions > 0:
            s.resume_queries += req.num_tokens
            s.resume_hits += hit.num_tokens
        else:
            s.queries += req.num_tokens
            s.hits += hit.num_tokens
        s.partial_hit_tokens += hit.partial_tokens
        bs = self.block_size
        for i, f in enumerate(hit.restored):
            n = hit.restored_partial if i == len(hit.restored) - 1 and hit.restored_partial else bs
            s.tier_hits[f.tier] = s.tier_hits.get(f.tier, 0) + n

    def take_copies(self) -> list[BlockCopy]:
        copies, self._copies = self._copies, []
        return copies

    def take_transfers(self) -> tuple[list[BlockOffload], list[BlockRestore]]:
        """End of scheduling: this step's tier reads and writes; copy sources are unpinned (the
        runner copies before anything can write into them again)."""
        if self._pinned:
            self.pool.free(self._pinned, None)  # the request that copies them frees its own
            self._pinned = []
        offloads, self._offloads = self._offloads, []
        restores, self._restores = self._restores, []
        return offloads, restores

    def cached_blocks(self) -> list[BlockOffload]:
        """Every full block the pool holds under a chain hash, in use or cached-free: what an
        engine shutting down hands to the lower tiers (write-back only happens on eviction); as
        on eviction, not those below --kv-offload-min-priority or past their TTL."""
        return [o for b in self.pool.blocks if b.block_hash is not None and (o := self._retained_offload(b)) is not None]

    def prompt_blocks(self, req: Request) -> list[BlockOffload]:
        """The full blocks of `req`'s prompt the pool still holds under their chain hashes, in order
        up to the first one it does not: what a prefill server hands to the transfer layer."""
        bs = self.block_size
        root = self._roots.get(req.request_id) or root_hash(self.kv_cache_dtype, req.cache_salt, req.lora_id)
        hashes = extend_block_hashes(list(req.block_hashes), root, req.prompt_token_ids, bs)
        out = []
        for i in range(len(req.prompt_token_ids) // bs):
            block = self._cached(req.prompt_token_ids, hashes, i)
            if block is None:
                break
            out.append(BlockOffload(block.block_id, block.block_hash, tuple(block.token_ids)))
        return out

    def pin(self, pin_id: str, req: Request) -> Pin:
        """Pin the full blocks of `req`'s prompt the pool holds (all of them right after its
        prefill: nothing is allocated between a step's frees and this call)."""
        blocks = [self.pool.blocks[b.block_id] for b in self.prompt_blocks(req)]
        return self.pins.pin(pin_id, req.cache_salt, blocks)

    def tier_keys(self, req: Request) -> tuple[tuple[bytes, ...], list[list[int]]]:
        """The keys (and tokens) a tier lookup for `req` would read now: its full blocks after those
        the pool holds, as get_computed_blocks asks; empty where it would ask none (sliding window,
        no caching). For reading them ahead, off the step (`preload`)."""
        if not self.enable_caching or req.skip_prefix_cache or self.sliding_window or self.tiers is None:
            return (), []
        bs, tokens = self.block_size, req.all_token_ids
        hashes = extend_block_hashes(req.block_hashes, self._root(req), tokens, bs)
        first, stop = len(self._plain_hit(tokens, hashes, (req.num_tokens - 1) // bs)), (req.num_tokens - 1) // bs
        return tuple(hashes[first:stop]), self._by_block(tokens, first, stop)

    def preload(self, req: Request, keys: tuple[bytes, ...], fetched: tuple) -> None:
        """What a read ahead of `keys` found: the request's tier lookup takes it if it asks the same."""
        self._tier_memo[req.request_id] = (keys, fetched)
        self._tier_memo.move_to_end(req.request_id)
        while len(self._tier_memo) > _TIER_MEMO_SIZE:
            self._tier_memo.popitem(last=False)

    def _on_evict(self, block: Block) -> None:
        if block.block_hash is not None:  # only full blocks have a chain hash to be found by
            offload = self._retained_offload(block)
            if offload is not None:
                self._offloads.append(offload)
            else:
                self.tiers.stats.offload_below_priority += 1
        if self._user_on_evict is not None:
            self._user_on_evict(block)

    def _retained_offload(self, block: Block) -> BlockOffload | None:
        """What the tiers store of an evicted block; None when the block is below
        --kv-offload-min-priority or past its TTL: dropped, not written down."""
        offload = self._offload_of(block)
        if offload.expires <= time.time() or offload.priority < self.offload_min_priority:
            return None
        return offload

    def _offload_of(self, block: Block) -> BlockOffload:
        """A full block as the tiers store it, with its retention (the expiry turned into
        wall-clock time: it outlives this process on disk and is shared through Redis)."""
        priority = DEFAULT_PRIORITY if block.priority == UNSET else block.priority
        expires = math.inf if block.expires == math.inf else time.time() + (block.expires - self.pool.clock())
        return BlockOffload(block.block_id, block.block_hash, tuple(block.token_ids), priority=priority,
                            expires=expires)

    # -- swap preemption ------------------------------------------------------------------------
    def swap_out(self, req: Request) -> bool:
        """Before `free` on preemption: hand the request's written blocks to the host tier (held
        until it resumes). False, changing nothing, when there is no host tier or no room there:
        the caller falls back to recompute."""
        blocks = self.req_blocks.get(req.request_id)
        num_tokens = self._committed.get(req.request_id, 0)
        if not blocks or num_tokens <= 0 or self.tiers is None or self._released.get(req.request_id):
            return False  # a sequence missing released blocks resumes by recompute
        n = -(-num_tokens // self.block_size)
        tag = f"swap:{req.request_id}:{req.num_preemptions}:".encode()
        keys = tuple(tag + str(i).encode() for i in range(n))
        if not self.tiers.reserve_held(keys):
            return False
        tokens = self._by_block(req.all_token_ids[:num_tokens], 0, n)
        self._offloads.extend(BlockOffload(b.block_id, k, tuple(t), held=True) for b, k, t in zip(blocks, keys, tokens))
        self._swapped[req.request_id] = SwapRecord(keys, num_tokens)
        return True

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    # -- after a step ---------------------------------------------------------------------------
    def commit(self, req: Request) -> None:
        """Record the tokens whose K/V the last step wrote (req.num_computed_tokens is current)."""
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        bs = self.block_size
        start = self._committed.get(req.request_id, 0)
        end = req.num_computed_tokens
        if end <= start:
            return
        # Blocks from `start` on come after every released one: logical block i is held at i - gone.
        gone = self._released.get(req.request_id, 0)
        if not self.enable_caching or req.request_id in self._inexact:
            for i in range(start // bs, (end - 1) // bs + 1):
                self.pool.set_filled(blocks[i - gone], min(bs, end - i * bs))
        else:
            tokens = req.all_token_ids
            root = self._root(req)
            hashes = extend_block_hashes(req.block_hashes, root, tokens, bs, end)
            first_write = self._restored_upto.get(req.request_id, 0)
            prompt_blocks = req.num_prompt_tokens // bs
            for i in range(start // bs, (end - 1) // bs + 1):
                block = blocks[i - gone]
                lo, hi = i * bs, min((i + 1) * bs, end)
                self.pool.set_filled(block, hi - lo)
                if block.block_hash is not None:
                    continue  # a shared cached block: already complete
                self.pool.record_tokens(block, hashes[i - 1] if i else root, tokens[lo:hi])
                if hi - lo == bs and self.pool.cache_full_block(block, hashes[i], hashes[i - 1] if i else None) \
                        and first_write <= i < prompt_blocks:
                    req.num_cache_write_tokens += bs
        self._committed[req.request_id] = end
        self._release(req, end)

    def add_scores(self, req: Request, scores: list[float]) -> None:
        """Score-based compression (h2o, snapkv): attention the last step paid to each block of
        the table it ran with."""
        acc = self._scores.setdefault(req.request_id, [])
        if len(acc) < len(scores):
            acc.extend([0.0] * (len(scores) - len(acc)))
        for i, s in enumerate(scores):
            acc[i] += s

    def released_tokens(self, req: Request) -> int:
        """Positions before the sequence's newest blocks that its block table no longer holds."""
        return self._released.get(req.request_id, 0) * self.block_size

    def _release(self, req: Request, next_pos: int) -> None:
        compression: KVCompression | None = req.sampling_params.kv_compression
        reason = release_reason(compression, self.sliding_window)
        if reason is None:
            return
        rid = req.request_id
        blocks = self.req_blocks[rid]
        gone = self._released.get(rid, 0)
        logical = self._logical.get(rid)
        if logical is None:
            logical = list(range(gone, gone + len(blocks)))  # nothing released between them yet
        elif len(logical) < len(blocks):  # blocks allocated since the last release follow the last
            logical.extend(range(logical[-1] + 1, logical[-1] + 1 + len(blocks) - len(logical)))
        drop = blocks_to_release(reason, logical, next_pos, self.block_size, compression,
                                 self.sliding_window, self._scores.get(rid, ()), req.num_prompt_tokens)
        if not drop:
            return
        if reason != SLIDING_WINDOW:
            self._inexact.add(rid)  # what it computes from now on attends to a cut context
        drop_set = set(drop)
        self.pool.free(reversed([blocks[i] for i in drop]), req.sampling_params.cache_retention or DEFAULT_RETENTION)
        self.req_blocks[rid] = [b for i, b in enumerate(blocks) if i not in drop_set]
        self._block_ids[rid] = [b.block_id for b in self.req_blocks[rid]]
        self._logical[rid] = [j for i, j in enumerate(logical) if i not in drop_set]
        scores = self._scores.get(rid)
        if scores is not None:
            self._scores[rid] = [s for i, s in enumerate(scores) if i not in drop_set]
        self._released[rid] = gone + len(drop)
        req.num_released_tokens = (gone + len(drop)) * self.block_size
        self.num_released[reason] = self.num_released.get(reason, 0) + len(drop)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        self._block_ids.pop(req.request_id, None)
        self._committed.pop(req.request_id, None)
        self._restored_upto.pop(req.request_id, None)
        self._tier_memo.pop(req.request_id, None)
        self._logical.pop(req.request_id, None)
        self._released.pop(req.request_id, None)
        self._inexact.discard(req.request_id)
        self._scores.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks), req.sampling_params.cache_retention or DEFAULT_RETENTION)

    def forget(self, req: Request) -> None:
        """The request has left the engine for good."""
        self.free(req)
        self._roots.pop(req.request_id, None)
        swapped = self._swapped.pop(req.request_id, None)
        if swapped is not None:
            self.tiers.discard(swapped.keys)

    def block_table(self, req: Request) -> list[int]:
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return []
        ids = self._block_ids.setdefault(req.request_id, [])
        if len(ids) < len(blocks):
            ids.extend(b.block_id for b in blocks[len(ids):])
        return list(ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no request uses; pinned blocks stay (unpin them first)."""
        return self.pool.reset_prefix_cache(keep=self.pins.owners())

    # -- observability --------------------------------------------------------------------------
    def usage(self) -> "KVUsage":
        pool = self.pool
        used = pool.num_used_blocks
        filled = pool.num_filled_used
        return KVUsage(
            num_blocks=pool.num_blocks, num_used=used, num_cached=pool.num_cached_free,
            num_free=pool.num_free_blocks - pool.num_cached_free,
            token_occupancy=filled / (used * self.block_size) if used else 0.0,
            num_evictions=pool.num_evictions)

    def check_integrity(self) -> None:
        """Raise AssertionError if block accounting is inconsistent (tests call this every step)."""
        check_integrity(self)


class KVUsage(NamedTuple):
    num_blocks: int
    num_used: int  # ref > 0
    num_cached: int  # ref == 0 with reusable prefix-cache content
    num_free: int  # ref == 0, empty
    token_occupancy: float  # slots holding K/V / slots of used blocks
    num_evictions: int


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
