"""TierChain: the offload tiers as the KV cache manager sees them, in lookup order.

host -> blocks still queued for the writer -> disk -> Redis. The manager asks for the longest
run of a request's next chain hashes that some tier holds (`fetch`); the runner-side transfer
(kvserve.cache.offload) puts evicted blocks into the tiers. Torch-free: payloads pass
through `decode`, a callable the transfer installs, which unpacks and checks a block against
the engine's KV layout when the lookup hits, so a block that would not fit is a miss before the
scheduler counts its tokens as computed, never an error in the middle of a step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from kvserve.kv.tiers.base import KVTier, TierUsage, frame_size

logger = logging.getLogger(__name__)

USAGE_REFRESH_SECONDS = 1.0  # Redis usage costs two round trips: do not ask every step


class Fetched(NamedTuple):
    tier: str  # 'host' | 'disk' | 'redis' (writer-queue hits count for the tier they are bound for)
    data: object  # what the runner writes into the block (the decoded payload's tensors)
    key: bytes  # the block hash it was found under
    stored: bool = False  # read from a lower tier's own storage (not the host, not the writer's queue)


@dataclass
class ChainStats:
    restored_blocks: dict[str, int] = field(default_factory=dict)  # blocks handed to requests, by tier
    lookup_seconds: float = 0.0  # tier reads + decode, on the scheduling path
    restore_seconds: float = 0.0  # runner writes of restored blocks into the pool
    offloaded_blocks: int = 0  # evicted blocks copied down (host put and/or queued for the writer)
    offload_skipped: int = 0  # evicted blocks already held by every tier
    # Evicted blocks not written down: below --kv-offload-min-priority, or past their TTL.
    offload_below_priority: int = 0
    offload_seconds: float = 0.0  # engine-thread time reading + packing + host puts
    decode_failures: int = 0  # payloads that passed the frame check but do not fit this KV layout
    # Entries found under a block's hash that hold other tokens (a collision), by tier.
    token_mismatches: dict[str, int] = field(default_factory=dict)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_fallbacks: int = 0  # preemptions that recomputed because the host tier had no room


class TierChain:
    def __init__(self, host: KVTier | None = None, lower: Sequence[KVTier] = (),
                 writer: object | None = None) -> None:
        self.host = host
        self.lower = list(lower)  # written through `writer` (AsyncWriter), read in this order
        self.writer = writer
        if writer is not None:  # entries a tier loses count as never stored (drained on the engine thread)
            for tier in self.lower:
                tier.on_lost = writer.failed.extend
        # payload -> (the block's token ids, what the runner writes): set by the offloader.
        self.decode: Callable[[memoryview], tuple[tuple[int, ...], object]] = lambda payload: ((), payload)
        self.entry_bytes = 0  # packed size of one block (set by the transfer); 0: unknown
        # Extra bytes of a block that is still open (a quantized cache's full-precision residual
        # rows travel with it); a swapped-out request has at most one open block.
        self.open_extra_bytes = 0
        self.stats = ChainStats()
        # Told the keys a lookup found in no tier (lost below: deleted, evicted, Redis flushed),
        # so that the transfer writes such a block down again on its next eviction.
        self.on_missing: Callable[[list[bytes]], None] | None = None
        self._held_reserved = 0  # host bytes promised to swap-outs not yet written
        self._usage: dict[str, TierUsage] = {}
        self._usage_at = float("-inf")

    @property
    def tiers(self) -> list[KVTier]:
        return ([self.host] if self.host is not None else []) + self.lower

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # -- lookups (scheduler thread) -------------------------------------------------------------
    def fetch(self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]],
              host_only: bool = False) -> list[Fetched]:
        """The longest leading run of `keys` found in some tier, decoded, each entry holding the
        block's expected `tokens` (one list per key). Each tier is asked only for the keys the
        tiers above it missed, in one batched call. An entry with other tokens under the key (a
        hash collision) is a miss in that tier, counted, and never restored."""
        if not keys:
            return []
        start = time.perf_counter()
        found: list[Fetched | None] = [None] * len(keys)
        # (name, batched read, the tier an undecodable entry is deleted from: none for the queue)
        sources: list[tuple[str, Callable[[list[bytes]], list], KVTier | None]] = []
        if self.host is not None:
            sources.append(("host", self.host.get_many, self.host))
        if not host_only:
            if self.writer is not None and self.lower:
                sources.append((self.lower[0].name, lambda ks: [self.writer.pending(k) for k in ks], None))
            sources.extend((t.name, t.get_many, t) for t in self.lower)
        for name, get_many, tier in sources:
            idx = [i for i, f in enumerate(found) if f is None]
            if not idx:
                break
            payloads = get_many([keys[i] for i in idx])
            for i, payload in zip(idx, payloads):
                if payload is None:
                    continue
                try:
                    stored_tokens, data = self.decode(memoryview(payload))
                except Exception as exc:  # wrong layout: recompute it, never serve it
                    self.stats.decode_failures += 1
                    if self.stats.decode_failures == 1 or self.stats.decode_failures % 1000 == 0:
                        logger.warning("%s tier: block %s does not fit this engine's KV layout (%s); "
                                       "recomputing it and deleting the entry (%d such blocks so far)",
                                       name, keys[i].hex()[:16], exc, self.stats.decode_failures)
                    if tier is not None:
                        tier.delete(keys[i])  # read once, not on every lookup
                    continue
                if list(stored_tokens) != list(tokens[i]):
                    n = self.stats.token_mismatches[name] = self.stats.token_mismatches.get(name, 0) + 1
                    if n == 1 or n % 1000 == 0:
                        logger.warning("%s tier: the entry under block hash %s holds other tokens (a hash "
                                       "collision); recomputing the block (%d such entries so far)",
                                       name, keys[i].hex()[:16], n)
                    continue
                found[i] = Fetched(name, data, keys[i], tier is not None and tier is not self.host)
        if not host_only and self.lower and self.on_missing is not None:
            self.on_missing([keys[i] for i, f in enumerate(found) if f is None])
        run = []
        for f in found:
            if f is None:
                break
            run.append(f)
        self.stats.lookup_seconds += time.perf_counter() - start
        return run

    def count_restored(self, fetched: Sequence[Fetched]) -> None:
        for f in fetched:
            self.stats.restored_blocks[f.tier] = self.stats.restored_blocks.get(f.tier, 0) + 1

    # -- swap reservations ----------------------------------------------------------------------
    def reserve_held(self, keys: Sequence[bytes]) -> bool:
        """Promise host room for a swapped-out request's blocks (written by the runner at the start
        of the next step); False when the host tier cannot hold them without evicting held data."""
        host = self.host
        if host is None or not keys or self.entry_bytes <= 0:
            return False
        need = sum(frame_size(k, self.entry_bytes) for k in keys) + self.open_extra_bytes
        held = getattr(host, "held_bytes", 0)
        if held + self._held_reserved + need > host.usage().capacity_bytes:
            self.stats.swap_fallbacks += 1
            return False
        self._held_reserved += need
        self.stats.swapped_out_blocks += len(keys)
        return True

    def settle_held(self) -> None:
        """The runner wrote this step's swap-outs: their bytes now show in host.held_bytes."""
        self._held_reserved = 0

    def discard(self, keys: Sequence[bytes]) -> None:
        if self.host is not None:
            for k in keys:
                self.host.delete(k)

    # -- observability --------------------------------------------------------------------------
    def usage(self) -> dict[str, TierUsage]:
        now = time.monotonic()
        if now - self._usage_at >= USAGE_REFRESH_SECONDS:
            self._usage = {t.name: t.usage() for t in self.tiers}
            self._usage_at = now
        return self._usage

    def flush(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout) if self.writer is not None else True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(drain=True)
        for t in self.tiers:
            t.close()
