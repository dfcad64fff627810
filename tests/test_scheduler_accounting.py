"""Block accounting under random add / step / abort / preempt sequences (hypothesis).

The real Scheduler and KVCacheManager, driven by the cost-model runner (deterministic tokens, no
weights): ref counts never negative, no block owned twice, free + used + cached = total after
every operation, and a drained engine holds no referenced block.
"""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner

VOCAB = 4  # a tiny vocabulary makes shared prefixes (full and partial blocks) frequent


def make(num_blocks, block_size, caching, policy="fcfs", chunk=16, max_seqs=4, max_len=None):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=chunk,
                          max_model_len=max_len or num_blocks * block_size, scheduling_policy=policy)
    return Scheduler(cfg, kv), CostModelRunner(vocab_size=VOCAB)


def step(sched, runner):
    out = sched.schedule()
    # Every scheduled entry's block table covers its tokens.
    for e in out.scheduled:
        assert len(e.block_table) * sched.kv.block_size >= e.start_pos + e.num_new_tokens
    res = runner.execute(out)
    sched.update_from_output(out, res)
    sched.kv.check_integrity()
    return out


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
              st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(11, 24), block_size=st.sampled_from([1, 2, 4]),
       caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       chunk=st.integers(1, 40))
def test_block_accounting_invariants(ops, num_blocks, block_size, caching, policy, chunk):
    max_len = min(40, num_blocks * block_size)
    sched, runner = make(num_blocks, block_size, caching, policy, chunk, max_len=max_len)
    ids = itertools.count()
    live: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, prio = op
            prompt = prompt[:max_len - 1]
            max_tokens = min(max_tokens, max_len - len(prompt))
            rid = str(next(ids))
            sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      priority=prio))
            live.append(rid)
        elif op[0] == "step":
            step(sched, runner)
        elif op[0] == "abort" and live:
            sched.finish_request(live[op[1] % len(live)], RequestStatus.FINISHED_ABORTED)
        elif op[0] == "preempt" and live:
            sched.preempt_request(live[op[1] % len(live)])
        sched.kv.check_integrity()
        live = [r for r in live if r in sched.requests]
    # Drain: everything finishes (no livelock), and the idle engine holds no referenced block.
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
    assert not sched.has_unfinished_requests(), "requests never finished"
    assert sched.kv.pool.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    sched.kv.check_integrity()


def run_to_end(sched, runner, reqs):
    for r in reqs:
        sched.add_request(r)
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
    return {r.request_id: list(r.output_token_ids) for r in reqs}


def test_shared_prefix_blocks_are_shared_by_reference():
    sched, runner = make(64, 4, True, chunk=64, max_seqs=8)
    prefix = [1, 2, 3, 0] * 4 + [3, 3]  # 4 full blocks + 2 tokens
    a = Request("a", prefix + [0, 1], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(a)
    step(sched, runner)
    b = Request("b", prefix + [2, 2, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(b)
    out = step(sched, runner)
    (eb,) = [e for e in out.scheduled if e.request is b]
    ta, tb = sched.kv.block_table(a), sched.kv.block_table(b)
    assert ta[:4] == tb[:4], "full prefix blocks must be shared"
    assert ta[4] != tb[4]
    # 16 full-block tokens + 2 copied from a's partial block
    assert b.num_cached_tokens == 18 and eb.start_pos == 18
    assert out.block_copies and out.block_copies[0].num_tokens == 2
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in ta[:4])


def test_last_prompt_token_always_computed():
    sched, runner = make(32, 4, True, chunk=64)
    p = [1, 2, 3, 0, 1, 2, 3, 0]
    run_to_end(sched, runner, [Request("a", p, SamplingParams(max_tokens=1, ignore_eos=True))])
    b = Request("b", p, SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add_request(b)
    out = step(sched, runner)
    assert b.num_cached_tokens == 7 and out.scheduled[0].num_new_tokens == 1


def test_preemption_output_equals_unconstrained_run():
    prompts = [[i % 4, (i * 3) % 4] * 5 for i in range(6)]

    def reqs():
        return [Request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True)) for i, p in enumerate(prompts)]

    big, runner = make(200, 2, True, chunk=32, max_seqs=6)
    ref = run_to_end(big, runner, reqs())
    small, runner2 = make(12, 2, True, chunk=32, max_seqs=6, max_len=24)
    got = run_to_end(small, runner2, reqs())
    assert got == ref
    assert small.num_preemptions > 0


def test_priority_policy_preempts_lower_priority():
    sched, runner = make(10, 4, False, policy="priority", chunk=64, max_seqs=4, max_len=40)
    low = Request("low", [1] * 20, SamplingParams(max_tokens=12, ignore_eos=True), priority=5)
    sched.add_request(low)
    step(sched, runner)
    high = Request("high", [2] * 24, SamplingParams(max_tokens=4, ignore_eos=True), priority=0)
    sched.add_request(high)
    out = step(sched, runner)
    assert "low" in out.preempted_req_ids
    assert any(e.request is high for e in out.scheduled)
    assert low.status == RequestStatus.PREEMPTED and low.num_preemptions == 1


def test_reset_prefix_cache_refuses_while_in_use():
    sched, runner = make(16, 4, True, chunk=64)
    r = Request("a", [1, 2, 3, 0, 1], SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add_request(r)
    step(sched, runner)
    assert not sched.kv.reset_prefix_cache()
    run_to_end(sched, runner, [])
    assert sched.kv.pool.num_cached_free > 0
    assert sched.kv.reset_prefix_cache()
    assert sched.kv.pool.num_cached_free == 0 and not sched.kv.pool.cached


def test_cache_aware_admission_prefers_longest_cached_prefix():
    def run(cache_aware):
        kv = KVCacheManager(64, 4, enable_caching=True)
        cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                              cache_aware_scheduling=cache_aware)
        sched, runner = Scheduler(cfg, kv), CostModelRunner(vocab_size=VOCAB)
        shared = [1, 2, 3, 0] * 3
        run_to_end(sched, runner, [Request("warm", shared + [1], SamplingParams(max_tokens=1, ignore_eos=True))])
        cold = Request("cold", [3, 3, 3, 3, 2, 2, 2, 2, 1], SamplingParams(max_tokens=2, ignore_eos=True))
        hot = Request("hot", shared + [2, 2], SamplingParams(max_tokens=2, ignore_eos=True))
        sched.add_request(cold)
        sched.add_request(hot)
        out = step(sched, runner)
        return out.scheduled[0].request.request_id

    assert run(cache_aware=False) == "cold"  # FCFS stays the default
    assert run(cache_aware=True) == "hot"


def _prefill_tokens(sched, runner, prompts, max_tokens=2):
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    computed = 0
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        computed += sum(e.num_new_tokens for e in out.scheduled if e.num_new_tokens > 1)
    return computed


def test_requests_arriving_together_share_an_uncached_prefix():
    """In-step prefix sharing: of 6 requests that arrive together with one uncached 64-token
    prefix, one computes it and the others wait a step and hit it, instead of the second and third
    computing it again beside the first in the same step."""
    prefix = [(7 * i) % 50 for i in range(64)]
    prompts = [prefix + [100 + i, 101 + i, 102 + i] for i in range(6)]
    for caching, want in ((True, 64 + 6 * 3), (False, 6 * 67)):
        kv = KVCacheManager(64, 4, enable_caching=caching)
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
        sched = Scheduler(cfg, kv)
        computed = _prefill_tokens(sched, CostModelRunner(vocab_size=200), prompts)
        assert computed == want, (caching, computed)
    # The first step admits one request and defers the other five (vllm:num_requests_waiting_by_reason).
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256), kv)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", list(p), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()
    assert len(out.scheduled) == 1 and sched.num_waiting == 5 and sched.num_waiting_deferred == 5


def test_a_waiting_request_is_not_held_back_by_a_different_prefix():
    prompts = [[1] * 40, [2] * 40, [3] * 40]
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256), kv)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=1, ignore_eos=True)))
    out = sched.schedule()
    assert len(out.scheduled) == 3  # all admitted in the first step
