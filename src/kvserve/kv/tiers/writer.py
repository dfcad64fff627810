"""AsyncWriter: writes evicted blocks down the tiers on a background thread, off the decode path.

The engine thread packs a block (the device copy must be taken before the block id is reused)
and submits the bytes; the writer thread puts them into each tier in order. The queue is bounded
in bytes: when the tiers cannot keep up, new blocks are dropped and counted, never waited for —
a dropped block only costs a possible recompute later, a blocked decode step costs every
running request. Blocks still queued stay readable through `pending`, so a lookup right after
an eviction does not miss just because the write has not landed.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Sequence

from kvserve.kv.tiers.base import Buffer, KVTier
from kvserve.kv.tiers.order import DEFAULT, Retention

logger = logging.getLogger(__name__)


@dataclass
class WriterStats:
    submitted: int = 0  # blocks accepted into the queue
    written: int = 0  # blocks processed (put into every tier; a tier may still have rejected it)
    dropped: int = 0  # blocks refused because the queue was full or the writer closed
    queued: int = 0  # blocks waiting now
    queued_bytes: int = 0


class AsyncWriter:
    def __init__(self, tiers: Sequence[KVTier], max_queue_bytes: int = 256 * 1024**2,
                 name: str = "kv-tier-writer"):
        if not tiers:
            raise ValueError("AsyncWriter needs at least one tier to write to")
        if max_queue_bytes <= 0:
            raise ValueError(f"max_queue_bytes must be > 0 (got {max_queue_bytes})")
        self.tiers = list(tiers)
        self.max_queue_bytes = max_queue_bytes
        self._queue: OrderedDict[bytes, Buffer] = OrderedDict()  # FIFO, and key -> payload for reads
        self._tokens: dict[bytes, Sequence[int]] = {}  # queued blocks' token ids, for KV events
        self._retention: dict[bytes, Retention] = {}  # queued blocks' retention, where not the default
        self._in_flight: tuple[bytes, Buffer] | None = None
        self._cond = threading.Condition()
        self._stats = WriterStats()
        self._closed = False
        # Keys some tier did not store (full, down, refused); the engine thread drains it.
        self.failed: deque[bytes] = deque(maxlen=1 << 17)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: bytes, payload: Buffer, token_ids: Sequence[int] = (),
               retention: Retention = DEFAULT) -> bool:
        """Queue a block for writing; False (and counted) when the queue is full or closed.
        `token_ids` go to the tiers' KV events, `retention` to the tiers' eviction order."""
        size = memoryview(payload).nbytes
        with self._cond:
            if key in self._queue or (self._in_flight is not None and self._in_flight[0] == key):
                return True  # content-addressed: the queued copy is the same block
            if self._closed or self._stats.queued_bytes + size > self.max_queue_bytes:
                self._stats.dropped += 1
                return False
            self._queue[key] = payload
            if token_ids:
                self._tokens[key] = token_ids
            if retention != DEFAULT:
                self._retention[key] = retention
            self._stats.submitted += 1
            self._stats.queued += 1
            self._stats.queued_bytes += size
            self._cond.notify_all()
        return True

    def pending(self, key: bytes) -> Buffer | None:
        """The payload of a block submitted but not yet written everywhere, else None."""
        with self._cond:
            payload = self._queue.get(key)
            if payload is None and self._in_flight is not None and self._in_flight[0] == key:
                payload = self._in_flight[1]
            return payload

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._in_flight is None, timeout)

    def stats(self) -> WriterStats:
        with self._cond:
            return replace(self._stats)

    def close(self, drain: bool = True, timeout: float | None = 10.0) -> None:
        """Stop the thread; with drain, write what is queued first (else drop and count it)."""
        with self._cond:
            self._closed = True
            if not drain:
                self._stats.dropped += len(self._queue)
                self._stats.queued = self._stats.queued_bytes = 0
                self._queue.clear()
                self._tokens.clear()
                self._retention.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                key, payload = self._queue.popitem(last=False)
                token_ids = self._tokens.pop(key, ())
                retention = self._retention.pop(key, DEFAULT)
                self._in_flight = (key, payload)
                self._stats.queued -= 1
                self._stats.queued_bytes -= memoryview(payload).nbytes
            for tier in self.tiers:
                try:
                    stored = tier.put(key, payload, token_ids, retention)
                except Exception:  # tiers do not raise on backend faults; this is a bug, keep writing
                    logger.exception("KV tier writer: %s tier raised on put", tier.name)
                    stored = False
                if not stored:
                    self.failed.append(key)  # the engine must not count it as stored below
            with self._cond:
                self._in_flight = None
                self._stats.written += 1
                self._cond.notify_all()
