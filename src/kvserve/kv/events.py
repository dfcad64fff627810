"""KV cache events: what the cache stored and dropped, in vLLM's event schema.

A KV-aware router (llm-d's endpoint picker, Dynamo's KV router, Ray Serve's) keeps an index of
which server holds which block from these: BlockStored when a full block enters a tier's index,
BlockRemoved when it leaves, AllBlocksCleared when a tier drops everything. Hashes are the block
hashes the cache itself uses, which are salted per tenant from the first block on: a router can
match a tenant's own requests, and the salt itself never appears in an event.

`medium` names the tier: "GPU" for the engine's own pool (vLLM's name for it, whatever the
device), "CPU" for the host tier, "STORAGE" for the disk tier, "REDIS" for the Redis tier.

Events are plain data collected by a KVEventSink (appends from any thread); the engine drains
them once a step and the publisher (engine/kv_events.py) encodes and sends them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK, MEDIUM_REDIS = "GPU", "CPU", "STORAGE", "REDIS"


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # None for a sequence's first block (or where unknown: a tier)
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str


@dataclass
class AllBlocksCleared:
    medium: str | None = None  # not in vLLM's schema: for this side's accounting only


@dataclass
class KVEventSink:
    """Events in the order they happened, from the engine thread and the tier writer's."""
    _events: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events
