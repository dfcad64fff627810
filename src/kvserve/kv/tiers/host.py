"""Host-RAM tier (`--swap-space` GiB): the first level below the device pool.

Entries live in uint8 arrays from `allocate` (kvserve.cache.offload passes page-locked memory on
CUDA, so a restore is a DMA straight from them), under a byte budget. A full tier drops the entry
the device pool would have dropped first (kv/tiers/order.py): the lowest retention priority, the
least recently used within one, entries past their expiry before any other.

Swap preemption needs entries that must not be evicted while their request waits: `put_held`
stores one outside that order (it still counts against the budget) until `release` or `delete`.
Checksums are not verified on read by default: this memory is the engine's own; the frame's
fingerprint, key and length are still checked.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from kvserve.config import ConfigError
from kvserve.kv.tiers.base import Buffer, EngineFingerprint, KVTier, TierUsage
from kvserve.kv.tiers.order import DEFAULT, Retention, RetentionOrder


class HostTier(KVTier):
    name = "host"
    medium = "CPU"

    def __init__(self, fingerprint: EngineFingerprint, capacity_bytes: int, *,
                 allocate: Callable[[int], np.ndarray] | None = None, verify_checksums: bool = False):
        """`allocate(nbytes)` returns a uint8 array for one entry (default: ordinary memory)."""
        if capacity_bytes <= 0:
            raise ConfigError(f"the host KV tier needs a positive budget (got {capacity_bytes} bytes); "
                              f"set --swap-space to a size in GiB greater than 0, or leave the tier off")
        super().__init__(fingerprint, verify_checksums=verify_checksums)
        self.capacity_bytes = int(capacity_bytes)
        self._allocate = allocate or (lambda nbytes: np.empty(nbytes, dtype=np.uint8))
        self._entries: dict[bytes, np.ndarray] = {}  # evictable entries
        self._order = RetentionOrder()  # ... and which goes first
        self._held: dict[bytes, np.ndarray] = {}
        self._used = 0
        self._held_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_gib(cls, fingerprint: EngineFingerprint, swap_space_gib: float, **kwargs: Any) -> "HostTier":
        return cls(fingerprint, int(swap_space_gib * 1024**3), **kwargs)

    @property
    def held_bytes(self) -> int:
        """Bytes of held (swap) entries: the part of the budget eviction cannot free."""
        with self._lock:
            return self._held_bytes

    def put_held(self, key: bytes, payload: Buffer) -> bool:
        """Store an entry that eviction must not touch (a swapped-out request's block)."""
        return self._put(key, payload, held=True)

    def release(self, key: bytes) -> bool:
        """Make a held entry evictable again (it becomes the most recently used)."""
        with self._lock:
            entry = self._held.pop(key, None)
            if entry is None:
                return False
            self._held_bytes -= entry.nbytes
            self._entries[key] = entry
            self._order.add(key, entry.nbytes)
            return True

    def retain(self, key: bytes, retention: Retention) -> bool:
        """A block already stored here was evicted from the device again, maybe at another
        priority: it keeps the higher one and becomes the most recently used."""
        with self._lock:
            if key not in self._entries:
                return False
            self._order.add(key, self._entries[key].nbytes, retention)
            return True

    def retention(self, key: bytes) -> Retention | None:
        with self._lock:
            return self._order.retention(key)

    def _store(self, key: bytes, header: bytes, payload: Buffer, held: bool = False,
               retention: Retention = DEFAULT) -> bool:
        size = len(header) + memoryview(payload).nbytes
        with self._lock:
            if key in self._entries or key in self._held:
                if held and key in self._entries:  # promote the present copy rather than store it twice
                    entry = self._entries.pop(key)
                    self._order.pop(key)
                    self._held[key] = entry
                    self._held_bytes += entry.nbytes
                elif key in self._entries:
                    self._order.add(key, self._entries[key].nbytes, retention)
                return True
            if size > self.capacity_bytes - self._held_bytes:
                return False
            evicted: list[bytes] = []
            while self._used + size > self.capacity_bytes:
                popped = self._order.pop_victim()
                if popped is None:  # the rest is held or reserved by puts in flight
                    self._count(evictions=len(evicted))
                    self._removed(evicted)
                    return False
                victim_key, victim_size = popped
                del self._entries[victim_key]
                self._used -= victim_size
                evicted.append(victim_key)
            # Reserve the bytes now so a concurrent put cannot overcommit while we copy.
            self._used += size
        if evicted:
            self._count(evictions=len(evicted))
            self._removed(evicted)
        try:
            entry = self._allocate(size)
            entry[:len(header)] = np.frombuffer(header, dtype=np.uint8)
            entry[len(header):] = np.frombuffer(payload, dtype=np.uint8)
        except BaseException:
            with self._lock:
                self._used -= size
            raise
        with self._lock:
            if key in self._entries or key in self._held:  # a concurrent put of the same block won
                self._used -= size
            elif held:
                self._held[key] = entry
                self._held_bytes += size
            else:
                self._entries[key] = entry
                self._order.add(key, size, retention)
        return True

    def _load(self, key: bytes) -> Buffer | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._order.touch(key)
            else:
                entry = self._held.get(key)
        # The view keeps the entry alive past an eviction.
        return None if entry is None else memoryview(entry)

    def _contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries or key in self._held

    def _delete(self, key: bytes) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._order.pop(key)
            else:
                entry = self._held.pop(key, None)
                if entry is None:
                    return False
                self._held_bytes -= entry.nbytes
            self._used -= entry.nbytes
            return True

    def _usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._entries) + len(self._held))

    def _close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._order.clear()
            self._held.clear()
            self._used = self._held_bytes = 0
