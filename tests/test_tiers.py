"""KV offload tiers against real backends: host RAM, a directory, a real redis-server."""
from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
import torch
from helpers import wait_until

from kvserve.cache.codec import BlockFormatError, pack_block, packed_size, unpack_block
from kvserve.config import ConfigError
from kvserve.kv.tiers import AsyncWriter, DiskTier, EngineFingerprint, FrameError, HostTier, frame_header, open_frame
from kvserve.kv.tiers.base import frame_size
from kvserve.kv.tiers.redis_tier import RedisTier

FP = EngineFingerprint(model="SmolLM2-135M-Instruct.Q4_1.gguf", kv_cache_dtype="bfloat16", block_size=16,
                       num_layers=30, num_kv_heads=3, head_dim=64)
FP_OTHER = EngineFingerprint(model="SmolLM2-135M-Instruct.Q4_1.gguf", kv_cache_dtype="int8", block_size=16,
                             num_layers=30, num_kv_heads=3, head_dim=64)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a SHA-256 chain hash


def payload(i: int, size: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


ENTRY = frame_size(key(0), 1000)  # bytes one 1000-byte payload occupies in a tier


# ---------------------------------------------------------------- codec, fingerprint, framing

# Unpacking a bytes object (what Redis returns) gives read-only views; torch says so once.
@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_pack_unpack_round_trip_keeps_dtype_shape_and_bits():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(16, 3, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    tensors += [torch.randn(16, 3, 64, generator=g).to(torch.float8_e4m3fn),
                torch.randint(-128, 127, (3, 16, 8), dtype=torch.int8, generator=g).transpose(0, 1),  # strided
                torch.tensor(0.125), torch.zeros(0, 4), torch.randn(2, 5, generator=g, dtype=torch.float64)]
    buf = pack_block(tensors)
    assert len(buf) == packed_size(tensors)
    out = unpack_block(bytes(buf))
    assert len(out) == len(tensors)
    for a, b in zip(tensors, out):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(_bits(a), _bits(b))  # bit-exact, also for fp8 and NaN-free compare
        if b.numel():  # 64-byte aligned views: safe for any dtype and for DMA
            assert (b.data_ptr() - out[0].data_ptr()) % 64 == 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def test_unpack_rejects_garbage_and_truncation():
    with pytest.raises(BlockFormatError):
        unpack_block(b"not a block at all")
    buf = pack_block([torch.ones(16, 3, 64)])
    with pytest.raises(BlockFormatError, match="runs past"):
        unpack_block(buf[:len(buf) // 2])


def test_fingerprint_changes_with_every_field_and_is_stable():
    base = dict(model="m", kv_cache_dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    digests = {EngineFingerprint(**base).digest}
    for field_name, other in [("model", "m2"), ("kv_cache_dtype", "fp8"), ("block_size", 32),
                              ("num_layers", 31), ("num_kv_heads", 1), ("head_dim", 128)]:
        digests.add(EngineFingerprint(**{**base, field_name: other}).digest)
    assert len(digests) == 7
    assert EngineFingerprint(**base).digest == EngineFingerprint(**base).digest


def test_fingerprint_from_model_config():
    from kvserve.config import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192)
    fp = EngineFingerprint.from_model_config(cfg, model_id="SmolLM2-135M-Instruct.Q4_1.gguf",
                                             kv_cache_dtype="bfloat16", block_size=16)
    assert fp.digest == FP.digest


@pytest.mark.parametrize("position", [0, 5, 20, 45, 100, 500, -1])
def test_frame_detects_any_flipped_byte(position):
    blob = bytearray(frame_header(FP.digest, key(1), payload(1)) + payload(1))
    assert bytes(open_frame(FP.digest, key(1), blob)) == payload(1)
    blob[position] ^= 0x40
    with pytest.raises(FrameError) as err:
        open_frame(FP.digest, key(1), blob)
    assert err.value.reason in ("corrupt", "incompatible")


def test_frame_detects_truncation_foreign_fingerprint_and_wrong_key():
    blob = frame_header(FP.digest, key(1), payload(1)) + payload(1)
    for cut in (0, 10, 63, len(blob) - 1):
        with pytest.raises(FrameError, match="corrupt"):
            open_frame(FP.digest, key(1), blob[:cut])
    with pytest.raises(FrameError, match="incompatible"):
        open_frame(FP_OTHER.digest, key(1), blob)
    with pytest.raises(FrameError, match="another key"):
        open_frame(FP.digest, key(2), blob)
    unchecked = frame_header(FP.digest, key(1), payload(1), checksum=False) + payload(1)
    assert bytes(open_frame(FP.digest, key(1), unchecked, verify_checksum=False)) == payload(1)
    with pytest.raises(FrameError, match="without a checksum"):
        open_frame(FP.digest, key(1), unchecked)


def test_packed_block_survives_every_local_tier(tmp_path):
    g = torch.Generator().manual_seed(1)
    block = [torch.randn(16, 3, 64, generator=g).to(torch.bfloat16) for _ in range(2 * 30)]
    packed = pack_block(block)
    pool = torch.zeros(60, 16, 3, 64, dtype=torch.bfloat16)  # stands in for the KV pool's block
    with HostTier(FP, 1 << 24) as host, DiskTier(FP, tmp_path, 1 << 24) as disk:
        for tier in (host, disk):
            pool.zero_()
            assert tier.put(key(7), packed)
            for i, t in enumerate(unpack_block(tier.get(key(7)))):
                pool[i].copy_(t)
            assert torch.equal(pool, torch.stack(block))


# ---------------------------------------------------------------- host tier

def test_host_round_trip_and_usage():
    tier = HostTier(FP, 10 * ENTRY)
    assert tier.get(key(1)) is None
    assert tier.put(key(1), payload(1))
    assert tier.contains(key(1)) and not tier.contains(key(2))
    assert bytes(tier.get(key(1))) == payload(1)
    assert tier.usage() == (ENTRY, 10 * ENTRY, 1)
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.bytes_read) == (1, 1, 1, 1000)
    assert tier.delete(key(1)) and not tier.contains(key(1)) and tier.usage().used_bytes == 0


def test_host_lru_eviction_respects_budget():
    tier = HostTier(FP, 3 * ENTRY)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    tier.get(key(0))  # 0 becomes most recent: 1 is now the coldest
    assert tier.put(key(3), payload(3))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.usage().used_bytes == 3 * ENTRY and tier.stats().evictions == 1
    assert not tier.put(key(9), payload(9, 4 * ENTRY))  # larger than the whole tier
    assert tier.stats().rejected == 1 and tier.usage().num_entries == 3


def test_host_held_entries_survive_eviction_until_released():
    tier = HostTier(FP, 3 * ENTRY)
    assert tier.put_held(key(0), payload(0)) and tier.put_held(key(1), payload(1))
    for i in range(2, 6):
        assert tier.put(key(i), payload(i))
    assert tier.contains(key(0)) and tier.contains(key(1)) and tier.usage().num_entries == 3
    assert tier.put_held(key(6), payload(6))  # evicts the one evictable entry
    assert not tier.put_held(key(7), payload(7))  # budget fully held: refuse, do not evict held
    assert tier.release(key(0))
    assert tier.put(key(8), payload(8)) and not tier.contains(key(0))


def test_host_concurrent_puts_and_gets_keep_accounting_exact():
    tier = HostTier(FP, 20 * ENTRY)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(300):
                k = key(offset + i % 40)
                tier.put(k, payload(offset + i % 40))
                got = tier.get(k)
                assert got is None or bytes(got) == payload(offset + i % 40)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    used, cap, n = tier.usage()
    assert used <= cap and used == n * ENTRY


def test_host_zero_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="--swap-space"):
        HostTier(FP, 0)


# ---------------------------------------------------------------- disk tier

def _files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".kvb"))


def test_disk_round_trip_and_lru_eviction_respects_size(tmp_path):
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:
        for i in range(3):
            assert tier.put(key(i), payload(i))
        assert bytes(tier.get(key(0))) == payload(0)  # 1 becomes the coldest
        assert tier.put(key(3), payload(3))
        assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
        assert len(_files(tmp_path)) == 3
        assert sum(os.path.getsize(tmp_path / n) for n in _files(tmp_path)) <= 3 * ENTRY
        assert not tier.put(key(9), payload(9, 4 * ENTRY))
        s = tier.stats()
        assert (s.evictions, s.rejected, s.hits) == (1, 1, 1)


def test_disk_directory_removed_while_in_use_is_made_again(tmp_path, caplog):
    """An `rm -rf` of --kv-disk-path under a running server: the tier makes the directory (and
    its lock) again, reports what it now holds, and keeps storing; the lost blocks are misses."""
    import logging
    import shutil
    path = tmp_path / "kv"
    with DiskTier(FP, path, 10 * ENTRY) as tier:
        lost = []
        tier.on_lost = lost.extend  # TierChain points it at the writer's failed keys
        for i in range(3):
            assert tier.put(key(i), payload(i))
        shutil.rmtree(path)
        with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers.disk"):
            assert tier.usage() == (0, 10 * ENTRY, 0)  # a metrics scrape finds it gone
        assert "was removed while in use" in caplog.text and "3 blocks" in caplog.text
        assert sorted(lost) == sorted(key(i) for i in range(3))
        assert path.is_dir() and (path / ".lock").exists()
        assert tier.get(key(0)) is None
        assert tier.put(key(5), payload(5)) and bytes(tier.get(key(5))) == payload(5)
        shutil.rmtree(path)  # and when a write is the first to find it gone
        assert tier.put(key(6), payload(6)) and bytes(tier.get(key(6))) == payload(6)
        assert tier.usage().num_entries == 1 and tier.stats().errors == 0
    with DiskTier(FP, path, 10 * ENTRY) as again:  # the new lock is released at close like the first
        assert again.contains(key(6))


def test_disk_persists_entries_and_lru_order_across_restart(tmp_path):
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:
        for i in range(3):
            tier.put(key(i), payload(i))
        tier.get(key(0))
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:  # a restarted server
        assert tier.usage() == (3 * ENTRY, 3 * ENTRY, 3)
        assert bytes(tier.get(key(2))) == payload(2)
        tier.put(key(3), payload(3))  # evicts the coldest: 1 (0 was touched before the restart, 2 now)
        assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    with DiskTier(FP, tmp_path, 2 * ENTRY) as tier:  # restarted with a smaller --kv-disk-size
        assert tier.usage().num_entries == 2 and len(_files(tmp_path)) == 2
        assert tier.contains(key(2)) and tier.contains(key(3))


def test_disk_corrupt_and_truncated_files_are_counted_misses(tmp_path):
    with DiskTier(FP, tmp_path, 10 * ENTRY) as tier:
        tier.put(key(1), payload(1))
        tier.put(key(2), payload(2))
        path1 = tmp_path / tier.file_name(key(1))
        data = bytearray(path1.read_bytes())
        data[len(data) - 10] ^= 0x01  # one bit in the payload
        path1.write_bytes(bytes(data))
        path2 = tmp_path / tier.file_name(key(2))
        path2.write_bytes(path2.read_bytes()[:500])
        assert tier.get(key(1)) is None and tier.get(key(2)) is None
        s = tier.stats()
        assert (s.corrupt, s.misses, s.hits) == (2, 2, 0)
        assert not path1.exists() and not path2.exists()  # never served again, space freed
        assert tier.usage().num_entries == 0


def test_disk_incompatible_fingerprint_never_restores(tmp_path):
    with DiskTier(FP, tmp_path, 10 * ENTRY) as tier:
        tier.put(key(1), payload(1))
        name = tier.file_name(key(1))
    with DiskTier(FP_OTHER, tmp_path, 10 * ENTRY) as other:
        assert other.get(key(1)) is None  # namespaced by fingerprint: a plain miss
        # An entry planted under the other engine's name (copied dirs, format bump) is caught by the header.
        os.replace(tmp_path / name, tmp_path / other.file_name(key(1)))
    with DiskTier(FP_OTHER, tmp_path, 10 * ENTRY) as other:
        assert other.get(key(1)) is None
        s = other.stats()
        assert (s.incompatible, s.misses, s.hits) == (1, 1, 0)


def test_disk_directory_is_exclusive_and_crash_leftovers_are_removed(tmp_path):
    with DiskTier(FP, tmp_path, 10 * ENTRY):
        with pytest.raises(ConfigError, match="in use by another kvserve process"):
            DiskTier(FP, tmp_path, 10 * ENTRY)
    (tmp_path / ".x.kvb.1.2.tmp").write_bytes(b"half a block")
    with DiskTier(FP, tmp_path, 10 * ENTRY) as tier:
        assert tier.usage().num_entries == 0
        assert not (tmp_path / ".x.kvb.1.2.tmp").exists()


def test_disk_bad_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--kv-disk-path"):
        DiskTier(FP, blocker / "sub", 10 * ENTRY)


# ---------------------------------------------------------------- redis tier

def test_full_redis_refuses_puts_but_stays_readable(redis_server):
    """OOM under maxmemory/noeviction is Redis refusing a SET, not Redis down: reads go on, and
    no outage is declared (it used to flap "unavailable" / "reachable again" every second)."""
    import redis
    raw = redis.Redis.from_url(redis_server.url)
    with RedisTier(FP, redis_server.url) as tier:
        assert tier.put(key(1), payload(1))
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 1024)
        try:
            assert not tier.put(key(2), b"x" * (1 << 20))  # refused: no room
            assert tier.available and bytes(tier.get(key(1))) == payload(1)
        finally:
            raw.config_set("maxmemory", 0)
        assert tier.put(key(2), payload(2))


def test_bad_redis_url_parts_are_config_errors():
    for url in ("redis://127.0.0.1:notaport", "redis://127.0.0.1:99999", "redis://127.0.0.1:1/abc"):
        with pytest.raises(ConfigError, match="--kv-redis-url"):
            RedisTier(FP, url)


def test_out_of_range_database_is_a_config_error(redis_server):
    with pytest.raises(ConfigError, match="Redis refused the connection"):
        RedisTier(FP, redis_server.url.rsplit("/", 1)[0] + "/99")


def test_redis_round_trip_shared_between_engines(redis_server):
    import redis
    with RedisTier(FP, redis_server.url, ttl_seconds=60) as tier:
        assert tier.get(key(1)) is None
        assert tier.put(key(1), payload(1)) and tier.put(key(2), payload(2))
        assert bytes(tier.get(key(1))) == payload(1) and tier.contains(key(2))
        got = tier.get_many([key(1), key(3), key(2)])
        assert [None if g is None else bytes(g) for g in got] == [payload(1), None, payload(2)]
        raw = redis.Redis.from_url(redis_server.url)
        assert 0 < raw.pttl(tier.redis_key(key(1))) <= 60_000
        with RedisTier(FP, redis_server.url) as second_server:  # another process's view of the pool
            assert bytes(second_server.get(key(2))) == payload(2)
        with RedisTier(FP_OTHER, redis_server.url) as foreign:
            assert foreign.get(key(2)) is None
        assert tier.delete(key(2)) and not tier.contains(key(2))
        assert tier.usage().num_entries == 1
        s = tier.stats()
        assert (s.errors, s.puts) == (0, 2)
        raw.close()


def test_redis_corrupt_entry_is_a_counted_miss(redis_server):
    import redis
    with RedisTier(FP, redis_server.url) as tier:
        tier.put(key(1), payload(1))
        raw = redis.Redis.from_url(redis_server.url)
        value = bytearray(raw.get(tier.redis_key(key(1))))
        value[-1] ^= 0xFF
        raw.set(tier.redis_key(key(1)), bytes(value))
        assert tier.get(key(1)) is None
        assert tier.stats().corrupt == 1 and raw.exists(tier.redis_key(key(1))) == 0
        raw.close()


def test_redis_killed_mid_run_then_restarted(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.kv.tiers.redis_tier")
    tier = RedisTier(FP, redis_server.url, socket_timeout=0.2, backoff_initial=0.05, backoff_max=0.2)
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) is not None
    assert tier.usage().num_entries == 1
    redis_server.kill()
    for _ in range(20):  # the engine keeps calling at decode rate: misses, no exception, no stall
        assert tier.get(key(1)) is None
        assert tier.put(key(2), payload(2)) is False
        assert tier.contains(key(1)) is False
    s = tier.stats()
    assert s.misses == 20 and s.rejected == 20 and not tier.available
    # No stall: once down, the tier answers from its state and asks the backend again only after
    # its backoff, so most of the 60 calls never reach the dead server.
    assert 1 <= s.errors < 20
    assert tier.usage().num_entries == 1  # last known figures
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()

    redis_server.start()  # same port; the data is gone (no persistence), the service is back
    wait_until(lambda: tier.put(key(3), payload(3)), 5, what="a put to succeed once Redis is back")
    assert bytes(tier.get(key(3))) == payload(3) and tier.available
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    tier.close()


def test_redis_hung_server_times_out_then_recovers(redis_server):
    tier = RedisTier(FP, redis_server.url, socket_timeout=0.1, backoff_initial=0.05, backoff_max=0.1)
    tier.put(key(1), payload(1))
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # a Redis that accepts nothing and answers nothing
    try:
        got = []
        lookup = threading.Thread(target=lambda: got.append(tier.get(key(1))), daemon=True)
        lookup.start()
        lookup.join(30)  # bounded: a lookup that waits on the hung server never returns
        assert not lookup.is_alive(), "a hung Redis stalled the lookup instead of timing out"
        assert got == [None] and tier.stats().errors == 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    wait_until(lambda: tier.get(key(1)) is not None, 5, what="Redis back after SIGCONT")
    assert bytes(tier.get(key(1))) == payload(1)
    tier.close()


def test_redis_down_at_start_and_bad_url():
    with pytest.raises(ConfigError, match="--kv-redis-url"):
        RedisTier(FP, "http://localhost:6379")
    from helpers import free_port
    tier = RedisTier(FP, f"redis://127.0.0.1:{free_port()}/0", backoff_initial=10)
    assert not tier.available and tier.get(key(1)) is None and tier.stats().errors == 1
    tier.close()


# ---------------------------------------------------------------- async writer

def test_writer_writes_down_all_tiers(tmp_path):
    host = HostTier(FP, 100 * ENTRY)
    disk = DiskTier(FP, tmp_path, 100 * ENTRY)
    writer = AsyncWriter([host, disk])
    for i in range(20):
        assert writer.submit(key(i), payload(i))
    assert writer.flush(timeout=10)
    assert all(bytes(host.get(key(i))) == payload(i) and bytes(disk.get(key(i))) == payload(i) for i in range(20))
    s = writer.stats()
    assert (s.submitted, s.written, s.dropped, s.queued) == (20, 20, 0, 0)
    writer.close()
    disk.close()


def test_writer_drops_when_full_instead_of_blocking():
    host = HostTier(FP, 100 * ENTRY)
    writer = AsyncWriter([host], max_queue_bytes=2500)
    with host._lock:  # a stalled backend: the writer thread blocks inside its first put
        writer.submit(key(0), payload(0))
        wait_until(lambda: not writer.stats().queued, 5, interval=0.001, what="the writer to take its first entry")
        accepted = []
        submitter = threading.Thread(target=lambda: accepted.extend(writer.submit(key(i), payload(i))
                                                                    for i in range(1, 6)), daemon=True)
        submitter.start()
        submitter.join(30)  # bounded: a submit that waited for the stalled backend would never return
        assert not submitter.is_alive(), "submit blocked on a full queue instead of dropping"
        assert accepted == [True, True, False, False, False]
        assert bytes(writer.pending(key(0))) == payload(0) and bytes(writer.pending(key(2))) == payload(2)
        assert writer.pending(key(5)) is None
    assert writer.flush(timeout=10)
    assert writer.stats().dropped == 3 and host.usage().num_entries == 3
    assert writer.pending(key(2)) is None and bytes(host.get(key(2))) == payload(2)
    writer.close()
    assert not writer.submit(key(9), payload(9)) and writer.stats().dropped == 4


def test_entry_that_does_not_decode_is_a_miss_and_deleted(tmp_path, caplog):
    """A checksummed entry in another layout: a miss, deleted (so it is not re-read on every
    lookup), and logged once rather than once per block per lookup."""
    from kvserve.kv.tiers.chain import TierChain
    with DiskTier(FP, tmp_path, 1 << 24) as disk:
        for i in range(3):
            assert disk.put(key(i), payload(i))
        chain = TierChain(None, [disk])

        def decode(view):
            raise ValueError("block layout differs")
        chain.decode = decode
        with caplog.at_level("WARNING"):
            assert chain.fetch([key(0), key(1), key(2)], [[0], [1], [2]]) == []
        assert chain.stats.decode_failures == 3 and not any(disk.contains(key(i)) for i in range(3))
        assert sum("does not fit this engine's KV layout" in r.message for r in caplog.records) == 1


def test_full_filesystem_turns_the_disk_cap_down(tmp_path, monkeypatch):
    """ENOSPC before --kv-disk-size is reached: the tier keeps what it has as its new cap and
    evicts its coldest blocks from then on (it used to fail every later write)."""
    import builtins
    import errno as errno_mod

    from kvserve.kv.tiers import disk as disk_mod
    real_open = builtins.open

    def small_fs_open(path, mode="r", *args, **kwargs):  # a filesystem with room for 3 blocks
        if "w" in mode and sum(n.endswith(".kvb") for n in os.listdir(tmp_path)) >= 3:
            raise OSError(errno_mod.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk_mod, "open", small_fs_open, raising=False)
    with DiskTier(FP, tmp_path, 100 * ENTRY) as tier:
        assert all(tier.put(key(i), payload(i)) for i in range(5))
        assert tier.usage().capacity_bytes < 4 * ENTRY
        assert [tier.contains(key(i)) for i in range(5)] == [False, False, True, True, True]
