"""Data-parallel routing policies, the prefix index they read, CPU binding and summed stats:
torch-free units (the server end to end is tests/test_data_parallel.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import ConfigError
from kvserve.engine.cpu_bind import cpu_sets, numa_nodes, parse_cpu_list
from kvserve.engine.outputs import EngineStats, sum_stats
from kvserve.kv.events import MEDIUM_DEVICE, MEDIUM_HOST, AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv.hashing import extend_block_hashes, root_hash
from kvserve.routing import POLICIES, Replica, make_policy
from kvserve.routing.cache_aware import CacheAware
from kvserve.routing.prefix_index import PrefixIndex


def hashes(tokens, salt=None, block_size=4):
    return extend_block_hashes([], root_hash("auto", salt, None), tokens, block_size)


def stored(hs, medium=MEDIUM_DEVICE):
    return BlockStored(list(hs), None, [], 4, None, medium)


def test_prefix_index_follows_stores_removals_and_clears_per_medium():
    hs = hashes(list(range(16)))  # 4 blocks
    idx = PrefixIndex()
    idx.apply([stored(hs[:3]), stored(hs[3:], MEDIUM_HOST)])
    assert idx.match(hs) == 4 and len(idx) == 4
    idx.apply([BlockRemoved([hs[1]], MEDIUM_DEVICE)])
    assert idx.match(hs) == 1  # a gap ends the chain: blocks after it cannot be used
    idx.apply([stored([hs[1]], MEDIUM_HOST)])
    assert idx.match(hs) == 4  # held by the host tier now
    idx.apply([AllBlocksCleared(MEDIUM_DEVICE)])
    assert idx.match(hs) == 0 and len(idx) == 2
    idx.apply([BlockRemoved([hs[0]], "REDIS")])  # a medium it never saw: nothing to do
    idx.apply([AllBlocksCleared()])
    assert len(idx) == 0


def test_salted_prompts_match_only_their_own_tenants_blocks():
    tokens = list(range(12))
    idx = PrefixIndex()
    idx.apply([stored(hashes(tokens, salt="tenant-a"))])
    assert idx.match(hashes(tokens, salt="tenant-a")) == 3
    assert idx.match(hashes(tokens, salt="tenant-b")) == 0
    assert idx.match(hashes(tokens)) == 0


def replicas(*loads, held=()):
    reps = [Replica(r, num_running=load) for r, load in enumerate(loads)]
    for rank, hs in held:
        reps[rank].index.apply([stored(hs)])
    return reps


def test_cache_aware_goes_where_the_prefix_is_unless_the_load_is_out_of_balance():
    hs = hashes(list(range(32)))  # 8 blocks
    policy = CacheAware(cache_threshold=0.5, balance_abs=8, balance_rel=1.5)
    assert policy.choose(hs, replicas(3, 0, held=[(0, hs[:6])])) == 0  # 6/8 cached: worth a little load
    assert policy.choose(hs, replicas(3, 0, held=[(0, hs[:2])])) == 1  # 2/8: below the threshold, least loaded
    assert policy.choose(hs, replicas(20, 2, held=[(0, hs)])) == 1  # hot prefix: the balance rule wins
    assert policy.choose(hs, replicas(5, 5, held=[(0, hs[:4]), (1, hs)])) == 1  # the longest match
    assert policy.choose([], replicas(2, 1)) == 1  # nothing to match (an adapter's request): least loaded


def test_new_prefixes_spread_to_the_replica_with_fewest_cached_blocks():
    a, b = hashes(list(range(16))), hashes(list(range(100, 116)))
    reps = replicas(0, 0, held=[(0, a)])
    assert CacheAware().choose(b, reps) == 1


def test_pending_requests_count_as_load():
    hs = hashes(list(range(16)))
    reps = replicas(0, 0, held=[(0, hs)])
    policy, picks = CacheAware(), []
    for _ in range(12):
        rank = policy.choose(hs, reps)
        reps[rank].num_pending += 1
        picks.append(rank)
    assert picks[0] == 0 and 1 in picks  # the hot prefix's replica fills up, then the other takes some


def test_round_robin_and_least_loaded_skip_dead_replicas():
    reps = replicas(0, 0, 0)
    reps[1].alive = False
    rr = make_policy("round_robin")
    assert [rr.choose([], reps) for _ in range(4)] == [0, 2, 0, 2]
    reps[0].num_waiting = 1
    assert make_policy("least_loaded").choose([], reps) == 2
    for r in reps:
        r.alive = False
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        make_policy("cache_aware").choose([], reps)


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10), st.booleans()), min_size=1, max_size=5),
       held=st.lists(st.integers(0, 8), min_size=5, max_size=5), policy=st.sampled_from(sorted(POLICIES)))
def test_every_policy_picks_a_live_replica_and_balance_bounds_the_spread(loads, held, policy):
    if not any(alive for _, _, alive in loads):
        loads[0] = (loads[0][0], loads[0][1], True)
    hs = hashes(list(range(32)))
    reps = [Replica(r, num_running=run, num_waiting=wait, alive=alive) for r, (run, wait, alive) in enumerate(loads)]
    for r, n in zip(reps, held):
        r.index.apply([stored(hs[:n])])
    p = CacheAware() if policy == "cache_aware" else make_policy(policy)
    rank = p.choose(hs, reps)
    assert reps[rank].alive
    if policy == "cache_aware":
        live = [r for r in reps if r.alive]
        idlest = min(r.load for r in live)
        # Never onto a replica past the balance limit while a much idler one exists.
        assert reps[rank].load - idlest <= p.balance_abs or reps[rank].load <= p.balance_rel * idlest


def test_cpu_sets_split_bind_and_refuse():
    assert cpu_sets(2, "auto", [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert cpu_sets(2, "auto", [0, 1, 2]) == [[0], [1]]
    assert cpu_sets(2, "all", [0, 1]) == [None, None]
    assert cpu_sets(2, "0-1|2,3", [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert parse_cpu_list("0-2,7") == [0, 1, 2, 7]
    with pytest.raises(ConfigError, match=r"--data-parallel-size 3 needs at least one CPU per replica.*may use 2"):
        cpu_sets(3, "auto", [0, 1])
    with pytest.raises(ConfigError, match="gives 1 CPU lists"):
        cpu_sets(2, "0-1", [0, 1])
    with pytest.raises(ConfigError, match=r"CPUs \[5\]"):
        cpu_sets(2, "0|5", [0, 1])
    with pytest.raises(ConfigError, match="not a CPU number"):
        cpu_sets(2, "0|x", [0, 1])


def test_auto_keeps_each_process_in_one_numa_node(tmp_path):
    two = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cpu_sets(2, "auto", list(range(8)), nodes=two) == two
    assert cpu_sets(4, "auto", list(range(8)), nodes=two) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Interleaved numbering, as on many two-socket machines: still one node per process.
    assert cpu_sets(2, "auto", list(range(8)), nodes=[[0, 2, 4, 6], [1, 3, 5, 7]]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Fewer processes than nodes: one node each. Three over two nodes do not divide: an even split.
    assert cpu_sets(1, "auto", list(range(8)), nodes=two) == [[0, 1, 2, 3]]
    assert cpu_sets(3, "auto", list(range(8)), nodes=two) == [[0, 1], [2, 3], [4, 5]]
    # Only the CPUs this process may use count; a node it may not use is no node.
    assert cpu_sets(2, "auto", [0, 1, 2, 3], nodes=two) == [[0, 1], [2, 3]]
    assert cpu_sets(2, "auto", [2, 3, 4, 5], nodes=two) == [[2, 3], [4, 5]]
    # sysfs as the kernel lays it out.
    for i, cl in enumerate(("0-3", "4-7")):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cl + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert numa_nodes(str(tmp_path)) == two
    assert numa_nodes(str(tmp_path / "missing")) == []


def test_summed_stats_are_one_engines_view():
    a = EngineStats(num_running=2, num_waiting=1, num_blocks_total=100, num_blocks_used=50, num_blocks_cached=10,
                    prefix_cache_hits=5, tier_hits={"device": 5}, tier_usage={"host": 0.5},
                    running_lora_adapters=("x",), host_tier_usage=0.5)
    b = EngineStats(num_running=1, num_blocks_total=100, num_blocks_used=0, prefix_cache_hits=7,
                    tier_hits={"device": 7, "disk": 1}, tier_usage={"host": 0.1}, running_lora_adapters=("y", "x"))
    s = sum_stats([a, b])
    assert (s.num_running, s.num_waiting, s.prefix_cache_hits) == (3, 1, 12)
    assert s.kv_usage == pytest.approx(0.25) and s.cached_usage == pytest.approx(0.05)
    assert s.tier_hits == {"device": 12, "disk": 1} and s.tier_usage == {"host": pytest.approx(0.3)}
    assert s.running_lora_adapters == ("x", "y") and s.host_tier_usage == pytest.approx(0.25)
    assert sum_stats([a]) is a


def test_replicas_that_cannot_fit_in_memory_stop_startup(monkeypatch):
    """Replica 0 is measured (resident memory, KV pool); the others must fit in what is left."""
    import os
    from types import SimpleNamespace

    from kvserve.engine import dp_client
    client = dp_client.DPClient.__new__(dp_client.DPClient)
    client.clients = [SimpleNamespace(proc=SimpleNamespace(pid=os.getpid()), info={"kv_cache_bytes": 20 * 2**30})]
    monkeypatch.setattr(dp_client, "host_memory", lambda field: 30 * 2**30)
    args = SimpleNamespace(tensor_parallel_size=1)
    client._check_memory(args, 2)  # one more replica of 20 GiB fits in 30 GiB
    with pytest.raises(ConfigError, match=r"--data-parallel-size 3 needs about 60\.0 GiB.*lower --data-parallel-size"):
        client._check_memory(args, 3)
