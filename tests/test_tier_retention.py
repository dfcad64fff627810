"""The offload tiers follow the retention priorities: what a full tier drops first (lowest priority,
LRU within one, past-expiry entries below all), what is written down at all
(--kv-offload-min-priority), and the retention carried in each entry's header.

Torch-free where it can be: the scheduler and KV manager run with the cost-model runner, and a
small fake transfer puts each evicted block's token ids into the real tiers.
"""
from __future__ import annotations

import itertools
import math
import os
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import ConfigError, EngineArgs, SchedulerConfig
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiers import AsyncWriter, DiskTier, EngineFingerprint, HostTier
from kvserve.kv.tiers.base import frame_header, frame_retention, frame_size
from kvserve.kv.tiers.chain import TierChain
from kvserve.kv.tiers.order import LOWEST, Retention, RetentionOrder
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner

FP = EngineFingerprint(model="m", kv_cache_dtype="bfloat16", block_size=4, num_layers=2, num_kv_heads=1,
                       head_dim=8)
PAYLOAD = 256
ENTRY = frame_size(b"k" * 32, PAYLOAD)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(PAYLOAD))


class Clock:
    def __init__(self, t: float = 1e9) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- the order itself -------------------------------------------------------------------------
order_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 9), st.sampled_from([LOWEST, 10, 50, 90]),
              st.one_of(st.none(), st.floats(0, 20))),
    st.tuples(st.just("touch"), st.integers(0, 9)),
    st.tuples(st.just("pop"), st.integers(0, 9)),
    st.tuples(st.just("victim")),
    st.tuples(st.just("tick"), st.floats(0, 10)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=order_ops)
def test_order_is_expired_first_then_priority_then_recency(ops):
    """Against a reference: entries past their expiry first (earliest expiry first), then lowest
    priority, least recently used first within one; a re-put keeps the higher unexpired priority."""
    clock = Clock()
    order = RetentionOrder(clock)
    model: dict[bytes, list] = {}  # key -> [priority, expires, last use]
    uses = itertools.count()

    def expected() -> list[bytes]:
        now = clock.t
        expired = sorted((m[1], k) for k, m in model.items() if m[1] <= now)
        live = sorted((m[0], m[2], k) for k, m in model.items() if m[1] > now)
        return [k for _, k in expired] + [k for *_, k in live]

    for op in ops:
        if op[0] == "add":
            _, i, p, ttl = op
            expires = math.inf if ttl is None else clock.t + ttl
            old = model.get(key(i))
            if old is not None:
                if old[0] > p and old[1] > clock.t:
                    p, expires = old[0], old[1]
                elif old[0] == p:
                    expires = max(expires, old[1])
            model[key(i)] = [p, expires, next(uses)]
            order.add(key(i), 1, Retention(p, expires))
        elif op[0] == "touch" and key(op[1]) in model:
            model[key(op[1])][2] = next(uses)
            order.touch(key(op[1]))
        elif op[0] == "pop":
            assert (order.pop(key(op[1])) is not None) == (model.pop(key(op[1]), None) is not None)
        elif op[0] == "victim" and model:
            victim = order.pop_victim()[0]
            want = expected()[0]
            # Equal expiries are a tie the order may break either way.
            assert victim == want or model[victim][1] == model[want][1] <= clock.t
            del model[victim]
        elif op[0] == "tick":
            clock.t += op[1]
        assert len(order) == len(model)
        got = order.ordered()
        assert sorted(got) == sorted(model)
        assert [model[k][1] <= clock.t for k in got] == [model[k][1] <= clock.t for k in expected()]
        assert [k for k in got if model[k][1] > clock.t] == [k for k in expected() if model[k][1] > clock.t]


# -- host and disk tiers ----------------------------------------------------------------------
def tiers(kind: str, tmp_path, entries: int):
    if kind == "host":
        return HostTier(FP, entries * ENTRY)
    return DiskTier(FP, tmp_path / "disk", entries * ENTRY)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_full_tier_drops_low_priority_first_then_lru(kind, tmp_path):
    with tiers(kind, tmp_path, 4) as tier:
        tier.put(key(0), payload(0), retention=Retention(90))
        tier.put(key(1), payload(1), retention=Retention(10))
        tier.put(key(2), payload(2), retention=Retention(10))
        tier.put(key(3), payload(3), retention=Retention(50))
        assert tier.get(key(1)) is not None  # 1 is now the more recent of the two at 10
        tier.put(key(4), payload(4), retention=Retention(50))
        assert not tier.contains(key(2))
        tier.put(key(5), payload(5), retention=Retention(50))
        assert not tier.contains(key(1))
        tier.put(key(6), payload(6), retention=Retention(50))  # now the oldest 50 goes
        assert not tier.contains(key(3))
        assert all(tier.contains(key(i)) for i in (0, 4, 5, 6))
        assert tier.stats().evictions == 3


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_high_priority_entry_survives_a_flood_of_low_priority_ones(kind, tmp_path):
    with tiers(kind, tmp_path, 4) as tier:
        tier.put(key(0), payload(0), retention=Retention(90))
        for i in range(1, 40):
            assert tier.put(key(i), payload(i), retention=Retention(10))
        assert bytes(tier.get(key(0))) == payload(0)
        assert tier.usage().num_entries == 4


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_expired_entries_go_before_any_priority(kind, tmp_path):
    with tiers(kind, tmp_path, 3) as tier:
        tier.put(key(0), payload(0), retention=Retention(90, time.time() - 1))  # already past
        tier.put(key(1), payload(1), retention=Retention(10))
        tier.put(key(2), payload(2), retention=Retention(90, time.time() + 3600))
        tier.put(key(3), payload(3), retention=Retention(10))
        assert not tier.contains(key(0))
        assert tier.contains(key(2)) and tier.contains(key(1))


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_re_put_keeps_the_higher_priority(kind, tmp_path):
    with tiers(kind, tmp_path, 2) as tier:
        tier.put(key(0), payload(0), retention=Retention(90))
        tier.put(key(0), payload(0), retention=Retention(10))  # a second user at 10: still 90
        tier.put(key(1), payload(1), retention=Retention(50))
        tier.put(key(2), payload(2), retention=Retention(50))
        assert tier.contains(key(0)) and not tier.contains(key(1))
        assert tier.retention(key(0)).priority == 90


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_retain_raises_a_stored_entrys_priority(kind, tmp_path):
    """A block already below that the device evicts again at a higher priority (the offloader
    skips rewriting it) takes that priority in the tier's order."""
    with tiers(kind, tmp_path, 2) as tier:
        tier.put(key(0), payload(0), retention=Retention(10))
        tier.put(key(1), payload(1), retention=Retention(50))
        assert tier.retain(key(0), Retention(90)) and not tier.retain(key(7), Retention(90))
        tier.put(key(2), payload(2), retention=Retention(50))
        assert tier.contains(key(0)) and not tier.contains(key(1))


def test_frame_header_carries_the_retention():
    r = Retention(77, 1.5e9)
    head = frame_header(FP.digest, key(1), payload(1), retention=r)
    assert frame_retention(FP.digest, head) == r
    assert frame_retention(FP.digest, frame_header(FP.digest, key(1), payload(1))) == Retention(50, math.inf)


def test_disk_order_survives_a_restart_from_the_headers(tmp_path):
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:
        tier.put(key(0), payload(0), retention=Retention(90))
        tier.put(key(1), payload(1), retention=Retention(10))
        tier.put(key(2), payload(2), retention=Retention(10))
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:
        assert tier.retention(key(0)) == Retention(90)
        tier.put(key(3), payload(3), retention=Retention(10))
        tier.put(key(4), payload(4), retention=Retention(10))
        assert tier.contains(key(0)) and not tier.contains(key(1)) and not tier.contains(key(2))


def test_disk_entries_of_an_older_format_are_dropped_first_and_never_read(tmp_path):
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:
        tier.put(key(0), payload(0), retention=Retention(10))
        tier.put(key(1), payload(1), retention=Retention(10))
    # What a format-2 engine left: another fingerprint prefix (the digest covers the version), a
    # version-2 header. Written last, so the most recent by mtime.
    old = bytearray(ENTRY)
    struct.pack_into("<4sH", old, 0, b"KVT1", 2)
    path = tmp_path / f"{'ab' * 16}-{key(9).hex()}.kvb"
    path.write_bytes(bytes(old))
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    with DiskTier(FP, tmp_path, 3 * ENTRY) as tier:
        assert tier.usage().num_entries == 3
        assert tier.put(key(2), payload(2), retention=Retention(10))
        assert not path.exists()  # the old entry went first, though it was the most recent
        assert all(tier.contains(key(i)) for i in range(3))


# -- through the scheduler: the device pool's evictions carry their retention down ------------
VOCAB = 4
BS = 4


class Transfer:
    """The runner side of offload, without tensors: each evicted block's payload is its tokens."""

    def __init__(self, chain: TierChain) -> None:
        self.chain = chain
        chain.decode = lambda p: (tuple(bytes(p).rstrip(b"\xff")), p)

    def apply(self, out) -> None:
        for o in out.kv_offloads:
            assert not o.held
            payload, retention = bytes(o.token_ids).ljust(PAYLOAD, b"\xff"), Retention(o.priority, o.expires)
            if self.chain.host is not None:
                self.chain.host.put(o.key, payload, o.token_ids, retention)
            if self.chain.writer is not None:
                self.chain.writer.submit(o.key, payload, o.token_ids, retention)
                self.chain.writer.flush(10)


def make(host_entries: int, min_priority: int = 0, disk_path=None):
    if disk_path is None:
        chain = TierChain(HostTier(FP, host_entries * ENTRY))
    else:
        disk = DiskTier(FP, disk_path, host_entries * ENTRY)
        chain = TierChain(None, [disk], AsyncWriter([disk]))
    kv = KVCacheManager(12, BS, enable_caching=True, tiers=chain, offload_min_priority=min_priority)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48), kv)
    return sched, CostModelRunner(vocab_size=VOCAB), Transfer(chain), chain


def run(sched, runner, transfer, reqs) -> None:
    for r in reqs:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        transfer.apply(out)
        sched.update_from_output(out, runner.execute(out))
        sched.kv.check_integrity()
    raise AssertionError("requests never finished")


SYSTEM = [3, 1, 2, 0] * 3  # three full blocks


def flood(n: int, priority: int | None):
    """Unique prompts that need the whole device pool each (45 tokens + 1 = 12 blocks of 4)."""
    ret = None if priority is None else {"priority": priority}
    return [Request(f"f{i}", [4 + (i >> s) % VOCAB for s in range(0, 12, 2)] * 7 + [0, 1, 2],
                    SamplingParams(max_tokens=1, ignore_eos=True, cache_retention=ret)) for i in range(n)]


def premium(rid: str, retention):
    return Request(rid, SYSTEM + [1], SamplingParams(max_tokens=1, ignore_eos=True, cache_retention=retention))


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("retained", [True, False])
def test_device_evicted_premium_prefix_survives_in_the_tier(retained, kind, tmp_path):
    """The flood overflows the device pool and the tier many times; with priorities the premium
    prefix written down from the device stays in the tier and is found there."""
    sched, runner, transfer, chain = make(host_entries=6, disk_path=tmp_path / "disk" if kind == "disk" else None)
    try:
        p0 = premium("p0", {"priority": 90} if retained else None)
        run(sched, runner, transfer, [p0])
        run(sched, runner, transfer, flood(40, 10 if retained else None))
        keys = p0.block_hashes[:3]
        assert not any(sched.kv.pool.lookup(k) for k in keys)  # the flood pushed it off the device
        tier = chain.tiers[0]
        assert tier.stats().evictions > 20
        hit = sched.kv.get_computed_blocks(premium("p1", None))
        if retained:
            assert all(tier.contains(k) for k in keys)
            assert hit.num_tokens == len(SYSTEM) and len(hit.restored) == 3  # from the tier
            assert {f.tier for f in hit.restored} == {kind}
        else:
            assert hit.num_tokens == 0
    finally:
        chain.close()


def test_blocks_below_the_min_priority_are_not_written_down():
    sched, runner, transfer, chain = make(host_entries=64, min_priority=50)
    run(sched, runner, transfer, [premium("p0", {"priority": 90})])
    run(sched, runner, transfer, flood(20, 10))
    retentions = [chain.host.retention(k) for k in list(chain.host._entries)]
    assert retentions and all(r.priority >= 50 for r in retentions)
    assert chain.stats.offload_below_priority > 0
    again = premium("p1", None)
    assert sched.kv.get_computed_blocks(again).num_tokens == len(SYSTEM)


def test_shutdown_write_back_follows_the_min_priority_too():
    sched, runner, transfer, chain = make(host_entries=64, min_priority=50)
    run(sched, runner, transfer, [premium("p0", {"priority": 90})])
    run(sched, runner, transfer, [Request("lo", [5, 6, 7, 4] * 2 + [5], SamplingParams(
        max_tokens=1, ignore_eos=True, cache_retention={"priority": 10}))])
    kept = sched.kv.cached_blocks()
    assert len(kept) == 3 and all(o.priority == 90 for o in kept)  # lo's two cached blocks stay out


def test_blocks_past_their_ttl_are_not_written_down():
    clock = Clock(100.0)
    chain = TierChain(HostTier(FP, 64 * ENTRY))
    kv = KVCacheManager(12, BS, enable_caching=True, tiers=chain, clock=clock)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48), kv)
    runner, transfer = CostModelRunner(vocab_size=VOCAB), Transfer(chain)
    run(sched, runner, transfer, [premium("p0", {"priority": 90, "ttl_s": 5})])
    clock.t += 10
    run(sched, runner, transfer, flood(20, None))
    assert all(chain.host.retention(k).expires == math.inf for k in chain.host._entries)
    assert chain.stats.offload_below_priority >= 3


def test_written_down_blocks_carry_a_wall_clock_expiry():
    clock = Clock(100.0)
    chain = TierChain(HostTier(FP, 64 * ENTRY))
    kv = KVCacheManager(12, BS, enable_caching=True, tiers=chain, clock=clock)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48), kv)
    runner, transfer = CostModelRunner(vocab_size=VOCAB), Transfer(chain)
    run(sched, runner, transfer, [premium("p0", {"priority": 90, "ttl_s": 600})])
    before = time.time()
    run(sched, runner, transfer, flood(20, None))
    got = [r for r in (chain.host.retention(k) for k in chain.host._entries) if r.priority == 90]
    assert len(got) == 3 and all(before + 590 < r.expires < time.time() + 601 for r in got)


def test_min_priority_flag_range_is_checked():
    with pytest.raises(ConfigError, match="--kv-offload-min-priority"):
        EngineArgs(model="x", kv_offload_min_priority=101).validate()


# -- Redis: the expiry becomes a Redis TTL --------------------------------------------------------
def test_redis_entries_expire_with_their_retention(redis_server):
    from kvserve.kv.tiers.redis_tier import RedisTier
    with RedisTier(FP, redis_server.url, ttl_seconds=3600) as tier:
        assert tier.put(key(1), payload(1), retention=Retention(90, time.time() + 60))
        assert tier.put(key(2), payload(2), retention=Retention(90))
        assert not tier.put(key(3), payload(3), retention=Retention(90, time.time() - 1))  # already past
        client = tier._client
        assert 55_000 < client.pttl(tier.redis_key(key(1))) <= 60_000
        assert 3_590_000 < client.pttl(tier.redis_key(key(2))) <= 3_600_000  # the tier's own TTL
        assert not tier.contains(key(3))
        assert bytes(tier.get(key(1))) == payload(1)


# -- the engine: the runner-side transfer writes the retention down -------------------------------
@pytest.mark.parametrize("retained", [True, False])
def test_engine_host_tier_keeps_the_premium_prefix_through_a_flood(tiny, retained):
    """The real offloader: a premium prompt (priority 90), then one-off prompts (10) that each need
    the whole device pool (40 blocks of 16), so the premium blocks go down too, and that overflow
    the host tier (17 entries of this model's blocks) many times."""
    import random

    from helpers import greedy
    from kv_cases import SMALL

    from kvserve import LLM
    rng = random.Random(0)
    system = [rng.randrange(1, 250) for _ in range(100)]  # 6 full blocks of 16
    hi, lo = ({"priority": 90}, {"priority": 10}) if retained else (None, None)
    llm = LLM(tiny, **SMALL, swap_space=0.0002)
    try:
        host = llm.engine.kv_tiers.host
        llm.generate([system + [1]], greedy(2, cache_retention=hi), use_tqdm=False)
        for _ in range(8):
            llm.generate([[rng.randrange(1, 250) for _ in range(630)]], greedy(2, cache_retention=lo),
                         use_tqdm=False)
        assert host.stats().evictions > 20
        again = llm.generate([system + [2]], greedy(2), use_tqdm=False)[0]
        restored = llm.engine.get_stats().kv_restored_blocks
        if retained:
            assert again.num_cached_tokens >= 96 and restored == 6
            assert sorted({host.retention(k).priority for k in host._entries}) == [10, 90]
        else:
            assert again.num_cached_tokens < 16
    finally:
        llm.engine.close()
