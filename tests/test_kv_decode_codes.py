"""Decode attention over a quantized cache's codes in place (csrc/decode_quantized.cpp; fp8 e4m3 on
AMX tiles where the CPU has them, csrc/decode_fp8_amx.h).

A decode-only step over an int8, int4 or fp8 cache is not staged: the kernel folds the key scales into the
query, the value scales into the probabilities, and reads the codes. Checked here: its output
matches a float64 reference over the cache's values dequantized in float32 (the codes are exact
there, so the tolerance is the bf16 output's rounding), across block sizes, head sizes, GQA
ratios, open blocks and evicted ones the step's write re-opens, shared blocks, contexts long
enough to be split over spans,
and the decodes of mixed steps (whose prompt chunks are staged, and decodes sharing a prefix);
int8, int4, fp8 e4m3 and e5m2 codes; layouts it does not read (key groups shorter than 16
tokens, caches without a residual pool) are staged instead; and an engine with an int8, fp8 or
int4 cache decodes through it end to end.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fidelity import text_prompts
from kv_cases import assert_paths_agree, fill_history, make_cache, reference_float64

from kvserve.attention import cpu as cpu_backend
from kvserve.attention.base import build_attention_metadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.ops.cpu_kernels import quantized_decode_tiles_enabled

codes_kernel = pytest.mark.needs("avx512_bf16")
fp8_tiles = pytest.mark.needs("amx")


def assert_codes_output_close(got, exact, tiles: bool):
    """The codes kernels' output against float64 over the exactly dequantized cache. The float32
    kernel (every format): within the bf16 output's rounding (half an ulp, 2^-9 relative; |ref|
    stays below ~2 here). fp8 on AMX tiles rounds the probabilities to bf16 before P.V, as the bf16
    kernels do (2^-9 relative each: up to ~0.009 for |v| <= 4.5) and then the output: atol 1.5e-2,
    the bf16 kernels' tolerance (test_cpu_decode_kernel.py)."""
    err = (got - exact).abs()
    if tiles:
        assert float(err.max()) <= 1.5e-2, float(err.max())
    else:
        assert float((err - exact.abs() * 2 ** -8).max()) <= 1e-4, float(err.max())


def on_tiles(variant: str, head_dim: int = 64) -> bool:
    """Whether decode_step's cache of `variant` is read on AMX tiles here (e4m3, head_dim 64)."""
    return variant.startswith("fp8") and "e5m2" not in variant and head_dim == 64 and quantized_decode_tiles_enabled()


def decode_step(variant, seq_lens, heads=9, kv_heads=3, head_dim=64, bs=16, residual_blocks=None, share=False,
                seed=3):
    """A cache holding seq_lens[i] - 1 tokens per sequence (plus, with `share`, the first
    sequence's full blocks at the head of every table), and one decode token each. With
    `residual_blocks`, sequences outside the step were written after these, so the pool evicted
    (quantized as they stood) open blocks the step then re-opens."""
    bystanders = [23, 45, 61, 77, 90, 13, 29, 50] if residual_blocks else []
    need = sum(-(-n // bs) for n in seq_lens + bystanders) + 4
    # Sealing at step end (the engine's setting): a block this step fills stays open until then.
    cache = make_cache(variant, num_blocks=need, block_size=bs, kv_heads=kv_heads, head_dim=head_dim,
                       num_residual_blocks=residual_blocks, seal_at_step_end=True)
    start = [n - 1 for n in seq_lens]
    written = fill_history(cache, 1, start + bystanders, seed=seed)
    tables = written[:len(seq_lens)]
    if share:  # prefix caching: later sequences' leading full blocks are the first one's
        shared = tables[0][:start[0] // bs]
        for t, n in zip(tables[1:], start[1:]):
            k = min(len(shared), n // bs)
            t[:k] = shared[:k]
    used = {b for t in written for b in t}
    free = [b for b in range(cache.num_blocks) if b not in used]
    for t, n in zip(tables, seq_lens):
        while len(t) < -(-n // bs):
            t.append(free.pop())
    meta = build_attention_metadata(start, [1] * len(seq_lens), tables, bs)
    torch.manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), heads, head_dim).bfloat16()
    k = (torch.randn(len(seq_lens), kv_heads, head_dim) * 2 + 1.5).bfloat16()
    v = torch.randn(len(seq_lens), kv_heads, head_dim).bfloat16()
    return cache, meta, q, k, v


def float32_reference(cache, meta, q, k, v, heads, kv_heads, head_dim):
    """float64 attention over the cache as dequantized in float32 (the codes' exact values; open
    blocks from their bf16 residual rows), the step's own tokens as computed."""
    class Float32View:  # what _reference_float64 reads: gather over every block
        num_blocks, block_size = cache.num_blocks, cache.block_size

        @staticmethod
        def gather(layer, ids):
            model_dtype, cache.dtype = cache.dtype, torch.float32  # _load_blocks dequantizes into it
            try:
                kk, vv = cache._load_blocks(layer, ids)
            finally:
                cache.dtype = model_dtype
            entry = cache.block_res[layer, ids]
            open_ = entry >= 0
            kk[open_] = cache.res_kv[layer, entry[open_], 0].float()
            vv[open_] = cache.res_kv[layer, entry[open_], 1].float()
            return kk.flatten(0, 1), vv.flatten(0, 1)

    return reference_float64(Float32View, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads, fresh=(k, v))


@codes_kernel
@pytest.mark.parametrize("variant,seq_lens,heads,kv_heads,head_dim,bs,residual_blocks,share", [
    ("int8", [1, 15, 16, 17, 300, 40, 64, 33], 9, 3, 64, 16, None, False),
    ("int8", [1, 15, 16, 17, 300, 40, 64, 33], 9, 3, 64, 16, 9, False),  # blocks evicted, re-opened
    ("int8", [40, 100, 200, 31, 64], 12, 3, 64, 32, None, False),  # two spans per block, 4 rows
    ("int8", [70, 2, 129, 33], 8, 1, 128, 16, None, False),  # 8 rows of 128 channels: 4 groups of 2
    ("int8", [200, 180, 230, 190], 6, 6, 64, 16, None, True),  # no GQA; shared prefix blocks
    ("int8", [3000], 9, 3, 64, 16, None, False),  # one long sequence: split over spans, merged
    ("int8", [2500, 7, 1200], 4, 2, 128, 16, None, False),
    ("fp8", [1, 15, 16, 17, 300, 40, 64, 33], 9, 3, 64, 16, 9, False),  # e4m3, per-head scales, key means
    ("fp8 tensor", [200, 180, 230, 190], 6, 6, 64, 16, None, True),
    ("fp8 uncentered", [2500, 7, 1200], 4, 2, 128, 16, None, False),
    ("fp8_e5m2", [70, 2, 129, 33], 8, 1, 128, 32, None, False),
    ("int4", [1, 15, 16, 17, 300, 40, 64, 33], 9, 3, 64, 16, 9, False),  # e4m3 metadata, exponents, symmetric values
    ("int4", [2500, 7, 1200], 4, 2, 128, 16, None, False),
    ("int4 full-meta", [200, 180, 230, 190], 6, 6, 64, 32, None, True),  # float16 metadata, groups of 32
    ("int4", [40, 77, 5], 4, 2, 64, 16, None, False),  # e4m3 scales 2 bytes apart: looked up one by one
    ("int4", [70, 2, 129], 3, 1, 128, 16, None, False),  # 3 rows of 128 channels: groups of 2 and 1
    ("int8", [70, 2, 129], 3, 1, 128, 16, None, False),
])
@pytest.mark.slow
def test_decode_over_codes_matches_float64_over_the_dequantized_cache(
        variant, seq_lens, heads, kv_heads, head_dim, bs, residual_blocks, share, monkeypatch):
    # The float32 kernel for every format; fp8 on AMX tiles has its own test below.
    monkeypatch.setenv("KVSERVE_AMX_ATTENTION", "0")
    cache, meta, q, k, v = decode_step(variant, seq_lens, heads, kv_heads, head_dim, bs, residual_blocks, share)
    # No cascade: decodes sharing a prefix would be staged (test_shared_prefix_groups_...).
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, cascade=False)
    got = backend.forward(1, q, k, v, cache, meta).double()
    assert "codes_split" in meta.backend_state and "staged" not in meta.backend_state  # the codes kernel ran
    assert "staged_subset" not in meta.backend_state
    if residual_blocks is not None:
        assert cache.residual_evictions > 0
    ref = float32_reference(cache, meta, q, k, v, heads, kv_heads, head_dim)
    # The output is bf16: half an ulp is 2^-9 relative; |ref| stays below ~2 here.
    err = (got - ref).abs()
    assert float((err - ref.abs() * 2 ** -8).max()) <= 1e-4, float(err.max())

    # The staged path on the same step reads every value rounded to bf16 first; it lands
    # farther from the exact values than the codes path does.
    cache2, meta2, q2, k2, v2 = decode_step(variant, seq_lens, heads, kv_heads, head_dim, bs, residual_blocks,
                                            share)
    staged = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, decode_on_codes=False)
    other = staged.forward(1, q2, k2, v2, cache2, meta2).double()
    assert "staged" in meta2.backend_state
    assert float(err.mean()) < float((other - ref).abs().mean())


@codes_kernel
@pytest.mark.parametrize("variant", ["int8 g8", "int4 g8"])
def test_layouts_the_codes_kernel_does_not_read_are_staged(variant):
    """Keys in groups of 8 tokens (a scale that changes inside a 16-key span) are declined by
    the kernel; the step is then staged, correctly, and the backend does not ask again for
    that cache."""
    heads, kv_heads, head_dim = 9, 3, 64
    cache, meta, q, k, v = decode_step(variant, [5, 40, 77], heads, kv_heads, head_dim)
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
    got = backend.forward(1, q, k, v, cache, meta).double()
    assert "staged" in meta.backend_state and backend._codes_unreadable is cache
    ref = reference_float64(cache, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads, fresh=(k, v))
    torch.testing.assert_close(got, ref, atol=1.5e-2, rtol=0)


@codes_kernel
@pytest.mark.parametrize("variant", ["fp8 static", "int8 direct"])
def test_caches_without_a_residual_pool_are_staged(variant):
    """Static fp8 scales and per-token int keys quantize a decode's own token when it is written;
    the staged path attends to it as computed (its overlay), and so do these steps."""
    heads, kv_heads, head_dim = 9, 3, 64
    cache, meta, q, k, v = decode_step(variant, [5, 40, 77], heads, kv_heads, head_dim)
    CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5).forward(1, q, k, v, cache, meta)
    assert "staged" in meta.backend_state and "codes_split" not in meta.backend_state


def mixed_step(variant, seed=2):
    """Decodes and prompt chunks interleaved in one step (as the scheduler mixes running decodes,
    resumed chunks and new prompts), over a cache that seals at step end."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    seq_lens = [1, 17, 300, 40, 64, 200, 33, 90]
    query_lens = [1, 17, 1, 16, 1, 100, 6, 1]
    start = [n - q for n, q in zip(seq_lens, query_lens)]
    cache = make_cache(variant, num_blocks=70, seal_at_step_end=True)
    tables = fill_history(cache, 1, start, seed=seed)
    for t, n in zip(tables, seq_lens):
        used = {b for tt in tables for b in tt}
        t += [b for b in range(cache.num_blocks) if b not in used][:-(-n // bs) - len(t)]
    meta = build_attention_metadata(start, query_lens, tables, bs)
    torch.manual_seed(seed + 3)
    q = torch.randn(meta.num_tokens, heads, head_dim).bfloat16()
    k = (torch.randn(meta.num_tokens, kv_heads, head_dim) * 2 + 1.5).bfloat16()
    v = torch.randn(meta.num_tokens, kv_heads, head_dim).bfloat16()
    return cache, meta, q, k, v


@codes_kernel
@pytest.mark.parametrize("variant,stage_bytes", [("int8", None), ("fp8", None), ("int4", None),
                                                 ("int8", 2 * 2 * 3 * 64 * 16 * 2 * 3)])  # parts of <= 3 blocks
def test_mixed_steps_attend_decodes_over_codes_and_stage_only_the_prompts(variant, stage_bytes, monkeypatch):
    """The decodes of a mixed step go through the codes kernel; only the prompt chunks'
    sequences are staged (their rows are not contiguous here), and each part matches its
    reference: the decodes the float32-dequantized cache within the bf16 output's rounding, the
    prompts the bf16-dequantized cache within the varlen kernel's tolerance."""
    if stage_bytes is not None:
        monkeypatch.setattr(cpu_backend, "STAGE_BYTES", stage_bytes)
    heads, kv_heads, head_dim = 9, 3, 64
    cache, meta, q, k, v = mixed_step(variant)
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
    got = backend.forward(1, q, k, v, cache, meta).double()
    assert "codes_split" in meta.backend_state and "staged_subset" in meta.backend_state
    assert len(meta.backend_state["staged_subset"]) >= (3 if stage_bytes else 1)
    assert "staged" not in meta.backend_state
    staged_seqs = sorted(int(i) for plan in meta.backend_state["staged_subset"]
                         for i in np.asarray(meta.prefill_seq_ids)[plan.part.seqs])
    assert staged_seqs == meta.prefill_seq_ids == [1, 3, 5, 6]
    dec = meta.decode_token_ids
    exact = float32_reference(cache, meta, q, k, v, heads, kv_heads, head_dim)
    assert_codes_output_close(got[dec], exact[dec], on_tiles(variant))
    pre = torch.tensor([r for i in meta.prefill_seq_ids for r in range(meta.query_start_loc[i], meta.query_start_loc[i + 1])])
    ref = reference_float64(cache, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads, fresh=(k, v))
    torch.testing.assert_close(got[pre], ref[pre], atol=1.5e-2, rtol=0)


@codes_kernel
@pytest.mark.parametrize("variant", ["int8", "fp8", "int4"])
def test_decodes_sharing_a_prefix_are_staged_for_cascade_and_the_rest_go_over_codes(variant):
    """Decodes in a shared-prefix group (prefix caching: a system prompt, one document) are staged,
    so the bf16 kernel reads the shared blocks once for the whole group; decodes outside any group
    still go over the codes. Each matches its reference: the codes part the float32-dequantized
    cache within the bf16 output's rounding, the staged part the bf16-dequantized one."""
    heads, kv_heads, head_dim = 9, 3, 64
    # 0-4 and 6 share 4-12 leading blocks of sequence 0's; 5 shares only 2 (too few to group).
    cache, meta, q, k, v = decode_step(variant, [200, 180, 230, 190, 210, 40, 77], heads, kv_heads, head_dim,
                                       share=True)
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
    got = backend.forward(1, q, k, v, cache, meta).double()
    split = meta.backend_state["codes_split"]
    plans = meta.backend_state["staged_subset"]
    assert "staged" not in meta.backend_state and sum(p.varlen.groups.num_groups for p in plans) >= 1
    staged = [int(i) for i in split.staged_seqs]
    on_codes = [i for i in range(meta.num_seqs) if i not in staged]
    assert len(staged) >= 4 and 5 in on_codes
    assert torch.equal(split.codes.token_ids, torch.tensor([meta.query_start_loc[i] for i in on_codes]))
    rows = {"codes": torch.tensor([meta.query_start_loc[i] for i in on_codes]),
            "staged": torch.tensor([meta.query_start_loc[i] for i in staged])}
    exact = float32_reference(cache, meta, q, k, v, heads, kv_heads, head_dim)
    assert_codes_output_close(got[rows["codes"]], exact[rows["codes"]], on_tiles(variant))
    ref = reference_float64(cache, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads, fresh=(k, v))
    torch.testing.assert_close(got[rows["staged"]], ref[rows["staged"]], atol=1.5e-2, rtol=0)


@codes_kernel
def test_fp8_codes_are_staged_while_denormals_are_flushed(monkeypatch):
    """The float32 kernel's e4m3 codes reach float32 through denormals; with flush-to-zero on
    (MXCSR.DAZ) the step is staged instead, and the next step without it goes over the codes
    again. (The AMX path converts codes to bf16 by integer shifts and is not affected: below.)"""
    monkeypatch.setenv("KVSERVE_AMX_ATTENTION", "0")
    heads, kv_heads, head_dim = 9, 3, 64
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
    assert torch.set_flush_denormal(True)
    try:
        cache, meta, q, k, v = decode_step("fp8", [5, 40, 77])
        got = backend.forward(1, q, k, v, cache, meta).double()
    finally:
        torch.set_flush_denormal(False)
    assert "staged" in meta.backend_state and backend._codes_unreadable is None
    ref = reference_float64(cache, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads, fresh=(k, v))
    torch.testing.assert_close(got, ref, atol=1.5e-2, rtol=0)
    cache, meta, q, k, v = decode_step("fp8", [5, 40, 77])
    backend.forward(1, q, k, v, cache, meta)
    assert "codes_split" in meta.backend_state and "staged" not in meta.backend_state


FP8_TILE_CASES = [  # (variant, seq_lens, heads, kv_heads, bs, residual_blocks, share)
    ("fp8", [1, 15, 16, 17, 300, 40, 64, 33], 9, 3, 16, 9, False),  # open, evicted and re-opened blocks
    ("fp8", [1, 15, 16, 17, 300, 40, 64, 33], 9, 3, 16, None, False),
    ("fp8", [40, 100, 200, 31, 64], 12, 3, 32, None, False),  # two 16-key halves per block, 12 rows
    ("fp8", [3000], 9, 3, 16, None, False),  # one long sequence: spans merged; several mean groups
    ("fp8", [70, 2, 129, 33], 16, 1, 16, None, False),  # 16 query rows, one K/V head
    ("fp8 tensor", [200, 180, 230, 190], 6, 6, 16, None, True),  # one scale per block, no GQA
    ("fp8 uncentered", [2500, 7, 1200], 4, 2, 16, None, False),  # no key means
]


@codes_kernel
@fp8_tiles
@pytest.mark.parametrize("variant,seq_lens,heads,kv_heads,bs,residual_blocks,share", FP8_TILE_CASES)
def test_fp8_decode_on_amx_tiles_matches_float64(variant, seq_lens, heads, kv_heads, bs, residual_blocks, share,
                                                 monkeypatch):
    """e4m3 codes read on AMX tiles (csrc/decode_fp8_amx.h): the codes become bf16 exactly, the
    key means and scales are folded as in the float32 kernel. Against float64 over the exactly
    dequantized cache within the bf16 kernels' tolerance, closer on average than staging (which
    rounds every dequantized value to bf16), and not the float32 kernel's output (the path ran)."""
    head_dim = 64
    outs = {}
    for tiles in ("1", "0"):
        monkeypatch.setenv("KVSERVE_AMX_ATTENTION", tiles)
        cache, meta, q, k, v = decode_step(variant, seq_lens, heads, kv_heads, head_dim, bs, residual_blocks, share)
        backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, cascade=False)
        outs[tiles] = backend.forward(1, q, k, v, cache, meta).double()
        assert "codes_split" in meta.backend_state and "staged" not in meta.backend_state
    got = outs["1"]
    assert not torch.equal(got, outs["0"])
    assert not torch.isnan(got).any()
    ref = float32_reference(cache, meta, q, k, v, heads, kv_heads, head_dim)
    assert_codes_output_close(got, ref, tiles=True)
    cache2, meta2, q2, k2, v2 = decode_step(variant, seq_lens, heads, kv_heads, head_dim, bs, residual_blocks, share)
    staged = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, decode_on_codes=False)
    other = staged.forward(1, q2, k2, v2, cache2, meta2).double()
    assert float((got - ref).abs().mean()) < float((other - ref).abs().mean())


@codes_kernel
@fp8_tiles
def test_fp8_tiles_read_the_codes_while_denormals_are_flushed():
    """The tiles path never does float32 arithmetic on a code, so flush-to-zero does not send the
    step to staging."""
    heads, kv_heads, head_dim = 9, 3, 64
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
    cache, meta, q, k, v = decode_step("fp8", [5, 40, 77])
    assert torch.set_flush_denormal(True)
    try:
        got = backend.forward(1, q, k, v, cache, meta).double()
    finally:
        torch.set_flush_denormal(False)
    assert "codes_split" in meta.backend_state and "staged" not in meta.backend_state
    assert_codes_output_close(got, float32_reference(cache, meta, q, k, v, heads, kv_heads, head_dim), tiles=True)


@codes_kernel
def test_sliding_windows_are_staged():
    heads, kv_heads, head_dim = 9, 3, 64
    cache, meta, q, k, v = decode_step("int8", [5, 40])
    CPUAttentionBackend(heads, kv_heads, head_dim, scale=0.125, sliding_window=16).forward(1, q, k, v, cache, meta)
    assert "staged" in meta.backend_state and "codes_split" not in meta.backend_state


@pytest.mark.slow
@codes_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_engine_with_a_quantized_cache_decodes_over_the_codes(kv_cache_dtype, monkeypatch, smollm2_hf):
    """The embedded model, bf16, int8 / fp8 / int4 cache: decode steps take the codes kernel, prompts the
    staged one, and greedy output equals the all-staged run's up to near-ties (the staged path
    rounds every cached value to bf16 first, so the two part only where two logits are within
    2 bf16 ulps)."""
    from kvserve import LLM, SamplingParams

    calls = {"codes": 0}
    real = cpu_backend.CPUAttentionBackend._decode_on_codes

    def spy(self, *a):
        ran = real(self, *a)
        calls["codes"] += ran
        return ran

    monkeypatch.setattr(cpu_backend.CPUAttentionBackend, "_decode_on_codes", spy)
    llm = LLM(None, dtype="bfloat16", max_model_len=512, kv_cache_memory=64 * 2**20, kv_cache_dtype=kv_cache_dtype,
              max_num_seqs=8)
    prompts = text_prompts(llm.tokenizer, (5, 40, 130, 17, 64, 9, 100, 33), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    attn = llm.engine.runner.model.attn
    runs = {}
    for on in (True, False):
        attn.decode_on_codes = on
        calls["codes"] = 0
        # The second run would otherwise read the first one's cached (quantized) prompt blocks,
        # where the first attended to its fresh K/V: compare the decode paths alone.
        llm.reset_prefix_cache()
        runs[on] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        layers = llm.engine.runner.model.config.num_hidden_layers
        assert (calls["codes"] >= 10 * layers) if on else calls["codes"] == 0
    # Both read the same codes; they round differently on the way (the staged copy to bf16).
    assert_paths_agree(runs[True], runs[False], prompts, smollm2_hf, roundings=2)
