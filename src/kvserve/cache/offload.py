"""KVOffloader: the runner-side half of the offload tiers (the tensor work the manager cannot do).

Per step, before the runner's block copies and forward (`apply`):
  1. offloads: read the blocks the scheduler just evicted or swapped out (their ids may already
     be handed to another request this step, so this runs before anything writes), pack each,
     put it into the host tier now (a memcpy) and queue it for disk / Redis on the AsyncWriter
     thread, so the decode path never waits on a disk or a network;
  2. restores: write blocks fetched from the tiers into the pool.
It also owns `decode`, which the TierChain runs on every lookup hit: a payload that does not
unpack to exactly this cache's block layout is a miss (counted), so it can never reach the pool.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from kvserve.cache.codec import pack_block, packed_size, unpack_block
from kvserve.config import ConfigError, EngineArgs
from kvserve.core.step import BlockOffload, BlockRestore, SchedulerOutput
from kvserve.kv.tiers.base import EngineFingerprint
from kvserve.kv.tiers.chain import TierChain
from kvserve.kv.tiers.order import Retention

logger = logging.getLogger(__name__)

_WRITTEN_MEMORY = 1 << 17  # keys known to be below already; bounds a set of 32-byte hashes


class KVOffloader:
    def __init__(self, kv_cache: Any, chain: TierChain) -> None:
        self.kv_cache = kv_cache
        self.chain = chain
        try:
            probe = kv_cache.read_blocks(torch.tensor([0]))
        except NotImplementedError:
            raise ConfigError(f"the KV offload tiers (--swap-space, --kv-disk-path, --kv-redis-url, "
                              f"--preemption-mode swap) do not support this KV cache "
                              f"({type(kv_cache).__name__}); use --kv-cache-dtype auto or drop "
                              f"the tier flags") from None
        # A cache with open blocks (a quantized cache's KIVI residual) appends their open state
        # after the stored fields when some block read is open; it is packed only for those.
        self._open_layout = list(getattr(kv_cache, "open_block_layout", ()))
        layout = [(tuple(t.shape[1:]), t.dtype) for t in probe]
        if self._open_layout and layout[-len(self._open_layout):] == self._open_layout:
            probe, layout = probe[:-len(self._open_layout)], layout[:-len(self._open_layout)]
        self._layout = layout
        chain.decode = self.decode
        chain.on_missing = self._forget
        block = [_token_tensor(range(kv_cache.block_size))] + [t[0] for t in probe]
        chain.entry_bytes = packed_size(block)
        if self._open_layout:
            open_state = [torch.empty(shape, dtype=dtype) for shape, dtype in self._open_layout]
            chain.open_extra_bytes = packed_size(block + open_state) - chain.entry_bytes
        self._written: OrderedDict[bytes, None] = OrderedDict()

    def decode(self, payload: memoryview) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """A stored block -> (its token ids, the tensors the cache's write_blocks takes)."""
        token_ids, *tensors = unpack_block(payload)
        got = [(tuple(t.shape), t.dtype) for t in tensors]
        if got != self._layout and not (self._open_layout and got == self._layout + self._open_layout):
            raise ValueError(f"block layout {got} != this cache's {self._layout}")
        if token_ids.dtype != torch.int32 or token_ids.dim() != 1:
            raise ValueError(f"block token ids stored as {token_ids.dtype} {tuple(token_ids.shape)}")
        return tuple(token_ids.tolist()), tensors

    def _payload(self, data: list[torch.Tensor], j: int, token_ids) -> bytearray:
        return pack_block([_token_tensor(token_ids), *self._block_tensors(data, j)])

    def _block_tensors(self, data: list[torch.Tensor], j: int) -> list[torch.Tensor]:
        """Row j of read_blocks' output as stored: a sealed block without the open-state rows."""
        n = len(self._layout)
        if len(data) > n and bool(data[-1][j].any()):  # the open state's last tensor is its mask
            return [t[j] for t in data]
        return [t[j] for t in data[:n]]

    @torch.inference_mode()
    def apply(self, out: SchedulerOutput) -> None:
        if out.kv_offloads:
            self._offload(out.kv_offloads)
        if out.kv_restores:
            self._restore(out.kv_restores)

    def _forget(self, keys: list[bytes]) -> None:
        for key in keys:
            self._written.pop(key, None)

    def _forget_lost(self) -> None:
        """Keys a tier failed to store are not below (lookups that miss report theirs directly)."""
        failed = self.chain.writer.failed if self.chain.writer is not None else None
        while failed:
            self._written.pop(failed.popleft(), None)

    def _stored_below(self, key: bytes) -> bool:
        host = self.chain.host
        if host is not None and not host.contains(key):
            return False
        return not self.chain.lower or key in self._written

    def _offload(self, offloads: list[BlockOffload]) -> None:
        start = time.perf_counter()
        chain, host, writer = self.chain, self.chain.host, self.chain.writer
        self._forget_lost()
        todo = []
        for o in offloads:
            if o.held or not self._stored_below(o.key):
                todo.append(o)
            else:  # stored already: it may come down at a higher priority now
                for tier in chain.tiers:
                    tier.retain(o.key, Retention(o.priority, o.expires))
        chain.stats.offload_skipped += len(offloads) - len(todo)
        if todo:
            data = self.kv_cache.read_blocks(torch.tensor([o.block_id for o in todo]))
            for j, o in enumerate(todo):
                payload = self._payload(data, j, o.token_ids)
                if o.held:
                    host.put_held(o.key, payload)  # a failure here costs the resume a recompute
                    continue
                retention = Retention(o.priority, o.expires)
                if host is not None:
                    host.put(o.key, payload, o.token_ids, retention)
                if writer is not None and writer.submit(o.key, payload, o.token_ids, retention):
                    self._remember(o.key)
                chain.stats.offloaded_blocks += 1
        chain.settle_held()
        chain.stats.offload_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def persist(self, blocks: list[BlockOffload], timeout: float = 60.0) -> int:
        """At shutdown: write blocks still in the pool to the lower tiers (disk, Redis), which
        otherwise only see blocks on eviction, so a restarted engine finds the hottest prefixes
        too. Waits for the writer as its queue fills; gives up after `timeout` seconds. Returns
        the number of blocks handed down."""
        writer = self.chain.writer
        if writer is None:
            return 0
        self._forget_lost()
        todo = [b for b in blocks if b.key not in self._written]
        deadline, done = time.monotonic() + timeout, 0
        for start in range(0, len(todo), 64):  # bounded memory: 64 blocks read at a time
            part = todo[start:start + 64]
            data = self.kv_cache.read_blocks(torch.tensor([b.block_id for b in part]))
            for j, b in enumerate(part):
                payload = self._payload(data, j, b.token_ids)
                retention = Retention(b.priority, b.expires)
                while not writer.submit(b.key, payload, b.token_ids, retention):  # queue full: let it drain
                    left = deadline - time.monotonic()
                    if left <= 0 or not writer.flush(left):
                        logger.warning("shutdown: %d of %d cached blocks not written to the lower KV tiers "
                                       "(the writer did not keep up within %.0f s)", len(todo) - done, len(todo),
                                       timeout)
                        return done
                self._remember(b.key)
                done += 1
        return done

    def _restore(self, restores: list[BlockRestore]) -> None:
        start = time.perf_counter()
        # One write per stored form (sealed blocks; swapped-out open blocks with their residual).
        by_form: dict[int, list[BlockRestore]] = {}
        for r in restores:
            by_form.setdefault(len(r.data), []).append(r)
        for group in by_form.values():
            ids = torch.tensor([r.block_id for r in group])
            fields = [torch.stack([r.data[i] for r in group]) for i in range(len(group[0].data))]
            self.kv_cache.write_blocks(ids, fields)
        # A block read from the only lower tier's storage is stored below: the shutdown write-back
        # need not write it again (nor an eviction, when no host tier has to be filled first).
        # Not a hit in the writer's queue (its write may still fail), and with two lower tiers a
        # hit in one says nothing of the other.
        if len(self.chain.lower) == 1:
            for r in restores:
                if r.stored_key is not None:
                    self._remember(r.stored_key)
        self.chain.stats.restore_seconds += time.perf_counter() - start

    def _remember(self, key: bytes) -> None:
        self._written[key] = None
        self._written.move_to_end(key)
        if len(self._written) > _WRITTEN_MEMORY:
            self._written.popitem(last=False)


def _token_tensor(token_ids) -> torch.Tensor:
    return torch.tensor(list(token_ids), dtype=torch.int32)


def engine_fingerprint(args: EngineArgs, model_config: Any, weights: dict[str, torch.Tensor],
                       dtype: torch.dtype, kv_cache: Any) -> EngineFingerprint:
    """Model identity = name, architecture and a digest over the head of every weight tensor
    (cheap, and two checkpoints that differ anywhere near the start of any tensor differ here)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().reshape(-1)[:256].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    kv_dtype = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else str(dtype).removeprefix("torch.")
    # Under tensor parallelism an entry holds every rank's heads in rank order: another rank count
    # (or none) must never read it.
    tp = f"tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    return EngineFingerprint.from_model_config(
        model_config, model_id=f"{model_config.architecture}:{model_config.name}:{h.hexdigest()}",
        kv_cache_dtype=kv_dtype, block_size=args.block_size,
        extra=":".join(filter(None, (type(kv_cache).__name__, getattr(kv_cache, "layout_tag", ""), tp))))


def build_kv_tiers(args: EngineArgs, fingerprint: EngineFingerprint, kv_cache: Any
                   ) -> tuple[TierChain, KVOffloader] | None:
    """The tiers the flags ask for (None when none), opened and checked now: a bad path or an
    unreachable directory is a start-up error; an unreachable Redis is logged and retried."""
    if not args.has_kv_tiers:
        return None
    from kvserve.kv.tiers.disk import DiskTier
    from kvserve.kv.tiers.host import HostTier
    from kvserve.kv.tiers.writer import AsyncWriter

    host = None
    if args.host_tier_gib > 0:
        # Page-locked on CUDA: a restore is then a DMA straight from the entry.
        pinned = torch.cuda.is_available()
        host = HostTier.from_gib(fingerprint, args.host_tier_gib, allocate=lambda nbytes: torch.empty(
            nbytes, dtype=torch.uint8, pin_memory=pinned).numpy())
    lower = []
    try:
        if args.kv_disk_path is not None:
            lower.append(DiskTier(fingerprint, args.kv_disk_path, args.resolved_kv_disk_size))
        if args.kv_redis_url is not None:
            try:
                from kvserve.kv.tiers.redis_tier import RedisTier
            except ModuleNotFoundError as e:
                raise ConfigError(f"--kv-redis-url needs the redis client ({e}); pip install redis") from None
            lower.append(RedisTier(fingerprint, args.kv_redis_url))
    except BaseException:
        for t in lower:
            t.close()
        raise
    writer = AsyncWriter(lower) if lower else None
    chain = TierChain(host, lower, writer)
    offloader = KVOffloader(kv_cache, chain)
    for tier in chain.lower:  # a host tier too small for a block is how swap falls back to recompute
        capacity = tier.usage().capacity_bytes
        if tier.name == "disk" and capacity is not None and capacity < chain.entry_bytes:
            chain.close()
            raise ConfigError(f"--kv-disk-size: the disk KV tier ({capacity} bytes) cannot hold one block "
                              f"({chain.entry_bytes} bytes with this model and --kv-cache-dtype); raise it")
    logger.info("KV offload tiers: %s (fingerprint %s)", ", ".join(
        f"{t.name} {t.usage().capacity_bytes / 2**30:.1f} GiB" if t.usage().capacity_bytes else t.name
        for t in chain.tiers), fingerprint.hex[:12])
    return chain, offloader
