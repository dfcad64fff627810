"""The compiled CPU decode kernel against the SDPA path over the same paged cache.

Both run through CPUAttentionBackend.forward on one step's metadata, so block tables, slot
mapping, GQA grouping, sliding windows and the scattered placement of blocks are exercised as the
engine uses them. Skipped only where no C++ compiler is installed.
"""
from __future__ import annotations

import random

import pytest
import torch
from fidelity import text_prompts
from kv_cases import all_kv, assert_paths_agree, reference_float64

from kvserve.attention.base import build_attention_metadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.cache.paged import PagedKVCache
from kvserve.config import ModelConfig
from kvserve.ops.cpu_kernels import varlen_kernel_for

pytestmark = pytest.mark.needs("cpu_kernels")


def cfg(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * head_dim,
                       intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096)


def _layout(heads, kv_heads, head_dim, dtype, block_size, window=None):
    """The layout the engine would build the cache in for this backend (what the kernels read)."""
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=1.0, sliding_window=window)
    return backend.kv_cache_layout("auto", dtype, block_size, torch.device("cpu"))


def run_step(dtype, heads, kv_heads, head_dim, block_size, seq_lens, query_lens, window, seed):
    """One mixed step (decodes and prefill chunks) with K/V history already in scattered blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    cache = PagedKVCache(cfg(heads, kv_heads, head_dim), num_blocks=num_blocks, block_size=block_size,
                         dtype=dtype, layout=_layout(heads, kv_heads, head_dim, dtype, block_size))
    # History: every slot of every block random (slots past a sequence's length must be ignored).
    cache.kv.copy_(torch.randn_like(cache.kv, dtype=torch.float32).to(dtype))
    start = [n - q for n, q in zip(seq_lens, query_lens)]
    meta = build_attention_metadata(start, query_lens, tables, block_size)
    t = meta.num_tokens
    q = torch.randn(t, heads, head_dim).to(dtype)
    k = torch.randn(t, kv_heads, head_dim).to(dtype)
    v = torch.randn(t, kv_heads, head_dim).to(dtype)
    outs = []
    for use_kernel in (True, False):
        backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5,
                                        sliding_window=window, use_cpu_kernel=use_kernel)
        meta.backend_state.clear()
        outs.append(backend.forward(1, q, k, v, cache, meta).float())
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (4, 2, 16), (8, 2, 24)])
def test_decodes_match_sdpa(dtype, atol, heads, kv_heads, head_dim):
    seq_lens = [1, 5, 16, 17, 100, 300]
    got, ref = run_step(dtype, heads, kv_heads, head_dim, 16, seq_lens, [1] * len(seq_lens), None, 0)
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window_and_mixed_prefill(window):
    seq_lens = [3, 20, 64, 129, 50]
    query_lens = [1, 1, 1, 1, 9]  # the last sequence is a prefill chunk (SDPA in both runs)
    got, ref = run_step(torch.float32, 4, 2, 32, 8, seq_lens, query_lens, window, 1)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_many_sequences_take_the_all_heads_path():
    # >= 4 sequences per thread: each work item covers all K/V heads of a sequence.
    seq_lens = [random.Random(i).randint(1, 200) for i in range(40)]
    got, ref = run_step(torch.bfloat16, 9, 3, 64, 16, seq_lens, [1] * 40, None, 2)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=0)


# -- the bf16 varlen kernel (AVX512-BF16): decodes and prefill chunks of all sequences in one call --

varlen_available = pytest.mark.needs("avx512_bf16")


def _scattered_pairs_cache(seq_lens, heads, kv_heads, head_dim, block_size, rng):
    """A bf16 pairs-layout cache with each sequence's blocks shuffled over the pool (two spare
    blocks), every slot NaN: slots no sequence owns must never be read."""
    need = [-(-n // block_size) for n in seq_lens]
    ids = list(range(sum(need) + 2))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    cache = PagedKVCache(cfg(heads, kv_heads, head_dim), num_blocks=len(ids), block_size=block_size,
                         dtype=torch.bfloat16, layout="pairs")
    cache.kv.fill_(float("nan"))
    return cache, tables


def _decodes_over_history(seq_lens, seed, peak_every, peak):
    """One decode per sequence (9 / 3 heads, d 64, block 16) over a NaN-filled scattered cache
    holding its history, every `peak_every`-th key scaled by `peak`; with the float64 reference.
    Returns cache, meta, q, the history's K and V, each decode's row in them, and the reference."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    torch.manual_seed(seed)
    cache, tables = _scattered_pairs_cache(seq_lens, heads, kv_heads, head_dim, bs, random.Random(seed))
    hist = build_attention_metadata([0] * len(seq_lens), seq_lens, tables, bs)
    hist_k = torch.randn(hist.num_tokens, kv_heads, head_dim).bfloat16()
    hist_k[::peak_every] *= peak
    hist_v = torch.randn(hist.num_tokens, kv_heads, head_dim).bfloat16()
    cache.write(1, hist.slot_mapping, hist_k, hist_v)
    meta = build_attention_metadata([n - 1 for n in seq_lens], [1] * len(seq_lens), tables, bs)
    last = torch.tensor([hist.query_start_loc[i + 1] - 1 for i in range(len(seq_lens))])
    q = torch.randn(len(seq_lens), heads, head_dim).bfloat16()
    ref = reference_float64(cache, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads)
    return cache, meta, q, hist_k, hist_v, last, ref


@varlen_available
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, None), (9, 3, 64, 48, None), (4, 2, 128, 32, None), (4, 4, 64, 16, 20),
    (8, 2, 64, 64, 7), (32, 8, 64, 16, None), (16, 2, 64, 16, None), (6, 2, 128, 16, None)])
@pytest.mark.slow
def test_varlen_kernel_matches_float64(heads, kv_heads, head_dim, block_size, window):
    """On AMX a decode's item covers as many K/V heads as 16 query rows hold: all 3 here, 4
    with g = 1, 2 with g = 4, and two items of 4 heads each for 32 query heads over 8. Without
    AMX (attend_decode) all of them; g = 8 takes its q.k and P.V rows in two groups of 4, and
    head_dim 128 its P.V rows in groups of 2 (3 = 2 + 1).
    Tolerance: q.k products of bf16 inputs are exact in float32 and accumulate in float32; the
    probabilities are rounded to bf16 before P.V (relative 2^-9 each, so |error| <= 2^-9 max|v|,
    ~0.009 for |v| <= 4.5) and the output is rounded to bf16 (2^-9 |o|): atol 1.5e-2."""
    seq_lens = [1, 17, 300, 1056, 40, 64, 200, 33, 50, 7]
    # Fresh prompts, mid-sequence chunks, decodes; 6 and 7 tokens leave 2 and 1 rows past the
    # kernel's groups of 4 rows for every GQA ratio here.
    query_lens = [1, 17, 1, 33, 16, 1, 100, 20, 6, 7]
    torch.manual_seed(3)
    cache, tables = _scattered_pairs_cache(seq_lens, heads, kv_heads, head_dim, block_size, random.Random(3))
    start = [n - q for n, q in zip(seq_lens, query_lens)]
    meta = build_attention_metadata(start, query_lens, tables, block_size)
    hist = build_attention_metadata([0] * len(start), seq_lens, tables, block_size)
    hist_k = torch.randn(hist.num_tokens, kv_heads, head_dim).bfloat16()
    hist_v = torch.randn(hist.num_tokens, kv_heads, head_dim).bfloat16()
    cache.write(1, hist.slot_mapping, hist_k, hist_v)
    q = torch.randn(meta.num_tokens, heads, head_dim).bfloat16()
    rows = torch.cat([torch.arange(hist.query_start_loc[i] + start[i], hist.query_start_loc[i + 1])
                      for i in range(len(start))])
    backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5,
                                    sliding_window=window)
    got = backend.forward(1, q, hist_k[rows], hist_v[rows], cache, meta).double()
    ref = reference_float64(cache, 1, meta, q, window, head_dim ** -0.5, heads, kv_heads)
    assert "varlen" in meta.backend_state  # the kernel ran, not the SDPA fallback
    torch.testing.assert_close(got, ref, atol=1.5e-2, rtol=0)


@varlen_available
@pytest.mark.parametrize("seq_lens", [[3000], [700, 1200], [256, 600]])
def test_small_batch_decodes_split_their_keys_and_match_float64(seq_lens):
    """Fewer decode items than two per thread: the kernel cuts each context into parts (at least
    256 keys each), saves every part's softmax state and merges them. With 4 threads a context of
    3,000 keys goes in 3 parts; with 1 thread nothing is split. Both match float64 and each other
    up to the bf16 rounding of the probabilities and the output."""
    heads, kv_heads, head_dim = 9, 3, 64
    # A few peaky keys, so the parts' maxima differ.
    cache, meta, q, hist_k, hist_v, last, ref = _decodes_over_history(seq_lens, len(seq_lens), 97, 8)
    outs = {}
    threads = torch.get_num_threads()
    try:
        for n in (4, 1):
            torch.set_num_threads(n)  # the kernel's OpenMP team follows it
            backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
            meta.backend_state.clear()
            outs[n] = backend.forward(1, q, hist_k[last], hist_v[last], cache, meta).double()
    finally:
        torch.set_num_threads(threads)
    for out in outs.values():
        torch.testing.assert_close(out, ref, atol=1.5e-2, rtol=0)
    # Same products; only the probabilities' bf16 rounding (relative to each part's own maximum)
    # and the float32 sums' order differ. Dropping 16 keys per part boundary measured a mean
    # difference of 1.5e-4 here; the correct merge 3-6e-5.
    diff = (outs[4] - outs[1]).abs()
    assert float(diff.max()) <= 2 ** -6 and float(diff.mean()) <= 1e-4
    assert float(diff.max()) > 0  # the split ran: identical roundings would mean it did not


# -- cascade: decodes sharing leading blocks attend to them together --

@pytest.mark.slow
@varlen_available
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 2, 128, 32), (8, 8, 64, 16)])
def test_cascade_matches_float64_and_the_plain_pass(heads, kv_heads, head_dim, block_size):
    """Two groups of decodes over shared prefixes (one of 40 members: more than a phase-1 tile of
    16), a pair sharing only the start of one of them, an unrelated decode and prefill chunks reading the shared
    prefix too. The shared blocks are physically the same blocks, as prefix caching makes them."""
    rng = random.Random(5)
    torch.manual_seed(5)
    next_id = iter(rng.sample(range(4000), 4000))
    shared_a = [next(next_id) for _ in range(1040 // block_size)]  # 1,040 tokens' worth
    shared_b = [next(next_id) for _ in range(160 // block_size)]
    tables, seq_lens, query_lens = [], [], []

    def add(prefix, own_tokens, q):
        total = len(prefix) * block_size + own_tokens
        tables.append(prefix + [next(next_id) for _ in range(-(-own_tokens // block_size))])
        seq_lens.append(total)
        query_lens.append(q)

    for i in range(40):
        add(shared_a, 1 + (7 * i) % 60, 1)  # decodes, own tails of 1..60 tokens
    for i in range(6):
        add(shared_b, 1 + i, 1)
    for i in range(2):
        add(shared_a[:8], 3, 1)  # shares 8 blocks with group a: joins it at a shorter prefix
    add([], 300, 1)  # no sharing
    add(shared_a, 40, 40)  # prefill chunk over the shared prefix (not a cascade member)
    add([], 50, 50)  # fresh prompt
    num_blocks = 4000
    cache = PagedKVCache(cfg(heads, kv_heads, head_dim), num_blocks=num_blocks, block_size=block_size,
                         dtype=torch.bfloat16, layout="pairs")
    cache.kv.copy_(torch.randn_like(cache.kv, dtype=torch.float32).bfloat16())
    start = [n - q for n, q in zip(seq_lens, query_lens)]
    meta = build_attention_metadata(start, query_lens, tables, block_size)
    q = torch.randn(meta.num_tokens, heads, head_dim).bfloat16()
    # K/V of this step's tokens: what is already in their slots (so every pass reads the same).
    k_all, v_all = all_kv(cache, 1)
    k_new, v_new = k_all[meta.slot_mapping], v_all[meta.slot_mapping]
    outs = {}
    for cascade in (True, False):
        meta.backend_state.clear()
        backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5, cascade=cascade)
        outs[cascade] = backend.forward(1, q, k_new, v_new, cache, meta).double()
        groups = meta.backend_state["varlen"].groups
        if cascade:
            # The pair sharing only group a's first 8 blocks stays out: 39 * 65 blocks saved by
            # the long group beat 41 * 8 by one group over the short common part.
            assert sorted(groups.prefix_len.tolist()) == [len(shared_b) * block_size, len(shared_a) * block_size]
            assert len(groups.members) == 40 + 6
        else:
            assert groups.num_groups == 0
    ref = reference_float64(cache, 1, meta, q, None, head_dim ** -0.5, heads, kv_heads)
    torch.testing.assert_close(outs[True], ref, atol=1.5e-2, rtol=0)
    # The split pass re-associates the softmax sums only: far closer to the plain pass than to
    # the tolerance (the outputs are bf16: one ulp at |o| ~ 1 is 2^-7).
    torch.testing.assert_close(outs[True], outs[False], atol=8e-3, rtol=0)


@pytest.mark.slow
@varlen_available
def test_engine_forms_cascade_groups_and_keeps_greedy_output(monkeypatch, smollm2_hf):
    """The embedded model in bf16 with prefix caching: decodes behind a shared 256-token prefix
    are grouped in real steps, and greedy output is the same with cascade on and off under
    tests/fidelity.py's rule (the paths re-associate the softmax sums and, without AMX, round the
    probabilities to bf16 against different running maxima)."""
    from kvserve import LLM, SamplingParams
    from kvserve.attention import cpu as cpu_backend

    seen: list[int] = []
    real = cpu_backend.shared_prefix_groups

    def spy(*args, **kwargs):
        groups = real(*args, **kwargs)
        seen.append(groups.num_groups)
        return groups

    monkeypatch.setattr(cpu_backend, "shared_prefix_groups", spy)
    llm = LLM(None, dtype="bfloat16", max_model_len=512, kv_cache_memory=64 * 2**20)
    prefix = text_prompts(llm.tokenizer, [256], seed=9)[0]
    prompts = [prefix + q for q in text_prompts(llm.tokenizer, [8] * 8, seed=10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    runs = {}
    for cascade in (True, False):
        llm.engine.runner.model.attn.cascade = cascade
        llm.reset_prefix_cache()
        runs[cascade] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(seen) >= 1  # some step attended a shared prefix as a group
    # --disable-cascade-attn reaches the backend: the same path as cascade off, no groups formed.
    seen.clear()
    off = LLM(None, dtype="bfloat16", max_model_len=512, kv_cache_memory=64 * 2**20, disable_cascade_attn=True)
    assert off.engine.runner.model.attn.cascade is False
    flagged = [o.outputs[0] for o in off.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in flagged] == [o.token_ids for o in runs[False]] and max(seen, default=0) == 0
    assert_paths_agree(runs[True], runs[False], prompts, smollm2_hf)


def test_block_sizes_the_varlen_kernel_cannot_read_keep_the_token_layout(caplog):
    """The varlen kernel reads blocks of 16k keys; --block-size 8 keeps the token-major cache,
    where the decode kernel and SDPA give the same answers, and says why at start-up."""
    with caplog.at_level("WARNING"):
        assert _layout(9, 3, 64, torch.bfloat16, 8) == "tokens"
    if varlen_kernel_for(torch.bfloat16, 64, torch.device("cpu")) is not None:
        assert "--block-size 8" in caplog.text and "--block-size 16" in caplog.text
    assert _layout(9, 3, 64, torch.float32, 16) == "tokens"
    seq_lens = [1, 9, 40, 200]
    got, ref = run_step(torch.bfloat16, 9, 3, 64, 8, seq_lens, [1, 1, 1, 5], None, 4)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=0)


@varlen_available
def test_segmented_decode_matches_the_chunked_one(monkeypatch):
    """Without AMX, decodes take attend_decode (all K/V heads of a sequence per item, the softmax
    per 256-key segment); KVSERVE_DECODE_SEGMENTS=0 keeps attend_item (per K/V head, per 32-key
    chunk). Same products, same float64 distance; only where the running maximum is folded in
    differs, so the two agree to a few bf16 ulps. Contexts end mid-group and mid-segment, over
    NaN-filled spare slots that neither may read."""
    heads, kv_heads, head_dim = 9, 3, 64
    seq_lens = [1, 15, 16, 17, 255, 256, 257, 600, 1000, 33] * 2  # 20 decodes: no split
    # Peaky keys: the running maximum moves within and across segments.
    cache, meta, q, hist_k, hist_v, last, ref = _decodes_over_history(seq_lens, 11, 53, 6)
    outs, errs = {}, {}
    monkeypatch.setenv("KVSERVE_AMX_ATTENTION", "0")  # on AMX CPUs too: both paths are the dot products'
    for segments in ("1", "0"):
        monkeypatch.setenv("KVSERVE_DECODE_SEGMENTS", segments)
        meta.backend_state.clear()
        backend = CPUAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5)
        outs[segments] = backend.forward(1, q, hist_k[last], hist_v[last], cache, meta).double()
        assert torch.isfinite(outs[segments]).all()
        errs[segments] = (outs[segments] - ref).abs().mean()
        torch.testing.assert_close(outs[segments], ref, atol=1.5e-2, rtol=0)
    assert errs["1"] <= 1.1 * errs["0"]  # no less accurate than the chunked pass
    diff = (outs["1"] - outs["0"]).abs()
    assert float(diff.max()) <= 2 ** -6 and float(diff.mean()) <= 1e-4
