"""Quantized KV caches through the bf16 varlen kernel (attention/staging.py).

The step's blocks are dequantized into a bf16 "pairs" scratch - by the compiled
`stage_quantized_pairs`, or by the cache's own `gather` where that is not built - and the varlen
kernel reads the scratch through renumbered block tables. Checked here: the compiled staging is
bit-equal to `gather` for every format and its variants (open blocks in the residual, partial
blocks evicted from it, static scales, per-token keys); attention over the scratch matches a
float64 reference over the dequantized cache, also when the step is split into several parts;
the part planner's invariants; and an engine with an int8 cache takes this path end to end.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fidelity import text_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cases import assert_paths_agree, fill_history, make_cache, reference_float64

from kvserve.attention import cpu as cpu_backend
from kvserve.attention import staging
from kvserve.attention.base import build_attention_metadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.attention.staging import StageScratch, plan_stage_parts
from kvserve.ops.cpu_kernels import varlen_kernel_for

varlen_available = pytest.mark.needs("avx512_bf16")


VARIANTS = ["int8", "int8 g8", "int8 direct", "int8 compact", "int4", "int4 full-meta", "int4 direct",
            "fp8", "fp8 tensor", "fp8 uncentered", "fp8_e5m2", "fp8 static"]


@pytest.mark.needs("avx512_bf16")
@pytest.mark.parametrize("variant,block_size,head_dim", [(v, 16, 64) for v in VARIANTS] + [
    ("int8", 32, 128), ("int4", 64, 64), ("fp8", 32, 128), ("int4 direct", 32, 128)])
@pytest.mark.slow
def test_compiled_staging_is_bit_equal_to_gather(variant, block_size, head_dim):
    bs = block_size
    # 4 residual entries for 5 partial blocks: the first is evicted (quantized as it stands).
    cache = make_cache(variant, num_blocks=40, block_size=bs, head_dim=head_dim, num_residual_blocks=4)
    lens = [n * bs // 16 for n in (40, 16, 33, 100, 7, 70)]
    tables = fill_history(cache, 1, lens, seed=1)
    # Then one more token for two sequences: the evicted block re-opened, a new block started.
    free = next(b for b in range(40) if all(b not in t for t in tables))
    meta = build_attention_metadata([lens[0], lens[1]], [1, 1], [tables[0], tables[1] + [free]], bs)
    new = [torch.randn(2, 3, head_dim).bfloat16() for _ in range(2)]
    cache.write(1, meta.slot_mapping, *new)
    ids = torch.tensor(sorted({b for t in tables for b in t} | {free}), dtype=torch.int64)
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
    if cache.staged:
        assert bool((cache.residual(1)[1][ids] >= 0).any())  # some blocks are open
    compiled = StageScratch()
    k1, v1 = (t[:ids.numel()].clone() for t in compiled.fill(cache, 1, ids))
    fallback = StageScratch()
    fallback._stage = None
    k2, v2 = (t[:ids.numel()].clone() for t in fallback.fill(cache, 1, ids))
    assert torch.equal(k1.view(torch.int16), k2.view(torch.int16))
    assert torch.equal(v1.view(torch.int16), v2.view(torch.int16))
    # And the scratch holds what gather returns, in the pairs layout.
    k_ref, v_ref = cache.gather(1, ids)
    k_tok = k1.permute(0, 3, 1, 2, 4).reshape(k_ref.shape)  # [U, H, D/2, bs, 2] -> [U*bs, H, D]
    v_tok = v1.permute(0, 2, 4, 1, 3).reshape(v_ref.shape)  # [U, H, bs/2, D, 2] -> [U*bs, H, D]
    assert torch.equal(k_tok, k_ref) and torch.equal(v_tok, v_ref)


@varlen_available
@pytest.mark.parametrize("variant,window,stage_bytes", [
    ("int8 via gather", None, None),  # where stage_quantized_pairs is not built
    ("int8", None, None), ("int4", None, None), ("int4 direct", 33, None), ("fp8", None, None), ("fp8 static", 20, None),
    ("int8 direct", None, None),
    ("int8", None, 2 * 2 * 3 * 64 * 16 * 2 * 3),  # parts of at most 3 blocks: one part per sequence or so
])
@pytest.mark.slow
def test_attention_over_the_scratch_matches_float64(variant, window, stage_bytes, monkeypatch):
    """Decodes, fresh prompts and mid-sequence chunks in one step, over a quantized cache. The
    tolerance is the varlen kernel's own (test_cpu_decode_kernel.py): the scratch holds exactly
    the dequantized values the reference reads."""
    if stage_bytes is not None:
        monkeypatch.setattr(cpu_backend, "STAGE_BYTES", stage_bytes)
    if "via gather" in variant:
        monkeypatch.setattr(staging, "stage_quantized_kernel", lambda: None)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16

    def step():
        seq_lens = [1, 17, 300, 40, 64, 200, 33]
        query_lens = [1, 17, 1, 16, 1, 100, 6]
        start = [n - q for n, q in zip(seq_lens, query_lens)]
        cache = make_cache(variant, num_blocks=60)
        tables = fill_history(cache, 1, start, seed=2)  # the context before this step
        for t, n in zip(tables, seq_lens):  # room for this step's tokens
            used = {b for tt in tables for b in tt}
            t += [b for b in range(cache.num_blocks) if b not in used][:-(-n // bs) - len(t)]
        meta = build_attention_metadata(start, query_lens, tables, bs)
        torch.manual_seed(5)
        q = torch.randn(meta.num_tokens, heads, head_dim).bfloat16()
        k = (torch.randn(meta.num_tokens, kv_heads, head_dim) * 2 + 1.5).bfloat16()
        v = torch.randn(meta.num_tokens, kv_heads, head_dim).bfloat16()
        return cache, meta, q, k, v

    cache, meta, q, k, v = step()
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window)
    got = backend.forward(1, q, k, v, cache, meta).double()
    parts = meta.backend_state["staged"]  # the staged kernel ran, not the SDPA fallback
    assert len(parts) >= (3 if stage_bytes else 1)
    ref = reference_float64(cache, 1, meta, q, window, head_dim ** -0.5, heads, kv_heads, fresh=(k, v))
    torch.testing.assert_close(got, ref, atol=1.5e-2, rtol=0)
    # Knocking out the overlay of the step's own tokens is caught (quantized keys instead).
    if variant.startswith("int4"):
        cache, meta, q, k, v = step()
        backend._scratch.overlay = lambda *a: None
        with pytest.raises(AssertionError):
            torch.testing.assert_close(backend.forward(1, q, k, v, cache, meta).double(), ref, atol=1.5e-2, rtol=0)
        del backend._scratch.overlay
    # The SDPA path over an identical cache agrees on fresh prompts (which it, too, attends at
    # full precision; decodes and later chunks read the step's keys back from the cache there),
    # within both paths' bf16 errors added up.
    cache, meta, q, k, v = step()
    sdpa = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window,
                                 use_cpu_kernel=False)
    other = sdpa.forward(1, q, k, v, cache, meta).double()
    fresh = [r for i in range(meta.num_seqs) if meta.start_pos[i] == 0 and meta.query_lens[i] > 1
             for r in range(meta.query_start_loc[i], meta.query_start_loc[i + 1])]
    torch.testing.assert_close(got[fresh], other[fresh], atol=3e-2, rtol=0)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stage_parts_cover_every_sequence_and_renumber_its_blocks(data):
    n = data.draw(st.integers(1, 12))
    pool = data.draw(st.integers(4, 40))
    width = data.draw(st.integers(1, 8))
    tables = np.array([[data.draw(st.integers(0, pool - 1)) for _ in range(width)] for _ in range(n)])
    num_blocks = np.array([data.draw(st.integers(1, width)) for _ in range(n)])
    first = np.array([data.draw(st.integers(0, int(nb) - 1)) for nb in num_blocks])
    cap = data.draw(st.integers(1, 10))
    parts = plan_stage_parts(tables, first, num_blocks, cap)
    assert parts[0].seqs.start == 0 and parts[-1].seqs.stop == n
    for a, b in zip(parts, parts[1:]):
        assert a.seqs.stop == b.seqs.start
    for p in parts:
        ids = p.block_ids.numpy()
        assert len(set(ids.tolist())) == len(ids)  # each block staged once per part
        assert len(ids) <= cap or p.seqs.stop - p.seqs.start == 1
        for i in range(p.seqs.start, p.seqs.stop):
            cols = slice(first[i], num_blocks[i])
            assert (ids[p.tables[i - p.seqs.start, cols]] == tables[i, cols]).all()


@pytest.mark.slow
@varlen_available
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_engine_with_a_quantized_cache_runs_the_staged_kernel(kv_cache_dtype, monkeypatch, smollm2_hf):
    """The embedded model, bf16, with a quantized cache: every step goes through the staging
    path, and greedy output equals the SDPA path's under tests/fidelity.py's rule, with two
    bf16 roundings: the staged copy rounds the dequantized K/V to bf16, and the SDPA path reads a
    decode's own key back from the cache where the staged path keeps it at full precision."""
    from kvserve import LLM, SamplingParams

    staged_steps = []
    real = cpu_backend.CPUAttentionBackend._staged_plans

    def spy(self, meta, kv_cache, *args):
        fresh = "staged" not in meta.backend_state
        plans = real(self, meta, kv_cache, *args)
        staged_steps.append(fresh)
        return plans

    monkeypatch.setattr(cpu_backend.CPUAttentionBackend, "_staged_plans", spy)
    llm = LLM(None, dtype="bfloat16", max_model_len=512, kv_cache_memory=64 * 2**20, kv_cache_dtype=kv_cache_dtype,
              max_num_seqs=8)
    # int8 decode steps would read the codes in place (test_kv_decode_codes.py): staged here.
    llm.engine.runner.model.attn.decode_on_codes = False
    prompts = text_prompts(llm.tokenizer, (5, 40, 130, 17, 64, 9, 100, 33), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    runs = {}
    for kernel in (True, False):
        llm.engine.runner.model.attn.use_cpu_kernel = kernel
        staged_steps.clear()
        llm.reset_prefix_cache()  # or the second run reads the first one's quantized prompt blocks
        runs[kernel] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (sum(staged_steps) >= 10) if kernel else not staged_steps
    assert_paths_agree(runs[True], runs[False], prompts, smollm2_hf, roundings=2)


def test_block_sizes_the_staging_path_cannot_read_are_named_at_start_up(caplog):
    """A quantized cache at --block-size 8 falls back to SDPA; start-up says so and what to set."""
    backend = CPUAttentionBackend(9, 3, 64, scale=0.125)
    with caplog.at_level("WARNING"):
        assert backend.kv_cache_layout("int8", torch.bfloat16, 8, torch.device("cpu")) == "tokens"
        assert backend.kv_cache_layout("int8", torch.bfloat16, 16, torch.device("cpu")) == "tokens"
    if varlen_kernel_for(torch.bfloat16, 64, torch.device("cpu")) is not None:
        assert caplog.text.count("--block-size 8") == 1 and "SDPA over dequantized copies" in caplog.text
