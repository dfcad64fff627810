"""Pinned prefixes: held blocks the eviction policy never sees (kv/pins.py), computed and capped by
the engine (engine/pins.py), kept across a restart through the disk tier, and the admin routes
(server/pins.py) with their tenant isolation."""
from __future__ import annotations

import itertools
import random

import pytest
from helpers import greedy, sched_op, sched_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM
from kvserve.config import SchedulerConfig
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.outputs import RequestError
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner

VOCAB = 4


def make(num_blocks, block_size, chunk=16, max_len=40, policy="lru"):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True, eviction_policy=policy)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk, max_model_len=max_len)
    return Scheduler(cfg, kv), CostModelRunner(vocab_size=VOCAB)


def pin(sched, runner, pin_id, prompt, salt=None):
    """As the engine does: prefill the prompt, then pin its full blocks in the step that freed them."""
    req = Request(f"pin:{pin_id}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt)
    sched_run(sched, runner, [req])
    return sched.kv.pin(pin_id, req)


def test_a_pinned_prefix_survives_a_flood_that_flushes_lru():
    sched, runner = make(16, 4)
    system = [3, 1, 2, 0] * 3
    p = pin(sched, runner, "sys", system + [1])
    assert len(p.blocks) == 3 and all(b.ref_cnt == 1 for b in p.blocks)
    flood = [Request(f"f{i}", [i % 4, (i + 1) % 4, 2, (i // 4) % 4] * 2 + [i % 4],
                     SamplingParams(max_tokens=2, ignore_eos=True)) for i in range(12)]
    sched_run(sched, runner, flood)
    assert sched.kv.pool.num_evictions > 0
    again = Request("p1", system + [2], SamplingParams(max_tokens=1, ignore_eos=True))
    assert sched.kv.get_computed_blocks(again).num_tokens == len(system)
    sched.kv.pins.unpin("sys")
    sched.kv.check_integrity()
    sched_run(sched, runner, [Request(f"g{i}", r.prompt_token_ids[::-1], SamplingParams(max_tokens=2, ignore_eos=True))
                               for i, r in enumerate(flood)])
    assert sched.kv.get_computed_blocks(Request("p2", system + [2], SamplingParams())).num_tokens < len(system)


def test_reset_prefix_cache_keeps_pinned_blocks():
    sched, runner = make(16, 4)
    p = pin(sched, runner, "a", [1, 2, 3, 0] * 2 + [1])
    sched_run(sched, runner, [Request("x", [0, 0, 1, 1] * 2 + [2], SamplingParams(max_tokens=1, ignore_eos=True))])
    assert sched.kv.reset_prefix_cache()
    assert all(sched.kv.pool.lookup(b.block_hash) is b for b in p.blocks)
    assert sched.kv.pool.num_cached_free == 0
    sched.kv.check_integrity()


sched_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), st.integers(1, 8),
              st.sampled_from([None, {"priority": 0}, {"priority": 100}, {"priority": 50, "ttl_s": 0}])),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
    st.tuples(st.just("pin"), st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=12)),
    st.tuples(st.just("unpin"), st.integers(0, 50)),
    st.tuples(st.just("reset")),
), min_size=1, max_size=50)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=sched_ops, num_blocks=st.integers(14, 24), block_size=st.sampled_from([2, 4]),
       chunk=st.integers(1, 40), policy=st.sampled_from(["lru", "priority"]))
def test_pinned_blocks_are_never_evicted(ops, num_blocks, block_size, chunk, policy):
    """Random workloads with pins and unpins between them: after every operation the pool's
    integrity check holds (pins counted as owners) and every pinned block still holds, under its
    hash, the tokens it was pinned with."""
    max_len = min(40, num_blocks * block_size)
    sched, runner = make(num_blocks, block_size, chunk, max_len, policy)
    kv = sched.kv
    ids = itertools.count()
    live: list[str] = []
    pinned: dict[str, list[tuple]] = {}  # pin id -> (block, hash, tokens)
    for op in ops:
        if sched_op(sched, runner, op, live, ids, max_len):
            pass
        elif op[0] == "pin" and (kv.pins.num_blocks + len(op[1]) // block_size) * 2 < num_blocks:
            pid = f"p{next(ids)}"
            p = pin(sched, runner, pid, op[1])
            pinned[pid] = [(b, b.block_hash, list(b.token_ids)) for b in p.blocks]
        elif op[0] == "unpin" and pinned:
            pid = sorted(pinned)[op[1] % len(pinned)]
            kv.pins.unpin(pid)
            del pinned[pid]
        elif op[0] == "reset" and not sched.has_unfinished_requests():
            assert kv.reset_prefix_cache()
        kv.check_integrity()
        for held in pinned.values():
            for block, h, tokens in held:
                assert block.ref_cnt >= 1 and block.block_id not in kv.pool.free_queue
                assert block.block_hash == h and kv.pool.lookup(h) is block and block.token_ids == tokens
        live = [r for r in live if r in sched.requests]
    sched_run(sched, runner, [])
    assert kv.pool.num_used_blocks == kv.pins.num_blocks


# -- the engine: computing, the cap, tenants, a restart ---------------------------------------
BS = 16
POOL = 24


def engine_llm(tiny, **kw):
    return LLM(tiny, dtype="float32", block_size=BS, num_gpu_blocks_override=POOL, max_model_len=10 * BS,
               max_num_batched_tokens=256, check_integrity=True, **kw)


def rand_ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


def pin_now(engine, ids, salt=None):
    view = engine.pin_prefix(ids, salt)
    for _ in range(100):
        got = engine.get_pin(view["id"], salt)
        if got["status"] != "pending":
            return got
        engine.step()
    raise AssertionError("the pin never finished")


def test_engine_pins_a_prefix_that_survives_a_flood_and_caps_pinned_bytes(tiny):
    llm = engine_llm(tiny, max_pinned_kv_bytes=None)
    engine = llm.engine
    system = rand_ids(1, 5 * BS + 3)
    pin = pin_now(engine, system)
    bpb = engine.pins.bytes_per_block
    assert pin["status"] == "pinned" and pin["num_blocks"] == 5 and pin["bytes"] == 5 * bpb
    assert engine.get_stats().num_pinned_blocks == 5 and engine.get_stats().pinned_bytes == 5 * bpb
    llm.generate([rand_ids(100 + i, 6 * BS) for i in range(6)], greedy(2), use_tqdm=False)  # 36+ blocks through 24
    assert engine.get_stats().num_cached_block_evictions > 0
    out = llm.generate([system + [7, 8]], greedy(1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 5 * BS
    # The cap: half the pool by default (12 blocks); 5 are held.
    with pytest.raises(RequestError, match=r"--max-pinned-kv-bytes is %d" % (POOL * bpb // 2)) as e:
        engine.pin_prefix(rand_ids(2, 8 * BS), None)
    assert f"takes {8 * bpb} bytes (8 KV blocks) but {5 * bpb} bytes are already pinned" in str(e.value)
    assert e.value.param == "max_pinned_kv_bytes"
    engine.pins.cap_bytes = POOL * bpb  # the cap out of the way: the room for one sequence decides
    pending = engine.pin_prefix(rand_ids(2, 9 * BS + 1), None)  # 5 + 9 leaves 10 blocks, one sequence's
    assert pending["status"] == "pending" and pending["num_blocks"] == 9
    with pytest.raises(RequestError, match="would leave 9 unpinned, fewer than the 10 one sequence of "
                                           "--max-model-len 160 needs"):
        engine.pin_prefix(rand_ids(3, BS), None)
    assert engine.unpin(pending["id"])["status"] == "pending"  # unpinned before it was computed
    engine.pins.cap_bytes = POOL * bpb // 2
    with pytest.raises(RequestError, match="pin at least 16"):
        engine.pin_prefix([5, 6, 7], None)
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.pin_prefix([], None)
    assert engine.unpin(pin["id"])["bytes"] == 5 * bpb
    assert engine.get_stats().num_pinned_blocks == 0 and engine.list_pins() == []


def test_pins_belong_to_their_tenant(tiny):
    engine = engine_llm(tiny).engine
    ids = rand_ids(3, 3 * BS)
    mine = pin_now(engine, ids, "salt-a")
    assert [p["id"] for p in engine.list_pins("salt-a")] == [mine["id"]]
    assert engine.list_pins("salt-b") == [] and engine.list_pins(None) == []
    assert engine.get_pin(mine["id"], "salt-b") is None
    assert engine.unpin(mine["id"], "salt-b") is None  # another tenant cannot unpin it
    assert engine.get_pin(mine["id"], "salt-a")["status"] == "pinned"
    # The blocks are salted: the same tokens as another tenant hit nothing pinned.
    engine.add_request("b", ids + [1], greedy(1), cache_salt="salt-b")
    engine.add_request("a", ids + [1], greedy(1), cache_salt="salt-a")
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    assert done["a"].num_cached_tokens == 3 * BS and done["b"].num_cached_tokens == 0


def test_pins_come_back_after_a_restart_on_the_same_disk_tier(tiny, tmp_path):
    disk = str(tmp_path / "kv")
    ids = rand_ids(4, 4 * BS + 1)
    first = engine_llm(tiny, kv_disk_path=disk)
    pin = pin_now(first.engine, ids, "t")
    first.engine.close()
    del first
    second = engine_llm(tiny, kv_disk_path=disk)
    [again] = second.engine.list_pins("t")
    assert again["id"] == pin["id"] and again["status"] == "pinned" and again["num_blocks"] == 4
    assert second.engine.get_stats().tier_hits.get("disk", 0) == 4 * BS  # read back, not recomputed
    second.engine.add_request("q", ids + [9], greedy(1), cache_salt="t")
    outs = []
    while second.engine.has_unfinished_requests():
        outs += second.engine.step()
    assert outs[-1].num_cached_tokens >= 4 * BS  # the pinned blocks (and the partial one, copied)
    second.engine.unpin(pin["id"], "t")
    second.engine.close()
    third = engine_llm(tiny, kv_disk_path=disk)
    assert third.engine.list_pins("t") == []
    third.engine.close()


def test_simulate_replays_a_pinned_prefix():
    """`kvserve simulate` with the prefix pinned: every premium request hits it, under LRU, where
    the bursts of unique prompts flush it otherwise."""
    from kvserve.tools import simulate as sim
    from kvserve.tools.workload import Conversation, Trace, Turn
    rng = random.Random(0)
    system = [rng.randrange(100, 1000) for _ in range(160)]
    convs = []
    for i in range(12):
        convs.append(Conversation(f"p{i}", i * 1.0, [Turn(system + [1000 + i], 2)]))
        convs += [Conversation(f"f{i}-{j}", i + 0.1 + 0.01 * j, [Turn([rng.randrange(100, 1000) for _ in range(120)], 2)])
                  for j in range(4)]
    trace = Trace(convs, "synthetic: two tenants")

    def premium_hits(pins) -> list[int]:
        res = sim.simulate(trace, sim.SimConfig(block_size=16, num_blocks=40), 256, check_integrity=True, pins=pins)
        assert res.error is None and res.num_requests == 60
        return [res.request_cached_tokens[f"p{i}/t0"][1] for i in range(12)]

    assert premium_hits([system]) == [160] * 12
    assert sum(h == 160 for h in premium_hits([])) < 6


def test_a_pin_under_an_adapter_holds_the_adapters_blocks(tiny, tmp_path):
    from hf_reference import load_hf
    from lora_adapters import make_adapter

    from kvserve import LoRARequest
    a = LoRARequest("a", 1, make_adapter(load_hf(tiny), tmp_path / "a", r=8, alpha=16, seed=1))
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=BS,
              num_gpu_blocks_override=POOL, max_model_len=10 * BS, check_integrity=True)
    engine = llm.engine
    ids = rand_ids(5, 3 * BS + 2)
    view = engine.pin_prefix(ids, None, a)
    while engine.get_pin(view["id"])["status"] == "pending":
        engine.step()
    assert engine.get_pin(view["id"])["model"] == "a" and engine.get_stats().num_pinned_blocks == 3
    llm.generate([rand_ids(200 + i, 6 * BS) for i in range(6)], greedy(2), use_tqdm=False)  # flush the rest
    hit, base = llm.generate([ids + [3], ids + [3]], greedy(1), lora_request=[a, None], use_tqdm=False)
    assert hit.num_cached_tokens >= 3 * BS and base.num_cached_tokens == 0


def test_a_pin_is_exact_whatever_the_servers_default_kv_compression(tiny):
    """The pin's own request opts out of --kv-compression: every full block of the prefix is held."""
    engine = engine_llm(tiny, kv_compression='{"method": "snapkv", "window": 32, "sink_tokens": 4, '
                                             '"heavy_tokens": 32, "observation_tokens": 8}').engine
    pin = pin_now(engine, rand_ids(6, 6 * BS + 5))
    assert pin["status"] == "pinned" and pin["num_blocks"] == 6
