"""Cache retention: the priority eviction policy beside LRU (kv/eviction/), the request field
that feeds it (core/cache_retention.py), and its accounting.

The pool is checked against a reference model of the order (empty blocks first; then blocks past
their TTL; then lower priority first; least recently released first within each), with an
injected clock, and against LRU when no request gives a retention.
"""
from __future__ import annotations

import itertools
import math

import pytest
from helpers import sched_op, sched_run, sched_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.cache_retention import DEFAULT_PRIORITY, CacheRetention
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams, SamplingParamsError
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fill(pool: BlockPool, block, tag: int) -> None:
    pool.record_tokens(block, b"root", [tag] * pool.block_size)
    pool.cache_full_block(block, tag.to_bytes(8, "little"))


retentions = st.one_of(st.none(), st.builds(CacheRetention, st.integers(0, 100),
                                            st.one_of(st.none(), st.floats(0, 20))))
pool_ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("free"), st.integers(0, 99), retentions),
    st.tuples(st.just("touch"), st.integers(0, 99)),
    st.tuples(st.just("tick"), st.floats(0, 10)),
), min_size=1, max_size=80)


class Model:
    """The order by hand: what each allocate must hand out."""

    def __init__(self, n: int) -> None:
        self.empty = list(range(n))  # next out first
        self.cached: dict[int, tuple[int, float, int]] = {}  # id -> (priority, expires, seq)
        self.seq = itertools.count()

    def pop(self, now: float) -> int:
        if self.empty:
            return self.empty.pop(0)
        key = lambda i: (-1 if self.cached[i][1] <= now else self.cached[i][0], self.cached[i][2])  # noqa: E731
        victim = min(self.cached, key=key)
        del self.cached[victim]
        return victim


@settings(max_examples=200, deadline=None)
@given(ops=pool_ops, n=st.integers(2, 12), start_priority=st.booleans())
def test_eviction_order_is_priority_then_recency(ops, n, start_priority):
    clock = Clock()
    pool = BlockPool(n, 2, eviction_policy="priority" if start_priority else "lru", clock=clock)
    model = Model(n)
    held: list = []  # (block, holders) pairs, one entry per reference
    tags = itertools.count(1)
    shadow: dict[int, tuple[int, float]] = {}  # id -> (priority, expires) per the merge rule
    for op in ops:
        if op[0] == "alloc":
            for _ in range(op[1]):
                if pool.num_free_blocks == 0:
                    break
                expect = model.pop(clock.t) if pool.retained else None
                block = pool.allocate()
                if expect is not None:
                    assert block.block_id == expect
                else:  # still LRU: mirror what it did in the model
                    if block.block_id in model.empty:
                        model.empty.remove(block.block_id)
                    model.cached.pop(block.block_id, None)
                shadow.pop(block.block_id, None)
                if op[2]:
                    fill(pool, block, next(tags))
                held.append(block)
        elif op[0] == "free" and held:
            block = held.pop(op[1] % len(held))
            ret = op[2]
            was_retained = pool.retained
            pool.free([block], ret if ret is not None else CacheRetention())
            r = ret or CacheRetention()
            if pool.retained and not was_retained:  # the switch: what LRU cached so far is default
                shadow = {b.block_id: (DEFAULT_PRIORITY, math.inf) for b in pool.blocks
                          if b.ref_cnt == 0 and b.has_content and b is not block}
            if block.has_content and pool.retained:
                p, e = shadow.get(block.block_id, (-1, math.inf))
                ne = clock.t + r.ttl_s if r.ttl_s is not None else math.inf
                if r.priority > p or e <= clock.t:
                    p, e = r.priority, ne
                elif r.priority == p and ne > e:
                    e = ne
                shadow[block.block_id] = (p, e)
                assert (block.priority, block.expires) == (p, e)
            if block.ref_cnt == 0:
                if block.has_content:
                    model.cached[block.block_id] = (block.priority, block.expires, next(model.seq))
                else:
                    model.empty.insert(0, block.block_id)
        elif op[0] == "touch":
            cached = [b for b in pool.blocks if b.ref_cnt == 0 and b.has_content]
            if cached:
                block = cached[op[1] % len(cached)]
                pool.touch(block)
                model.cached.pop(block.block_id)
                held.append(block)
        elif op[0] == "tick":
            clock.t += op[1]
        if not pool.retained:  # LRU so far: every cached block is default, in release order
            model.cached = {i: (DEFAULT_PRIORITY, math.inf, s) for i, (_, _, s) in model.cached.items()}
        assert pool.num_free_blocks == len(model.empty) + len(model.cached)
        order = [b.block_id for b in pool.free_queue.ordered()]
        assert sorted(order) == sorted(model.empty + list(model.cached))


@settings(max_examples=150, deadline=None)
@given(ops=pool_ops, n=st.integers(2, 12))
def test_default_retention_is_lru_exactly(ops, n):
    """Requests without a retention: the priority policy hands out exactly LRU's blocks, and a
    pool that only ever sees the default stays on LRU."""
    clock = Clock()
    pools = [BlockPool(n, 2, clock=clock), BlockPool(n, 2, eviction_policy="priority", clock=clock)]
    held: list[list] = [[], []]
    tags = itertools.count(1)
    for op in ops:
        if op[0] == "alloc":
            for _ in range(op[1]):
                if pools[0].num_free_blocks == 0:
                    break
                tag = next(tags)
                got = []
                for pool, h in zip(pools, held):
                    block = pool.allocate()
                    if op[2]:
                        fill(pool, block, tag)
                    h.append(block)
                    got.append(block.block_id)
                assert got[0] == got[1]
        elif op[0] == "free" and held[0]:
            i = op[1] % len(held[0])
            for pool, h in zip(pools, held):
                pool.free([h.pop(i)])
        elif op[0] == "touch":
            cached = [b.block_id for b in pools[0].blocks if b.ref_cnt == 0 and b.has_content]
            if cached:
                bid = cached[op[1] % len(cached)]
                for pool, h in zip(pools, held):
                    pool.touch(pool.blocks[bid])
                    h.append(pool.blocks[bid])
        else:
            clock.t += 1.0
        assert [b.block_id for b in pools[0].free_queue.ordered()] == \
            [b.block_id for b in pools[1].free_queue.ordered()]
    assert not pools[0].retained
    assert pools[0].evictions() == pools[1].evictions() or pools[0].num_evictions == pools[1].num_evictions


def cached_pool(clock, *rets):
    """A pool of len(rets) blocks, each cached and released with the given retention."""
    pool = BlockPool(len(rets), 2, clock=clock)
    blocks = [pool.allocate() for _ in rets]
    for i, (b, r) in enumerate(zip(blocks, rets)):
        fill(pool, b, i + 1)
        pool.free([b], r)
    return pool, blocks


def test_lower_priority_evicted_first_then_lru_within_priority():
    pool, b = cached_pool(Clock(), CacheRetention(80), CacheRetention(10), CacheRetention(), CacheRetention(10))
    assert [pool.allocate().block_id for _ in range(4)] == [1, 3, 2, 0]
    assert pool.evictions() == {"low": 2, "default": 1, "high": 1}


def test_ttl_expiry_drops_below_every_priority():
    clock = Clock()
    pool, b = cached_pool(clock, CacheRetention(100, ttl_s=60), CacheRetention(0), CacheRetention(100))
    clock.t += 59.9
    assert [x.block_id for x in pool.free_queue.ordered()] == [1, 0, 2]  # not yet
    clock.t += 0.2
    assert [x.block_id for x in pool.free_queue.ordered()] == [0, 1, 2]
    assert pool.allocate().block_id == 0
    assert pool.evictions() == {"expired": 1}


def test_ttl_counts_from_the_last_use():
    clock = Clock()
    pool, b = cached_pool(clock, CacheRetention(90, ttl_s=10), CacheRetention(10))
    clock.t += 8
    pool.touch(b[0])
    pool.free([b[0]], CacheRetention(90, ttl_s=10))  # a hit renews it
    clock.t += 8
    assert pool.allocate().block_id == 1


def test_hit_by_a_lower_priority_keeps_the_higher_one():
    clock = Clock()
    pool, b = cached_pool(clock, CacheRetention(90), CacheRetention(50))
    pool.touch(b[0])
    pool.free([b[0]], CacheRetention(5))
    assert b[0].priority == 90
    assert pool.allocate().block_id == 1


def test_expired_priority_gives_way_to_the_next_user():
    clock = Clock()
    pool, b = cached_pool(clock, CacheRetention(90, ttl_s=1), CacheRetention(50))
    clock.t += 2
    pool.touch(b[0])
    pool.free([b[0]], CacheRetention(20))
    assert (b[0].priority, b[0].expires) == (20, math.inf)
    assert pool.allocate().block_id == 0


def test_switch_from_lru_keeps_the_order_so_far():
    pool = BlockPool(4, 2, clock=Clock())
    blocks = [pool.allocate() for _ in range(4)]
    for i, blk in enumerate(blocks[:3]):
        fill(pool, blk, i + 1)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])  # empty: first out
    assert not pool.retained
    pool.free([blocks[2]], CacheRetention(70))
    assert pool.retained
    assert [x.block_id for x in pool.free_queue.ordered()] == [3, 1, 0, 2]


# -- through the scheduler: requests carry the retention ---------------------------------------
VOCAB = 4


def make(num_blocks, block_size, clock, chunk=16, max_len=None):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True, clock=clock)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk,
                          max_model_len=max_len or num_blocks * block_size)
    return Scheduler(cfg, kv), CostModelRunner(vocab_size=VOCAB)


sched_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
              st.integers(1, 8), retentions),
    st.tuples(st.just("step")),
    st.tuples(st.just("tick"), st.floats(0, 10)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
), min_size=1, max_size=50)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=sched_ops, num_blocks=st.integers(11, 24), block_size=st.sampled_from([1, 2, 4]),
       chunk=st.integers(1, 40))
def test_random_workloads_keep_integrity_and_eviction_order(ops, num_blocks, block_size, chunk):
    """check_integrity checks the eviction order by (expired, priority, last use) under the
    priority policy, after every operation."""
    clock = Clock()
    max_len = min(40, num_blocks * block_size)
    sched, runner = make(num_blocks, block_size, clock, chunk, max_len=max_len)
    ids = itertools.count()
    live: list[str] = []
    for op in ops:
        if op[0] == "tick":
            clock.t += op[1]
        else:
            sched_op(sched, runner, op, live, ids, max_len)
        sched.kv.check_integrity()
        live = [r for r in live if r in sched.requests]
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        sched_step(sched, runner)
    assert sched.kv.pool.num_used_blocks == 0
    sched.kv.check_integrity()


def test_shared_prefix_keeps_the_highest_priority_of_its_requests():
    clock = Clock()
    sched, runner = make(16, 4, clock)
    prefix = [1, 2, 3, 0] * 2
    sp = lambda p: SamplingParams(max_tokens=2, ignore_eos=True, cache_retention={"priority": p})  # noqa: E731
    hi, lo = Request("hi", prefix + [1], sp(90)), Request("lo", prefix + [2, 2], sp(10))
    sched.add_request(hi)
    sched_step(sched, runner)
    sched_run(sched, runner, [lo])  # lo hits hi's prefix and leaves it last
    sched_run(sched, runner, [])
    pool = sched.kv.pool
    prefix_blocks = [pool.lookup(h) for h in hi.block_hashes[:2]]
    assert all(b is not None and b.priority == 90 for b in prefix_blocks)
    order = [b for b in pool.free_queue.ordered() if b.has_content]
    assert order[-2:] == prefix_blocks[::-1]  # evicted last (the prefix's first block last of all)
    assert order[0].priority == 10  # lo's own tail goes first, then hi's (90, released earlier)


@pytest.mark.parametrize("retained", [True, False])
def test_premium_prefix_survives_a_burst_of_low_priority_prompts(retained):
    """Under LRU the burst flushes the shared prefix; with priorities it stays."""
    clock = Clock()
    sched, runner = make(16, 4, clock)
    system = [3, 1, 2, 0] * 3
    hi, lo = ({"priority": 90}, {"priority": 10}) if retained else (None, None)
    sched_run(sched, runner, [Request("p0", system + [1], SamplingParams(
        max_tokens=1, ignore_eos=True, cache_retention=hi))])
    burst = [Request(f"f{i}", [i % 4, (i + 1) % 4, 2, (i // 4) % 4] * 2 + [i % 4], SamplingParams(
        max_tokens=2, ignore_eos=True, cache_retention=lo)) for i in range(8)]
    sched_run(sched, runner, burst)
    again = Request("p1", system + [2], SamplingParams(max_tokens=1, ignore_eos=True))
    hit = sched.kv.get_computed_blocks(again).num_tokens
    assert hit == len(system) if retained else hit < 4


@pytest.mark.parametrize("value, field", [
    ({"priority": 101}, "cache_retention.priority"),
    ({"priority": -1}, "cache_retention.priority"),
    ({"priority": 5.5}, "cache_retention.priority"),
    ({"priority": True}, "cache_retention.priority"),
    ({"ttl_s": -1}, "cache_retention.ttl_s"),
    ({"ttl_s": float("nan")}, "cache_retention.ttl_s"),
    ({"ttl_s": "600"}, "cache_retention.ttl_s"),
    ({"priority": 5, "pin": True}, "cache_retention keys pin"),
    (80, "cache_retention must be an object"),
])
def test_bad_retention_is_refused_naming_the_field(value, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(cache_retention=value)
    assert str(e.value).startswith(field)


def test_retention_parses_and_defaults():
    sp = SamplingParams(cache_retention={"priority": 80, "ttl_s": 600})
    assert sp.cache_retention == CacheRetention(80, 600.0)
    assert SamplingParams(cache_retention={"ttl_s": 0}).cache_retention == CacheRetention(DEFAULT_PRIORITY, 0.0)
    assert SamplingParams().cache_retention is None


def test_metrics_count_evictions_by_class_and_ttl_expiries():
    from prometheus_client import generate_latest
    from server_util import parse_metrics

    from kvserve.engine.async_engine import StepEvent
    from kvserve.engine.outputs import EngineStats
    from kvserve.server.metrics import ServerMetrics
    m = ServerMetrics("my-model", 1024)
    m(StepEvent(EngineStats(num_blocks_total=100, num_blocks_free=100), [], [], 0.0))
    m(StepEvent(EngineStats(num_blocks_total=100, num_blocks_free=100, num_cached_block_evictions=9,
                            evictions_by_class={"expired": 2, "low": 5, "high": 2}), [], [], 1.0))
    s = parse_metrics(generate_latest(m.registry).decode())
    label = 'engine="0",model_name="my-model"'
    assert s['kvserve:kv_cache_evictions_total{' + label + ',retention_class="low"}'] == 5
    assert s['kvserve:kv_cache_evictions_total{' + label + ',retention_class="expired"}'] == 2
    assert s['kvserve:kv_cache_ttl_expiries_total{' + label + '}'] == 2
    assert s['kvserve:cached_block_evictions_total{' + label + '}'] == 9


def test_engine_stats_carry_the_pools_evictions():
    pool, _ = cached_pool(Clock(), CacheRetention(10), CacheRetention(90))
    pool.allocate()
    assert pool.evictions() == {"low": 1}
    lru, _ = cached_pool(Clock(), None, None)
    lru.allocate()
    assert not lru.retained and lru.evictions() == {"default": 1}


def test_tenant_default_retention_from_the_api_keys_file(tmp_path):
    import json

    from kvserve.server.auth import Authenticator, load_api_keys
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([
        {"key": "k-premium", "tenant": "premium", "cache_retention": {"priority": 90, "ttl_s": 600}},
        {"key": "k-premium-2", "tenant": "premium", "cache_retention": {"priority": 90, "ttl_s": 600}},
        {"key": "k-free", "tenant": "free", "cache_retention": {"priority": 10}},
        {"key": "k-plain", "tenant": "plain"}]))
    auth = Authenticator(load_api_keys(None, str(path)))
    assert auth.default_retention(auth.authenticate("Bearer k-premium-2").tenant) == CacheRetention(90, 600.0)
    assert auth.default_retention("free") == CacheRetention(10)
    assert auth.default_retention("plain") is None and auth.default_retention(None) is None


@pytest.mark.parametrize("entries, needle", [
    ([{"key": "a", "tenant": "t", "cache_retention": {"priority": 500}}], "entry 0: cache_retention.priority"),
    ([{"key": "a", "tenant": "t", "cache_retention": {"ttl_s": -1}}], "entry 0: cache_retention.ttl_s"),
    ([{"key": "a", "tenant": "t", "cache_retention": {"priority": 20}}, {"key": "b", "tenant": "t"}],
     "tenant 't' has keys with different cache_retention"),
])
def test_bad_tenant_retention_is_a_config_error(tmp_path, entries, needle):
    import json

    from kvserve.config import ConfigError
    from kvserve.server.auth import load_api_keys
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ConfigError, match=needle):
        load_api_keys(None, str(path))


def test_simulate_replays_retention_and_keeps_the_premium_prefix():
    """`kvserve simulate` with the same policy: premium conversations (one shared system prompt,
    priority 90) between bursts of unique free prompts (priority 10) that overflow the pool."""
    import random

    from kvserve.tools import simulate as sim
    from kvserve.tools.workload import Conversation, Trace, Turn
    rng = random.Random(0)
    system = [rng.randrange(100, 1000) for _ in range(160)]

    def trace(retained: bool) -> Trace:
        convs = []
        for i in range(12):
            t = i * 1.0
            convs.append(Conversation(f"p{i}", t, [Turn(system + [1000 + i], 2)],
                                      cache_retention={"priority": 90} if retained else None))
            for j in range(4):
                convs.append(Conversation(f"f{i}-{j}", t + 0.1 + 0.01 * j,
                                          [Turn([rng.randrange(100, 1000) for _ in range(120)], 2)],
                                          cache_retention={"priority": 10} if retained else None))
        return Trace(convs, "synthetic: two tenants")

    def hit_rate(retained: bool) -> float:
        res = sim.simulate(trace(retained), sim.SimConfig(block_size=16, num_blocks=40), 256, check_integrity=True)
        assert res.error is None and res.num_requests == 60
        return res.prefix_hit_rate

    every_premium_hit = 11 * len(system) / (12 * (len(system) + 1) + 48 * 120)
    assert hit_rate(True) >= every_premium_hit  # the prefix is never evicted (plus stray partial hits)
    assert hit_rate(False) < 0.9 * every_premium_hit  # under LRU the bursts flush it
