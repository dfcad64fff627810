"""Quantized KV caches (fp8 / int8 / int4) through the offload tiers and swap preemption.

The reference for a quantized dtype is the same dtype on a pool big enough that nothing is evicted
or preempted: a block that travels host / disk keeps its codes bit for bit, and a swapped-out open
block (still full precision in the KIVI residual) comes back with its residual rows, so the output
must match token for token, not just within quantization error.
"""
from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from helpers import greedy
from kv_cases import BS, SMALL, TINY, documents_workload, samples, write_seq

from kvserve import LLM
from kvserve.cache.codec import pack_block
from kvserve.cache.factory import create_kv_cache
from kvserve.cache.fp8 import Fp8PagedKVCache
from kvserve.cache.kivi import IntPagedKVCache
from kvserve.cache.quantizers import KVScales
from kvserve.core.step import BlockCopy
from kvserve.ops.cpu_kernels import varlen_kernel_for

QUANT = ["fp8_e4m3", "int8", "int4"]
POOL = 10  # blocks; a request needs at most 10 (128-token document + question + answer)
# Documents end on a block boundary: a prefix ending mid-block is recomputed (a quantized cache
# copies no partial block: kv/manager.py), so only full blocks, the tiers' unit, are compared.
DOCS = dict(num_docs=5, doc_len=128, questions=2)  # 5 x 8 blocks = 40 >= 4 x POOL
# Per-step check_integrity would dominate these runs; test_tiers_engine runs the same manager
# with it, and these tests check the pool at the end instead.
TIGHT = dict(SMALL, num_gpu_blocks_override=POOL, max_model_len=POOL * BS, check_integrity=False)
ROOMY = dict(TIGHT, num_gpu_blocks_override=20 * POOL)


def prompts_of(seed):
    return [p for batch in documents_workload(seed, **DOCS) for p in batch]


def one_at_a_time(llm, prompts):
    """So that the working set passes through the small pool (and batches match across runs)."""
    return [llm.generate([p], greedy(6), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def roomy_outputs(tiny):
    """(dtype, rounds) -> greedy outputs of the first rounds of prompts_of(1) with nothing evicted
    and no tiers (memoized)."""
    memo = {}

    def get(dtype, rounds=DOCS["questions"]):
        n = rounds * DOCS["num_docs"]
        have = [outs for (d, r), outs in memo.items() if d == dtype and r >= rounds]
        if not have:  # prompts run one at a time: a round's outputs do not depend on later rounds
            have = [one_at_a_time(LLM(tiny, **ROOMY, kv_cache_dtype=dtype), prompts_of(1)[:n])]
            memo[dtype, rounds] = have[0]
        return have[0][:n]
    return get


# ------------------------------------------------------------------------------ the cache alone

@pytest.mark.parametrize("dt", QUANT)
def test_read_write_blocks_moves_an_open_block_and_resumes_bit_exact(dt):
    bs = 8
    c = create_kv_cache(TINY, num_blocks=10, block_size=bs, kv_cache_dtype=dt)
    k, v = samples(40, (16, 2, 16)), samples(41, (16, 2, 16))
    write_seq(c, [2, 5], k[:13], v[:13], [9, 1, 1, 1, 1])  # block 2 sealed, block 5 open (5 tokens)
    # Targets that hold something else: 6 an open block of another sequence, 7 a sealed one.
    write_seq(c, [7, 6], samples(42, (11, 2, 16)), samples(43, (11, 2, 16)), [11])
    assert len(c.read_blocks(torch.tensor([2]))) == len(c.fields) + 1  # sealed: codes + fill only
    data = c.read_blocks(torch.tensor([2, 5]))
    assert len(data) == len(c.fields) + 3 and not data[-1][0].any() and data[-1][1].any()
    assert [(tuple(t.shape[1:]), t.dtype) for t in data[-2:]] == c.open_block_layout
    c.write_blocks(torch.tensor([7, 6]), data)
    assert int((c.res_owner[0] == 6).sum()) == 1  # block 6's old entry was replaced, not leaked
    for layer in range(c.num_layers):
        assert torch.equal(c.gather(layer, torch.tensor([7, 6]))[0], c.gather(layer, torch.tensor([2, 5]))[0])
    # Both copies continue: the moved open block seals with the statistics of all its tokens.
    for table in ([2, 5], [7, 6]):
        for t in range(13, 16):
            p = torch.tensor([t])
            slot = torch.tensor(table)[p // bs] * bs + p % bs
            for layer in range(c.num_layers):
                c.write(layer, slot, k[t:t + 1] * (layer + 1), v[t:t + 1] * (layer + 1))
    assert bool((c.block_res[:, [5, 6]] < 0).all())  # both sealed now
    for name, t in c.fields.items():
        assert torch.equal(t[:, [7, 6]].view(torch.uint8), t[:, [2, 5]].view(torch.uint8)), name
    # Sealed-only contents written over an open block: its residual entry is dropped, so gather
    # and copy_blocks (the bit-exact whole-block path) see the restored codes.
    write_seq(c, [8], k[:3], v[:3], [3])
    c.write_blocks(torch.tensor([8]), c.read_blocks(torch.tensor([2])))
    assert bool((c.block_res[:, 8] < 0).all())
    c.copy_blocks([BlockCopy(8, 9, bs)])
    for layer in range(c.num_layers):
        assert torch.equal(c.gather(layer, torch.tensor([9]))[1], c.gather(layer, torch.tensor([2]))[1])
    with pytest.raises(ValueError, match="write_blocks takes"):
        c.write_blocks(torch.tensor([8]), data[:2])


def test_direct_formats_store_their_fields_only():
    """No residual (static fp8 scales, int keys per token): a block, open or not, is its codes."""
    scales = KVScales(torch.full((2,), 0.05), torch.full((2,), 0.05))
    caches = [Fp8PagedKVCache(TINY, num_blocks=6, block_size=8, dtype=torch.float32, kv_scales=scales),
              IntPagedKVCache(TINY, num_blocks=6, block_size=8, dtype=torch.float32,
                              kv_cache_dtype="int4", residual=False)]
    for c in caches:
        k, v = samples(60, (13, 2, 16)), samples(61, (13, 2, 16))
        write_seq(c, [1, 2], k, v, [9, 4])
        data = c.read_blocks(torch.tensor([1, 2]))
        assert len(data) == len(c.fields) and c.open_block_layout == []
        c.write_blocks(torch.tensor([4, 3]), data)
        for layer in range(c.num_layers):
            moved, original = (c.gather(layer, torch.tensor(t))[1] for t in ([4, 3], [1, 2]))
            assert torch.equal(moved, original)


# -------------------------------------------------------------------------- through the engine

@pytest.mark.parametrize("dt,tier", [("fp8_e4m3", "host"), ("int8", "host"), ("int4", "host"),
                                     ("int4", "disk")])
@pytest.mark.slow
def test_working_set_4x_pool_matches_roomy_pool(tiny, roomy_outputs, tmp_path, dt, tier):
    flags = dict(swap_space=0.01) if tier == "host" else dict(kv_disk_path=str(tmp_path / "kv"),
                                                                kv_disk_size="64MiB")
    llm = LLM(tiny, **TIGHT, kv_cache_dtype=dt, **flags)
    try:
        assert one_at_a_time(llm, prompts_of(1)) == roomy_outputs(dt)
        s = llm.engine.get_stats()
        assert s.num_cached_block_evictions >= 4 * POOL
        assert s.tier_hits[tier] > 0 and s.kv_restored_blocks > 0, s.tier_hits
        assert s.tier_corrupt[tier] == 0 and s.tier_errors[tier] == 0
        llm.engine.kv.check_integrity()
    finally:
        llm.engine.close()


def run_with_urgent_arrival(llm, low, urgent, at_step):
    """`low` runs alone; after `at_step` steps `urgent` (priority 0) arrives and, the pool being
    too small for both, preempts it. Outputs by request id."""
    e, got = llm.engine, {}
    e.add_request("low", low, greedy(30), priority=1)
    for step in range(1, 1000):
        for o in e.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        if step == at_step:
            e.add_request("urgent", urgent, greedy(20), priority=0)
        if not e.has_unfinished_requests():
            return got
    raise AssertionError("requests did not finish")


@contextlib.contextmanager
def preempted_by_urgent(model, seed: int, pool: int, **settings):
    """`low` and `urgent` alone on a roomy pool (the outputs wanted), then through
    run_with_urgent_arrival on `pool` blocks with swap preemption, one request per step (see
    test_swap_preemption_resumes_exactly). Yields (the engine, its outputs, the wanted ones)."""
    rng = random.Random(seed)
    low, urgent = [rng.randrange(256) for _ in range(45)], [rng.randrange(256) for _ in range(60)]
    common = dict(check_integrity=True, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=1,
                  scheduling_policy="priority", **settings)
    alone = LLM(model, **common, num_gpu_blocks_override=200)
    want = {"low": alone.generate([low], greedy(30), use_tqdm=False)[0].outputs[0].token_ids,
            "urgent": alone.generate([urgent], greedy(20), use_tqdm=False)[0].outputs[0].token_ids}
    llm = LLM(model, **common, num_gpu_blocks_override=pool, preemption_mode="swap", swap_space=0.01)
    try:
        yield llm, run_with_urgent_arrival(llm, low, urgent, at_step=9), want
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["fp8_e4m3", "int4"])
def test_swap_preemption_resumes_exactly(tiny, dt):
    """One request per step throughout (max_num_seqs=1), so that the run with a preemption and the
    runs without compute with the same matrix shapes: CPU GEMM rows change in the last bits with
    the batch size, and quantization turns such a difference into a whole code step. So any
    difference left is the swap's. (Sealing the open block on swap-out instead of carrying its
    residual makes int4 diverge here, as does recompute preemption.)"""
    with preempted_by_urgent(tiny, 5, 14, dtype="float32", kv_cache_dtype=dt, block_size=8) as (llm, got, want):
        # After 9 steps `low` holds 53 tokens: 6 sealed blocks and an open one (5 tokens).
        assert got == want
        s = llm.engine.get_stats()
        assert s.num_swapped_preemptions == 1 and s.num_swap_fallbacks == 0
        assert s.resume_prefix_cache_hits == 53  # nothing recomputed
        assert s.tier_hits["host"] % 8 == 5  # the open block came back from the host tier
        assert llm.engine.kv_tiers.host.held_bytes == 0
        llm.engine.kv.check_integrity()


def test_other_kv_dtype_never_restores_from_a_shared_disk_tier(tiny, roomy_outputs, tmp_path):
    disk = dict(kv_disk_path=str(tmp_path / "kv"), kv_disk_size="64MiB")
    first_round = documents_workload(1, **DOCS)[0]  # each document once: any hit would be int4's
    writer = LLM(tiny, **TIGHT, kv_cache_dtype="int4", **disk)
    one_at_a_time(writer, first_round + first_round[:1])  # documents evicted: written as int4
    written = writer.engine.setup.fingerprint.hex
    writer.engine.close()
    assert sum(n.startswith(written) for n in os.listdir(tmp_path / "kv")) >= DOCS["num_docs"]
    for dt in ("fp8_e4m3", "auto"):
        reader = LLM(tiny, **TIGHT, kv_cache_dtype=dt, **disk)
        try:
            assert reader.engine.setup.fingerprint.hex != written
            assert one_at_a_time(reader, first_round) == roomy_outputs(dt, rounds=1)
            assert reader.engine.get_stats().tier_hits.get("disk", 0) == 0
            # Even under a colliding fingerprint, an int4 block does not fit this cache's layout.
            int4 = create_kv_cache(reader.engine.model_config, num_blocks=1, block_size=BS,
                                   kv_cache_dtype="int4")
            payload = pack_block([t[0] for t in int4.read_blocks(torch.tensor([0]))])
            with pytest.raises(ValueError, match="block layout"):
                reader.engine.kv_offloader.decode(memoryview(payload))
        finally:
            reader.engine.close()


@pytest.mark.parametrize("dt", ["int8", "fp8_e4m3"])
def test_residual_pool_holds_a_full_batch_beside_a_chunk_cut_mid_block(tiny, dt, monkeypatch):
    """max_num_seqs running sequences each hold an open block; a prefill chunk that the token
    budget cut mid-block continues in its open block and ends in a new one, so one write needs
    max_num_seqs + 1 entries. Sized at exactly max_num_seqs the pool ran dry there and the step
    failed (found on `random` with --max-num-seqs 64); now such a step grows the pool."""
    from kvserve.cache import quantized

    rng = random.Random(8)
    # Step 1 (40 tokens): three 10-token prompts whole and the long one's first 10 tokens (cut
    # mid-block). Step 2: three decodes beside the long prompt's next chunk, tokens 10..46.
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (10, 10, 10, 100)]
    common = dict(dtype="float32", kv_cache_dtype=dt, block_size=16, max_model_len=128,
                  max_num_batched_tokens=40, max_num_seqs=4, num_gpu_blocks_override=64)
    llm = LLM(tiny, **common)
    assert llm.engine.runner.kv_cache.num_residual_blocks == 5
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 4
    # One entry short (the sizing before this was found), standing in for the case no fixed size
    # covers (prompt chunks starting and ending mid-block): the pool grows for that step instead
    # of failing it, and the output is the same.
    monkeypatch.setattr(quantized, "residual_blocks_for", lambda max_num_seqs: max_num_seqs)
    short = LLM(tiny, **common)
    again = short.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert short.engine.runner.kv_cache.num_residual_blocks > 4


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["int8", "int4", "fp8_e4m3"])
def test_swap_preemption_resumes_exactly_through_the_staged_kernel(tiny_d64, dt):
    """As test_swap_preemption_resumes_exactly, in bf16 at head_dim 64 and block size 16, where
    (on AVX512-BF16 CPUs) attention over the quantized cache goes through the staging scratch:
    a swapped-out open block comes back into a residual entry the staging pass reads, and the
    output must not change by a token."""
    with preempted_by_urgent(tiny_d64, 6, 7, dtype="bfloat16", kv_cache_dtype=dt, block_size=16) as (llm, got, want):
        # After 9 steps `low` holds 53 tokens: 3 sealed blocks and an open one (5 tokens).
        assert got == want
        s = llm.engine.get_stats()
        assert s.num_swapped_preemptions == 1 and s.resume_prefix_cache_hits == 53
        assert s.tier_hits["host"] % 16 == 5  # the open block came back from the host tier
        if varlen_kernel_for(torch.bfloat16, 64, torch.device("cpu")) is not None:
            assert llm.engine.runner.model.attn._scratch is not None  # the staged path ran
