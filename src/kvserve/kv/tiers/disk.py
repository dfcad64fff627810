"""Local-disk tier (`--kv-disk-path`, `--kv-disk-size`): one file per block under a size cap.

Files are written to a temp name and renamed into place, so a reader (or a restart after a crash)
sees a whole entry or none; a torn write after power loss shows up as a truncated frame, which
the frame check turns into a counted miss. File names carry the engine fingerprint, so engines
with different models or KV layouts can share a directory without ever reading each other's
blocks. A full tier drops the lowest retention priority first, least recently used first within
one, entries past their expiry before any (kv/tiers/order.py). The order lives in memory and is
rebuilt at start from each file's header (priority, expiry) and mtime (a hit touches the file),
which is what lets a restarted server keep serving the prefixes it saw before; files of another
format version or engine are dropped first.

One process per directory: an flock on `.lock` enforces it (two indexes over the same files
would each evict by their own view of the size). Share blocks across servers through Redis.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time

from kvserve.config import ConfigError
from kvserve.kv.tiers.base import HEADER_PEEK, Buffer, EngineFingerprint, FrameError, KVTier, TierUsage, frame_retention
from kvserve.kv.tiers.order import DEFAULT, LOWEST, Retention, RetentionOrder

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
_LOCK_NAME = ".lock"


class DiskTier(KVTier):
    name = "disk"
    medium = "STORAGE"

    def __init__(self, fingerprint: EngineFingerprint, path: str | os.PathLike, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ConfigError(f"--kv-disk-size must be a positive size such as 20GiB (got {capacity_bytes} bytes)")
        super().__init__(fingerprint)
        self.path = os.fspath(path)
        self.capacity_bytes = int(capacity_bytes)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--kv-disk-path {self.path!r}: cannot create the directory ({exc.strerror}); "
                              f"pass a writable directory") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"--kv-disk-path {self.path!r} is not writable by this user; pass a writable directory")
        try:
            self._lock_fd = os.open(os.path.join(self.path, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # /proc, /sys: os.access says yes to root, the kernel says no
            raise ConfigError(f"--kv-disk-path {self.path!r}: cannot create files there ({exc.strerror}); "
                              f"pass a directory on a regular filesystem") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ConfigError(f"--kv-disk-path {self.path!r} is in use by another kvserve process; give each "
                              f"server its own directory (share KV across servers with --kv-redis-url)") from None
        self._dir_lock = threading.Lock()  # one recreation at a time (_recreate)
        self._prefix = fingerprint.hex + "-"
        self._order = RetentionOrder()  # file name -> size, in the order a full tier drops them
        self._used = 0
        self._lock = threading.Lock()
        self._clock_ns = 0
        self._rebuild_index()
        free = shutil.disk_usage(self.path).free + self._used
        if free < self.capacity_bytes:
            # The cap is the only limit the tier knows: past the free space, writes fail (counted
            # as errors) instead of evicting.
            logger.warning("--kv-disk-size %.1f GiB is more than the %.1f GiB free at %s; the disk tier will "
                           "stop storing blocks when the filesystem fills. Lower --kv-disk-size",
                           self.capacity_bytes / 2**30, free / 2**30, self.path)

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.path) as it:
            for entry in it:
                if entry.name.endswith(_TMP_SUFFIX):  # a write interrupted by a crash
                    _unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        if found:
            self._clock_ns = found[-1][0]
        for _, name, size in found:
            self._order.add(name, size, self._stored_retention(name))
            self._used += size
        victims = self._evict_locked(0)  # the cap may have shrunk since the last run
        for victim in victims:
            _unlink(os.path.join(self.path, victim))
        if victims:
            self._count(evictions=len(victims))

    def _stored_retention(self, name: str) -> Retention:
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                return frame_retention(self._fp, f.read(HEADER_PEEK))
        except (OSError, FrameError):  # another format or engine, or unreadable: nothing to keep it for
            return Retention(LOWEST)

    def retain(self, key: bytes, retention: Retention) -> bool:
        """In the in-memory order only: the header keeps the priority it was written with, which
        is what a restart rebuilds from."""
        name = self.file_name(key)
        with self._lock:
            size = self._order.size(name)
            if size is None:
                return False
            self._order.add(name, size, retention)
            return True

    def retention(self, key: bytes) -> Retention | None:
        with self._lock:
            return self._order.retention(self.file_name(key))

    def _stamp(self, path: str) -> None:
        """Set mtime to a strictly increasing now: the kernel's coarse file clock gives equal
        mtimes to writes within a few ms, which would lose the LRU order across a restart."""
        with self._lock:
            self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
            stamp = self._clock_ns
        try:
            os.utime(path, ns=(stamp, stamp))
        except FileNotFoundError:  # evicted meanwhile
            pass

    def file_name(self, key: bytes) -> str:
        return f"{self._prefix}{key.hex()}{SUFFIX}"

    def _key_of(self, name: str) -> bytes:
        return bytes.fromhex(name[len(self._prefix):-len(SUFFIX)])

    def _evict_locked(self, incoming: int) -> list[str]:
        victims = []
        while self._order and self._used + incoming > self.capacity_bytes:
            name, size = self._order.pop_victim()
            self._used -= size
            victims.append(name)
        return victims

    def _store(self, key: bytes, header: bytes, payload: Buffer, _retry: bool = True,
               retention: Retention = DEFAULT) -> bool:
        name = self.file_name(key)
        size = len(header) + memoryview(payload).nbytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if name in self._order:  # content-addressed: the stored copy is the same block
                self._order.add(name, self._order.size(name), retention)
                return True
            victims = self._evict_locked(size)
            # Not fitting after evicting everything means the rest is reserved by writes in flight.
            fits = self._used + size <= self.capacity_bytes
            if fits:
                self._used += size  # reserve before writing so concurrent puts cannot overcommit
        for victim in victims:
            _unlink(os.path.join(self.path, victim))
        if victims:
            self._count(evictions=len(victims))
            self._removed([self._key_of(v) for v in victims])
        if not fits:
            return False
        final = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)
            self._stamp(final)
        except OSError as exc:
            _unlink(tmp)
            with self._lock:
                self._used -= size
            # The directory removed under us: make it again (or find it made by a metrics scrape's
            # _usage meanwhile) and write once more.
            if isinstance(exc, FileNotFoundError) and _retry and (self._recreate() or os.path.isdir(self.path)):
                return self._store(key, header, payload, _retry=False, retention=retention)
            with self._lock:
                full = exc.errno == errno.ENOSPC and self._used > 0
                if full:
                    # The filesystem filled before the cap: the cap becomes what is stored now,
                    # so the tier evicts from here on instead of every write failing.
                    logger.warning("disk KV tier: %s is full at %.1f GiB, below --kv-disk-size %.1f GiB; "
                                   "keeping %.1f GiB from now on", self.path, self._used / 2**30,
                                   self.capacity_bytes / 2**30, self._used / 2**30)
                    self.capacity_bytes = self._used
            if full and self.capacity_bytes >= size:
                return self._store(key, header, payload, retention=retention)  # evicts to make room
            raise
        except BaseException:
            _unlink(tmp)
            with self._lock:
                self._used -= size
            raise
        with self._lock:
            if name in self._order:  # a concurrent put of the same block landed first
                self._used -= size
            else:
                self._order.add(name, size, retention)
        return True

    def _load(self, key: bytes) -> Buffer | None:
        name = self.file_name(key)
        with self._lock:
            if name not in self._order:
                return None
            self._order.touch(name)
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                blob = bytearray(size)  # writable: tensors unpacked from it need no copy
                got = f.readinto(blob)
            self._stamp(path)  # persist the recency order for the next start
        except FileNotFoundError:  # removed behind our back: forget it
            self._forget(name)
            return None
        except OSError as exc:  # an I/O error costs this block a recompute, not the whole batch
            self._count(errors=1)
            self._log_once("read", f"disk tier: cannot read {path} ({exc.strerror}); treating as a miss")
            return None
        return blob if got == size else memoryview(blob)[:got]

    def _contains(self, key: bytes) -> bool:
        with self._lock:
            return self.file_name(key) in self._order

    def _delete(self, key: bytes) -> bool:
        name = self.file_name(key)
        if not self._forget(name):
            return False
        _unlink(os.path.join(self.path, name))
        return True

    def _forget(self, name: str) -> bool:
        with self._lock:
            size = self._order.pop(name)
            if size is None:
                return False
            self._used -= size
            return True

    def _recreate(self) -> bool:
        """The directory was removed while in use (an `rm -rf`, a tmp cleaner): make it again, with
        its lock, and forget the blocks that went with it, so the tier keeps storing and reports
        what it holds. False when it still exists (another cause) or cannot be made."""
        with self._dir_lock:
            if self._lock_fd < 0 or os.path.isdir(self.path):  # closed, or not the cause
                return False
            try:
                os.makedirs(self.path, exist_ok=True)
                fd = os.open(os.path.join(self.path, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self._log_once("recreate", f"disk tier: {self.path} was removed and cannot be made again "
                                           f"({exc.strerror}); blocks are not stored on disk until it can")
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another process made it first and holds it: leave it to that one
                os.close(fd)
                self._log_once("recreate", f"disk tier: {self.path} was removed, and another process now "
                                           f"holds the new one; blocks are not stored on disk")
                return False
            old, self._lock_fd = self._lock_fd, fd
            os.close(old)
            with self._lock:
                lost = list(self._order)
                self._used -= sum(self._order.size(n) for n in lost)  # what puts in flight reserved stays
                self._order.clear()
        logger.warning("disk tier: %s was removed while in use; made it again (the %d blocks stored there are "
                       "gone and will be recomputed)", self.path, len(lost))
        if self.on_lost is not None:
            self.on_lost([bytes.fromhex(name[len(self._prefix):-len(SUFFIX)]) for name in lost])
        return True

    def _usage(self) -> TierUsage:
        if not os.path.isdir(self.path):  # removed behind our back: what it held is gone
            self._recreate()
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._order))

    def _close(self) -> None:
        with self._dir_lock:  # not while _recreate swaps the lock's descriptor
            if self._lock_fd >= 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = -1


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
