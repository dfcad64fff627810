"""The offload tiers wired into the engine: output equals the no-tier engine and transformers token
for token while blocks travel host / disk / Redis, and every fault is a counted miss.

The device pool is kept small (num_gpu_blocks_override) so the workloads' working set is several
times the pool: prefixes are evicted, written down, and restored on the next turn.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from helpers import closed_port, greedy
from hf_reference import hf_greedy, load_hf
from kv_cases import BS, POOL, SMALL, documents_workload
from redis_server import RedisServer
from tiny_models import make_tiny_model

from kvserve import LLM, SamplingParams

GEN = 6


class Reference:
    """transformers' greedy output per prompt, computed once per prompt."""

    def __init__(self, hf):
        self.hf, self.memo = hf, {}

    def __call__(self, prompt, n=GEN):
        key = (tuple(prompt), n)
        if key not in self.memo:
            self.memo[key] = hf_greedy(self.hf, prompt, n)
        return self.memo[key]


@pytest.fixture(scope="module")
def ref(tiny_hf):
    return Reference(tiny_hf)


def run_chats(llm, ref, seed, num_chats=3, turns=3, vocab=256):
    """Multi-turn chats: each turn resends the whole history plus the answer and a new message."""
    rng = random.Random(seed)
    histories = [[rng.randrange(vocab) for _ in range(150)] for _ in range(num_chats)]
    for _ in range(turns):
        outs = llm.generate(histories, greedy(GEN), use_tqdm=False)
        for h, o in zip(histories, outs):
            assert o.outputs[0].token_ids == ref(h), f"chat of {len(h)} tokens diverged"
        histories = [h + o.outputs[0].token_ids + [rng.randrange(vocab) for _ in range(25)]
                     for h, o in zip(histories, outs)]


def run_documents(llm, ref, seed):
    for batch in documents_workload(seed):
        for prompt in batch:  # one at a time: the working set passes through the small pool
            out = llm.generate([prompt], greedy(GEN), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == ref(prompt), f"prompt of {len(prompt)} tokens diverged"
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0


def tier_configs(tmp_path, redis_url):
    return {
        "host": dict(swap_space=0.01),
        "disk": dict(kv_disk_path=str(tmp_path / "disk"), kv_disk_size="64MiB"),
        "redis": dict(kv_redis_url=redis_url),
    }


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_working_set_4x_pool_matches_reference(tiny, ref, tmp_path, redis_server, tier):
    path = tiny
    redis_server_flush(redis_server)
    llm = LLM(path, **SMALL, **tier_configs(tmp_path, redis_server.url)[tier])
    try:
        run_documents(llm, ref, seed=1)
        run_chats(llm, ref, seed=2)
        s = llm.engine.get_stats()
        assert s.num_cached_block_evictions >= 4 * POOL  # the working set really exceeded the pool
        assert s.tier_hits[tier] > 0, s.tier_hits
        assert s.kv_restored_blocks > 0 and s.kv_offloaded_blocks > 0
        assert s.tier_bytes_written[tier] > 0 and s.tier_bytes_read[tier] > 0
        assert s.tier_corrupt[tier] == 0 and s.tier_errors[tier] == 0
    finally:
        llm.engine.close()


def test_no_tier_engine_agrees_and_misses_what_tiers_hit(tiny, ref, tmp_path):
    """The same workload without tiers: same tokens, but prefixes evicted from the pool are
    recomputed (fewer cached tokens than with a host tier)."""
    path = tiny
    plain = LLM(path, **SMALL)
    run_documents(plain, ref, seed=1)
    tiered = LLM(path, **SMALL, swap_space=0.01)
    run_documents(tiered, ref, seed=1)
    a, b = plain.engine.get_stats(), tiered.engine.get_stats()
    assert b.prefix_cache_hits > a.prefix_cache_hits
    assert b.prefix_cache_hits - a.prefix_cache_hits <= b.tier_hits["host"]


def test_all_tiers_together_and_host_overflow_to_disk(tiny, ref, tmp_path, redis_server):
    """A host tier far smaller than the working set: what it evicts is still found on disk."""
    path = tiny
    redis_server_flush(redis_server)
    llm = LLM(path, **SMALL, swap_space=0.0002, kv_disk_path=str(tmp_path / "d"),
              kv_redis_url=redis_server.url)
    try:
        docs = documents_workload(seed=3)
        for batch in (docs[0], docs[1][::-1]):  # back in reverse: recent evictions are in host
            for prompt in batch:
                assert llm.generate([prompt], greedy(GEN), use_tqdm=False)[0].outputs[0].token_ids == ref(prompt)
        s = llm.engine.get_stats()
        assert s.tier_hits["host"] > 0 and s.tier_hits["disk"] > 0, s.tier_hits
        assert 0 < s.host_tier_usage <= 1.0
    finally:
        llm.engine.close()


def test_disk_tier_persists_across_restart(tiny, ref, tmp_path):
    path = tiny
    disk = dict(kv_disk_path=str(tmp_path / "kv"), kv_disk_size="64MiB")
    prompts = documents_workload(seed=4)[0]
    first = LLM(path, **SMALL, **disk)
    outs = first.generate(prompts, greedy(GEN), use_tqdm=False)
    # Force everything out of the device pool so the blocks are written to disk.
    filler = documents_workload(seed=5)[0]
    first.generate(filler, greedy(GEN), use_tqdm=False)
    first.engine.close()
    assert any(n.endswith(".kvb") for n in os.listdir(tmp_path / "kv"))

    second = LLM(path, **SMALL, **disk)  # a "restarted server": empty device pool, same directory
    try:
        again = second.generate(prompts, greedy(GEN), use_tqdm=False)
        for p, a, b in zip(prompts, outs, again):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref(p)
        assert all(o.num_cached_tokens >= 320 for o in again), [o.num_cached_tokens for o in again]
        assert second.engine.get_stats().tier_hits["disk"] >= 4 * 320
    finally:
        second.engine.close()


def test_blocks_still_on_device_are_written_down_at_shutdown(tiny, ref, tmp_path):
    """No eviction before close(): the prompts' blocks are all still in the device pool, and
    close() (the server's shutdown) hands them to disk, so the restarted engine hits them."""
    path = tiny
    disk = dict(kv_disk_path=str(tmp_path / "kv"), kv_disk_size="64MiB")
    prompts = documents_workload(seed=4)[0][:1]
    first = LLM(path, **SMALL, **disk)
    outs = first.generate(prompts, greedy(GEN), use_tqdm=False)
    assert first.engine.get_stats().kv_offloaded_blocks == 0  # nothing was evicted
    first.engine.close()
    first.engine.close()  # idempotent
    second = LLM(path, **SMALL, **disk)
    try:
        again = second.generate(prompts, greedy(GEN), use_tqdm=False)
        for p, a, b in zip(prompts, outs, again):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref(p)
        assert second.engine.get_stats().tier_hits["disk"] >= 320
    finally:
        second.engine.close()


def test_shutdown_says_what_an_unreachable_tier_did_not_store(tiny, caplog):
    """Redis down for the whole run: the write-back at shutdown must not report blocks as written."""
    import logging
    path = tiny
    with closed_port() as port:  # nothing listens there for the whole run
        llm = LLM(path, **SMALL, kv_redis_url=f"redis://127.0.0.1:{port}")
        llm.generate(documents_workload(seed=4)[0][:1], greedy(GEN), use_tqdm=False)
        with caplog.at_level(logging.INFO, logger="kvserve.engine.engine"):
            llm.engine.close()
    said = [r.getMessage() for r in caplog.records if "shutdown:" in r.getMessage()]
    assert len(said) == 1 and "the redis tier refused" in said[0] and "recompute" in said[0], said
    assert caplog.records[-1].levelname == "WARNING"


def test_blocks_read_from_disk_are_not_written_again(tiny, ref, tmp_path):
    """A restarted engine that restored a prompt's blocks from disk knows disk has them: its
    shutdown writes only the blocks computed since (the generated tokens' ones), not those."""
    path = tiny
    disk = dict(kv_disk_path=str(tmp_path / "kv"), kv_disk_size="64MiB")
    prompts = documents_workload(seed=4)[0][:1]
    first = LLM(path, **SMALL, **disk)
    first.generate(prompts, greedy(GEN), use_tqdm=False)
    first.engine.close()
    written_first = first.engine.kv_tiers.lower[0].stats().puts
    second = LLM(path, **SMALL, **disk)
    second.generate(prompts, greedy(GEN), use_tqdm=False)
    restored = second.engine.get_stats().tier_hits["disk"] // BS  # tokens -> blocks
    assert restored >= 20
    second.engine.close()
    written_second = second.engine.kv_tiers.lower[0].stats().puts
    assert written_second <= written_first - restored  # without the change: written_second == written_first


@pytest.mark.slow
def test_an_engine_never_closed_writes_its_blocks_at_exit(tiny, ref, tmp_path):
    """An offline script that never calls close(): its cached blocks reach disk at interpreter exit."""
    import subprocess
    import sys
    path = tiny
    disk = dict(kv_disk_path=str(tmp_path / "kv"), kv_disk_size="64MiB")
    prompt = documents_workload(seed=4)[0][0]
    script = (f"from kvserve import LLM, SamplingParams\n"
              f"llm = LLM({path!r}, **{SMALL!r}, **{disk!r})\n"
              f"llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens={GEN}), use_tqdm=False)\n")
    src = str(Path(__file__).resolve().parents[1] / "src")  # the checkout's code, never an installed copy
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, env=env)
    second = LLM(path, **SMALL, **disk)
    try:
        out = second.generate([prompt], greedy(GEN), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref(prompt)
        assert second.engine.get_stats().tier_hits["disk"] >= 320
    finally:
        second.engine.close()


def test_redis_shared_between_two_engines(tiny, ref, redis_server):
    path = tiny
    redis_server_flush(redis_server)
    prompts = documents_workload(seed=6)[0]
    a = LLM(path, **SMALL, kv_redis_url=redis_server.url)
    b = LLM(path, **SMALL, kv_redis_url=redis_server.url)
    try:
        a.generate(prompts, greedy(GEN), use_tqdm=False)
        a.generate(documents_workload(seed=7)[0], greedy(GEN), use_tqdm=False)  # evict -> written down
        a.engine.kv_tiers.flush(10)
        outs = b.generate(prompts, greedy(GEN), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == ref(p)
        s = b.engine.get_stats()
        assert s.tier_hits["redis"] >= 4 * 320, s.tier_hits
    finally:
        a.engine.close()
        b.engine.close()


def test_blocks_lost_below_are_written_again(tiny, ref, redis_server):
    """A block the engine had written to Redis, then lost there (FLUSHALL, eviction), used to be
    skipped on every later eviction as "already stored": its prefix stayed a miss for good."""
    path = tiny
    redis_server_flush(redis_server)
    prompts, filler = documents_workload(seed=12)[0], documents_workload(seed=13)[0]
    a = LLM(path, **SMALL, kv_redis_url=redis_server.url)
    b = LLM(path, **SMALL, kv_redis_url=redis_server.url)
    try:
        for _ in range(2):  # the second round runs after Redis lost everything
            a.generate(prompts, greedy(GEN), use_tqdm=False)
            a.generate(filler, greedy(GEN), use_tqdm=False)  # evict -> written down
            a.engine.kv_tiers.flush(10)
            if _ == 0:
                redis_server_flush(redis_server)
        outs = b.generate(prompts, greedy(GEN), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == ref(p)
        assert b.engine.get_stats().tier_hits["redis"] >= 4 * 320
    finally:
        a.engine.close()
        b.engine.close()


@pytest.mark.slow
def test_redis_killed_mid_run_then_back(tiny, ref):
    path = tiny
    server = RedisServer().start()
    llm = LLM(path, **SMALL, kv_redis_url=server.url)
    try:
        batches = documents_workload(seed=8)
        for prompt in batches[0]:
            assert llm.generate([prompt], greedy(GEN), use_tqdm=False)[0].outputs[0].token_ids == ref(prompt)
        server.kill()
        for prompt in batches[1]:  # Redis gone: served by recompute, no crash, no wrong token
            assert llm.generate([prompt], greedy(GEN), use_tqdm=False)[0].outputs[0].token_ids == ref(prompt)
        llm.engine.kv_tiers.flush(10)
        s = llm.engine.get_stats()
        assert s.tier_errors["redis"] > 0
        server.start()  # same port, empty
        tier = llm.engine.kv_tiers.lower[0]
        tier._retry_at = 0.0  # skip the rest of the backoff instead of sleeping through it
        run_documents(llm, ref, seed=9)
        llm.engine.kv_tiers.flush(10)
        assert tier.available
        assert llm.engine.get_stats().tier_hits["redis"] > 0  # reconnected and serving again
    finally:
        llm.engine.close()
        server.close()


def test_corrupt_and_incompatible_disk_entries_are_counted_misses(tiny, ref, tmp_path):
    path = tiny
    disk_dir = tmp_path / "kv"
    disk = dict(kv_disk_path=str(disk_dir), kv_disk_size="64MiB")
    prompts = documents_workload(seed=10)[0]
    first = LLM(path, **SMALL, **disk)
    first.generate(prompts, greedy(GEN), use_tqdm=False)
    first.generate(documents_workload(seed=11)[0], greedy(GEN), use_tqdm=False)
    fingerprint = first.engine.setup.fingerprint.hex
    first.engine.close()
    # The first block of prompt 0 (root of its chain) corrupted in its payload, and prompt 1's
    # first block replaced by an entry another engine (another fingerprint) wrote.
    from kvserve.kv.hashing import extend_block_hashes, root_hash
    keys = [extend_block_hashes([], root_hash("auto"), p, BS)[0] for p in prompts[:2]]
    corrupt = disk_dir / f"{fingerprint}-{keys[0].hex()}.kvb"
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    foreign = disk_dir / f"{fingerprint}-{keys[1].hex()}.kvb"
    other_fp = "0" * len(fingerprint)
    blob = bytearray(foreign.read_bytes())
    blob[8:24] = bytes.fromhex(other_fp[:32])  # the frame header's fingerprint digest
    foreign.write_bytes(bytes(blob))

    second = LLM(path, **SMALL, **disk)
    try:
        outs = second.generate(prompts, greedy(GEN), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == ref(p)
        s = second.engine.get_stats()
        assert s.tier_corrupt["disk"] == 1 and s.tier_incompatible["disk"] == 1
        assert outs[0].num_cached_tokens < BS and outs[1].num_cached_tokens < BS  # chains start there
        assert s.tier_hits["disk"] >= 2 * 320  # the intact prompts still hit
        # Bad entries were dropped; a file there now is the block recomputed and evicted again.
        assert not corrupt.exists() or corrupt.read_bytes() != bytes(data)
        assert not foreign.exists() or foreign.read_bytes() != bytes(blob)
    finally:
        second.engine.close()


def test_incompatible_engine_never_restores(tiny, tmp_path, redis_server):
    """Another model (other weights) on the same Redis and directory: no hits, its own outputs."""
    path = tiny
    redis_server_flush(redis_server)
    other_path = make_tiny_model(tmp_path / "other", kind="llama_gqa", seed=1)
    other_hf = load_hf(other_path)
    tiers = dict(kv_redis_url=redis_server.url)
    prompts = documents_workload(seed=12)[0]
    a = LLM(path, **SMALL, **tiers)
    a.generate(prompts, greedy(GEN), use_tqdm=False)
    a.generate(documents_workload(seed=13)[0], greedy(GEN), use_tqdm=False)
    a.engine.kv_tiers.flush(10)
    a.engine.close()
    b = LLM(str(other_path), **SMALL, **tiers)
    try:
        assert b.engine.setup.fingerprint.hex != a.engine.setup.fingerprint.hex
        outs = b.generate(prompts, greedy(GEN), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(other_hf, p, GEN)
        assert b.engine.get_stats().tier_hits["redis"] == 0
    finally:
        b.engine.close()


def _swap_run(tiny, ref, seed: int, swap_space: float) -> LLM:
    """Six requests in a 14-block pool with swap preemption; greedy output checked against
    transformers. Returns the engine for the caller's assertions on how it got there."""
    path = tiny
    llm = LLM(path, dtype="float32", check_integrity=True, block_size=8, num_gpu_blocks_override=14,
              max_model_len=96, max_num_batched_tokens=64, preemption_mode="swap", swap_space=swap_space)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in [40, 33, 25, 50, 9, 44]]
    outs = llm.generate(prompts, greedy(30), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == ref(p, 30)
    return llm


def test_swap_preemption_matches_reference(tiny, ref):
    llm = _swap_run(tiny, ref, seed=3, swap_space=0.01)
    s = llm.engine.get_stats()
    assert s.num_preemptions > 0 and s.num_swapped_preemptions > 0
    assert s.tier_hits["host"] > 0 and s.resume_prefix_cache_hits > 0
    assert llm.engine.kv_tiers.host.held_bytes == 0  # every swapped request came back
    llm.engine.kv.check_integrity()


def test_swap_falls_back_to_recompute_when_host_is_full(tiny, ref):
    llm = _swap_run(tiny, ref, seed=4, swap_space=4000 / 2**30)  # room for about one block
    s = llm.engine.get_stats()
    assert s.num_preemptions > 0 and s.num_swap_fallbacks > 0


@pytest.mark.slow
def test_tier_flag_errors_name_the_flag(tiny, tmp_path):
    from kvserve.config import ConfigError
    path = tiny
    with pytest.raises(ConfigError, match="--kv-disk-size"):
        LLM(path, dtype="float32", kv_disk_path=str(tmp_path / "x"), kv_disk_size="lots")
    with pytest.raises(ConfigError, match="--preemption-mode swap.*--swap-space"):
        LLM(path, dtype="float32", preemption_mode="swap")
    with pytest.raises(ConfigError, match="--kv-redis-url"):
        LLM(path, dtype="float32", kv_redis_url="localhost:6379")
    with pytest.raises(ConfigError, match="--kv-disk-path '/proc': cannot create files there"):
        LLM(path, dtype="float32", kv_disk_path="/proc")
    with pytest.raises(ConfigError, match="--kv-disk-size: the disk KV tier .* cannot hold one block"):
        LLM(path, dtype="float32", kv_disk_path=str(tmp_path / "small"), kv_disk_size="1KiB")
    held = LLM(path, dtype="float32", kv_disk_path=str(tmp_path / "busy"), kv_cache_memory=8 * 2**20)
    try:
        with pytest.raises(ConfigError, match="in use by another kvserve process"):
            LLM(path, dtype="float32", kv_disk_path=str(tmp_path / "busy"), kv_cache_memory=8 * 2**20)
    finally:
        held.engine.close()


def redis_server_flush(server):
    import redis
    redis.Redis.from_url(server.url).flushall()


@pytest.mark.needs("avx512_bf16")
def test_bf16_kernel_layout_blocks_come_back_bit_exact(tmp_path):
    """bf16 on an AVX512-BF16 CPU keeps the cache in the varlen kernel's "pairs" layout. A
    prompt's blocks evicted to the host tier and restored give exactly the first run's tokens and
    logprobs: prefill runs in block-sized chunks, so the second run recomputes exactly the chunk
    the first run computed last, over K/V that must have come back bit for bit."""
    path = make_tiny_model(tmp_path, kind="llama_d64")
    llm = LLM(str(path), dtype="bfloat16", block_size=BS, num_gpu_blocks_override=12, max_model_len=192,
              max_num_batched_tokens=BS, swap_space=0.01, check_integrity=True)
    try:
        assert llm.engine.runner.kv_cache.layout == "pairs"
        rng = random.Random(5)
        prompt = [rng.randrange(256) for _ in range(40)]  # two whole blocks + 8 tokens
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        for _ in range(3):  # 10-block prompts push the first one's blocks out of the 12-block pool
            llm.generate([[rng.randrange(256) for _ in range(150)]], greedy(GEN), use_tqdm=False)
        hits = llm.engine.get_stats().tier_hits["host"]
        again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert llm.engine.get_stats().tier_hits["host"] >= hits + 2  # both whole blocks came back
        assert again.token_ids == first.token_ids
        assert again.logprobs == first.logprobs
        llm.engine.kv.check_integrity()
    finally:
        llm.engine.close()
