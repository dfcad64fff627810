"""The KV offload tier interface, the engine fingerprint, and the on-tier entry framing.

Every tier stores *framed* entries: a fixed header (magic, format version, engine fingerprint,
the key, payload length, CRC32) followed by the payload. The framing lives here, once, so that
host, disk and Redis detect the same faults the same way: a truncated, corrupt or foreign entry
is a counted miss, never data handed back to the engine (a wrong K/V block would silently
produce wrong tokens, which is worse than recomputing).

Tiers never raise into the engine on a backend failure (disk full, Redis down): they count it,
log it once, and answer "miss" / "not stored". Only programming errors (a key that is not bytes)
raise.
"""
from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any, Callable, NamedTuple, Sequence, Union

from kvserve.kv.events import BlockRemoved, BlockStored, KVEventSink
from kvserve.kv.tiers.order import DEFAULT as DEFAULT_RETENTION
from kvserve.kv.tiers.order import Retention

logger = logging.getLogger(__name__)

# Anything with the buffer protocol; tiers hand back zero-copy views where they can.
Buffer = Union[bytes, bytearray, memoryview]

# Bump when the frame header or the block codec changes: old entries then read as incompatible.
# An older version's entries are refused as incompatible, and never even looked up: the version
# is part of the fingerprint digest, so of every storage key.
FORMAT_VERSION = 3  # 2: payloads carry the block's token ids; 3: headers carry the retention
FRAME_MAGIC = b"KVT1"
# magic, version, header_len, fingerprint digest, key_len, flags, payload_len,
# retention priority, retention expiry (wall-clock seconds, inf: none), crc32
_FRAME = struct.Struct("<4sHH16sHHQhdI")
_VERSION = struct.Struct("<4sH")
_CRC_OFFSET = _FRAME.size - 4
_FLAG_NO_CRC = 1
# Payloads start on a 64-byte boundary so tensor views over them are aligned.
_ALIGN = 64
MAX_KEY_LEN = 0xFFFF


class TierUsage(NamedTuple):
    used_bytes: int
    capacity_bytes: int | None  # None: the backend sets no limit we know of (Redis without maxmemory)
    num_entries: int

    @property
    def fraction(self) -> float:
        """Used / capacity in [0, 1]; 0 when the capacity is unknown."""
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


@dataclass
class TierStats:
    """Monotonic counters since the tier was opened. `misses` includes corrupt and incompatible
    entries (each also counted under its own reason) and lookups skipped while the backend is down."""
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # bad magic, wrong key, length mismatch, checksum mismatch, truncated
    incompatible: int = 0  # written by an engine with another fingerprint or format version
    errors: int = 0  # backend failures (I/O errors, Redis connection errors / timeouts)
    puts: int = 0  # entries stored
    rejected: int = 0  # puts not stored: larger than the tier, backend failure, or backend down
    evictions: int = 0  # entries dropped to make room
    bytes_written: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineFingerprint:
    """Everything that decides the bytes of a stored K/V block. A block is only restored into an
    engine whose fingerprint digest equals the writer's; the digest is part of every storage
    key and of every frame header."""
    model: str  # model identity chosen by the engine: name plus weights identity (path, size, hash)
    kv_cache_dtype: str  # storage dtype of the pool: "bfloat16", "fp8_e4m3", "int4", ...
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    extra: str = ""  # anything else that changes block bytes: quantization group size, layout tag

    @cached_property
    def digest(self) -> bytes:
        fields = asdict(self)
        fields["format_version"] = FORMAT_VERSION
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canonical, digest_size=16).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def from_model_config(cls, model_config: Any, *, model_id: str, kv_cache_dtype: str,
                          block_size: int, extra: str = "") -> "EngineFingerprint":
        """Build from a `kvserve.config.ModelConfig` (duck-typed: no import cycle with config)."""
        return cls(model=model_id, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                   num_layers=model_config.num_hidden_layers,
                   num_kv_heads=model_config.num_key_value_heads,
                   head_dim=model_config.head_dim, extra=extra)


class FrameError(ValueError):
    """A stored entry failed verification; `reason` is 'corrupt' or 'incompatible'."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_LEN:
        raise TypeError(f"tier keys are non-empty bytes (block chain hashes) of at most {MAX_KEY_LEN} "
                        f"bytes; got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}")


def frame_header(fingerprint: bytes, key: bytes, payload: Buffer, *, checksum: bool = True,
                 retention: Retention = DEFAULT_RETENTION) -> bytes:
    """The header to store in front of `payload`. The CRC covers every byte but its own.
    `retention` travels with the entry, so a tier rebuilt from storage orders it as written.
    checksum=False (host RAM, which only the engine itself writes) skips the CRC pass and marks
    the frame so that a verifying reader refuses it rather than trusting it."""
    header_len = -(-(_FRAME.size + len(key)) // _ALIGN) * _ALIGN
    payload_len = memoryview(payload).nbytes
    flags = 0 if checksum else _FLAG_NO_CRC
    head = _FRAME.pack(FRAME_MAGIC, FORMAT_VERSION, header_len, fingerprint, len(key), flags, payload_len,
                       retention.priority, retention.expires, 0)
    prefix = head[:_CRC_OFFSET]
    tail = key + bytes(header_len - _FRAME.size - len(key))  # key + padding
    crc = zlib.crc32(payload, zlib.crc32(tail, zlib.crc32(prefix))) if checksum else 0
    return prefix + struct.pack("<I", crc) + tail


def frame_size(key: bytes, payload_len: int) -> int:
    return -(-(_FRAME.size + len(key)) // _ALIGN) * _ALIGN + payload_len


def open_frame(fingerprint: bytes, key: bytes, blob: Buffer, *, verify_checksum: bool = True) -> memoryview:
    """Verify a stored entry and return a zero-copy view of its payload; raise FrameError."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _FRAME.size:
        raise FrameError("corrupt", f"truncated: {view.nbytes} bytes, shorter than the frame header")
    _check_version(view)
    magic, version, header_len, fp, key_len, flags, payload_len, _, _, crc = _FRAME.unpack_from(view)
    if fp != fingerprint:
        raise FrameError("incompatible", f"engine fingerprint {fp.hex()} != {fingerprint.hex()}")
    if header_len < _FRAME.size + key_len or view.nbytes != header_len + payload_len:
        raise FrameError("corrupt", f"length mismatch: {view.nbytes} bytes stored, header says "
                                    f"{header_len} + {payload_len}")
    stored_key = view[_FRAME.size:_FRAME.size + key_len]
    if stored_key != key:
        raise FrameError("corrupt", "entry holds another key")
    payload = view[header_len:]
    if verify_checksum:
        if flags & _FLAG_NO_CRC:
            raise FrameError("corrupt", "entry was stored without a checksum")
        actual = zlib.crc32(payload, zlib.crc32(view[_FRAME.size:header_len], zlib.crc32(view[:_CRC_OFFSET])))
        if actual != crc:
            raise FrameError("corrupt", f"checksum mismatch ({actual:#010x} != {crc:#010x})")
    return payload


def _check_version(view: memoryview) -> None:
    if view.nbytes < _VERSION.size:
        raise FrameError("corrupt", f"truncated: {view.nbytes} bytes, shorter than the frame header")
    magic, version = _VERSION.unpack_from(view)
    if magic != FRAME_MAGIC:
        raise FrameError("corrupt", f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise FrameError("incompatible", f"format version {version}, this engine reads {FORMAT_VERSION}")
    if view.nbytes < _FRAME.size:
        raise FrameError("corrupt", f"truncated: {view.nbytes} bytes, shorter than the frame header")


def frame_retention(fingerprint: bytes, head: Buffer) -> Retention:
    """The retention stored in a frame's header (its first `HEADER_PEEK` bytes will do); raises
    FrameError for an entry of another format version or engine."""
    view = memoryview(head).cast("B")
    _check_version(view)
    fields = _FRAME.unpack_from(view)
    if fields[3] != fingerprint:
        raise FrameError("incompatible", f"engine fingerprint {fields[3].hex()} != {fingerprint.hex()}")
    return Retention(fields[7], fields[8])


HEADER_PEEK = _FRAME.size


class KVTier(ABC):
    """One level of the offload hierarchy. Keys are prefix-cache chain hashes (bytes); payloads
    are opaque buffers (see `codec.pack_block`). Thread-safe: the AsyncWriter thread puts while
    the engine thread gets. Entries are content-addressed, so re-putting a present key is a no-op."""

    name = "tier"
    medium = "STORAGE"  # its KV events' `medium` (kv/events.py)
    HASH_LEN = 32  # a block chain hash (SHA-256); other keys (swap entries) are one request's own

    def __init__(self, fingerprint: EngineFingerprint, *, verify_checksums: bool = True):
        self.fingerprint = fingerprint
        self._fp = fingerprint.digest
        self.verify_checksums = verify_checksums
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        self._logged: set[str] = set()
        # Told the keys of entries lost behind the tier's back (a disk directory removed), so
        # that whoever remembers them as stored here writes them again; set by TierChain.
        self.on_lost: Callable[[list[bytes]], None] | None = None
        # KV events (--kv-events-config): block chain hashes stored and removed here.
        self.events: KVEventSink | None = None
        self.block_size = 0

    # ---- public API: never raises on backend failure ----
    def put(self, key: bytes, payload: Buffer, token_ids: Sequence[int] = (),
            retention: Retention = DEFAULT_RETENTION) -> bool:
        """Store `payload` under `key`; False when it was not stored (too large, backend failure).
        `token_ids`, the block's tokens, are for the KV events only. `retention` (the block's
        priority and wall-clock expiry) decides what a full tier drops first."""
        stored = self._put(key, payload, retention=retention)
        if stored and self.events is not None and len(key) == self.HASH_LEN:
            self.events.add(BlockStored([key], None, list(token_ids), self.block_size, None, self.medium))
        return stored

    def _removed(self, keys: Sequence[bytes]) -> None:
        """Entries this tier dropped (evicted, deleted): a BlockRemoved for the block hashes."""
        if self.events is not None:
            hashes = [k for k in keys if len(k) == self.HASH_LEN]
            if hashes:
                self.events.add(BlockRemoved(hashes, self.medium))

    def get(self, key: bytes) -> memoryview | None:
        """The payload stored under `key`, or None (absent, corrupt, incompatible, backend down)."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Batched `get` (one round trip where the backend supports it)."""
        for key in keys:
            _check_key(key)
        start = time.perf_counter()
        try:
            blobs = self._load_many(list(keys))
        except Exception as exc:  # a backend bug must cost a recompute, not the engine
            self._count(errors=1, misses=len(keys))
            self._log_once("load", f"{self.name} tier: read failed ({exc!r}); treating as a miss")
            return [None] * len(keys)
        out: list[memoryview | None] = []
        for key, blob in zip(keys, blobs):
            out.append(None if blob is None else self._open(key, blob))
        hits = sum(p is not None for p in out)
        self._count(hits=hits, misses=len(keys) - hits, bytes_read=sum(p.nbytes for p in out if p is not None),
                    read_seconds=time.perf_counter() - start)
        return out

    def contains(self, key: bytes) -> bool:
        _check_key(key)
        try:
            return self._contains(key)
        except Exception as exc:
            self._count(errors=1)
            self._log_once("contains", f"{self.name} tier: lookup failed ({exc!r})")
            return False

    def delete(self, key: bytes) -> bool:
        _check_key(key)
        try:
            deleted = self._delete(key)
        except Exception as exc:
            self._count(errors=1)
            self._log_once("delete", f"{self.name} tier: delete failed ({exc!r})")
            return False
        if deleted:
            self._removed([key])
        return deleted

    def usage(self) -> TierUsage:
        return self._usage()

    def retain(self, key: bytes, retention: Retention) -> bool:
        """A block stored here was evicted from the device again, maybe at another priority: it
        keeps the higher one. False when the tier does not hold it or orders nothing itself."""
        return False

    def stats(self) -> TierStats:
        with self._stats_lock:
            return replace(self._stats)

    def close(self) -> None:
        self._close()

    def __enter__(self) -> "KVTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- backend hooks ----
    @abstractmethod
    def _store(self, key: bytes, header: bytes, payload: Buffer, **options: Any) -> bool:
        """Store header + payload (as one entry) under key; evict as needed, by `options["retention"]`
        (a Retention) where the backend can; False if not stored."""

    @abstractmethod
    def _load(self, key: bytes) -> Buffer | None:
        """The stored frame (header + payload) or None; count backend errors via _count."""

    def _load_many(self, keys: list[bytes]) -> list[Buffer | None]:
        return [self._load(key) for key in keys]

    @abstractmethod
    def _contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def _delete(self, key: bytes) -> bool: ...

    @abstractmethod
    def _usage(self) -> TierUsage: ...

    def _close(self) -> None:
        pass

    # ---- shared helpers ----
    def _put(self, key: bytes, payload: Buffer, retention: Retention = DEFAULT_RETENTION, **options: Any) -> bool:
        _check_key(key)
        start = time.perf_counter()
        header = frame_header(self._fp, key, payload, checksum=self.verify_checksums, retention=retention)
        options["retention"] = retention
        try:
            stored = self._store(key, header, payload, **options)
        except Exception as exc:
            self._count(errors=1, rejected=1)
            self._log_once("store", f"{self.name} tier: write failed ({exc!r}); entry dropped")
            return False
        if stored:
            self._count(puts=1, bytes_written=len(header) + memoryview(payload).nbytes,
                        write_seconds=time.perf_counter() - start)
        else:
            self._count(rejected=1)
        return stored

    def _open(self, key: bytes, blob: Buffer) -> memoryview | None:
        try:
            return open_frame(self._fp, key, blob, verify_checksum=self.verify_checksums)
        except FrameError as exc:
            self._count(**{exc.reason: 1})
            self._log_once(f"frame-{exc.reason}", f"{self.name} tier: dropping a {exc.reason} entry "
                                                  f"({exc.detail}); it will be recomputed")
            try:
                self._delete(key)  # never serve it again, and free its space
            except Exception:
                pass
            return None

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for field_name, delta in deltas.items():
                setattr(self._stats, field_name, getattr(self._stats, field_name) + delta)

    def _log_once(self, what: str, message: str, level: int = logging.WARNING) -> None:
        """Log the first occurrence of each kind of fault only: a flapping backend must not
        flood the log at decode rate. The counters carry the totals."""
        if what not in self._logged:
            self._logged.add(what)
            logger.log(level, message)
