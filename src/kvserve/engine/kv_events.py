"""Publishing KV cache events as vLLM does: a ZMQ PUB socket, a replay socket, msgpack batches.

Wire format, vLLM's (vllm/distributed/kv_events.py, msgspec): each message is three frames,
[topic, sequence number (8 bytes, big-endian), payload]; the payload is a batch
[timestamp, [event, ...], data_parallel_rank] whose events are maps tagged with "type"
("BlockStored", "BlockRemoved", "AllBlocksCleared"). A subscriber that missed batches sends the
first sequence number it wants (8 bytes, big-endian) to the replay ROUTER socket and gets
[seq, payload] for every buffered batch from there on, then [-1, b""].

Encoding and sending run on a thread of their own: the step loop only hands over a list.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from kvserve.config import KVEventsConfig
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_event(event) -> dict:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": event.block_hashes, "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids, "block_size": event.block_size, "lora_id": event.lora_id,
                "medium": event.medium, "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(events: list, data_parallel_rank: int, ts: float | None = None) -> bytes:
    import msgpack
    return msgpack.packb([time.time() if ts is None else ts, [encode_event(e) for e in events], data_parallel_rank],
                         use_bin_type=True)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Data-parallel rank r publishes on the endpoint's port + r (vLLM's rule), or name + _dp<r>."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq
        self.rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        # vLLM's rule: bind a wildcard or local endpoint, connect to a named host.
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(offset_endpoint(config.replay_endpoint, data_parallel_rank))
        self.dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV cache events published on %s%s (topic %r)", endpoint,
                    f", replay on {offset_endpoint(config.replay_endpoint, data_parallel_rank)}"
                    if config.replay_endpoint else "", config.topic)

    def publish(self, events: list) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:  # the thread fell behind by max_queue_size batches: drop, count
            self.dropped += len(events)

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV events replay failed")
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            ts, events = item
            try:
                payload = encode_batch(events, self.rank, ts)
                seq = self._seq
                self._seq += 1
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("publishing KV events failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events replay: a request of %d frames ignored (want identity, empty, seq)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
