"""What the KV cache and attention tests share: small configurations, K/V history writers,
a float64 attention reference, and the workloads that push blocks down the offload tiers."""
from __future__ import annotations

import random

import torch
from fidelity import assert_greedy_agrees, bf16_bound, run_of

from kvserve.attention.base import build_attention_metadata
from kvserve.cache.fp8 import Fp8PagedKVCache
from kvserve.cache.kivi import IntPagedKVCache
from kvserve.cache.quantizers import KVScales
from kvserve.config import ModelConfig

TINY = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16, 1024)


def attention_cfg(heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * head_dim,
                       intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096)


def make_cache(variant: str, num_blocks: int, block_size: int = 16, kv_heads: int = 3, head_dim: int = 64,
               num_residual_blocks: int | None = None, seal_at_step_end: bool = False):
    c = attention_cfg(kv_heads * 3, kv_heads, head_dim)
    kw = dict(num_blocks=num_blocks, block_size=block_size, dtype=torch.bfloat16,
              num_residual_blocks=num_residual_blocks, seal_at_step_end=seal_at_step_end)
    if variant.startswith("fp8"):
        kind = "fp8_e5m2" if "e5m2" in variant else "fp8_e4m3"
        if "static" in variant:
            scales = KVScales(torch.tensor([0.05, 0.04]), torch.full((2, kv_heads), 0.03))
            kw.pop("num_residual_blocks")
            kw.pop("seal_at_step_end")
            return Fp8PagedKVCache(c, kv_cache_dtype=kind, kv_scales=scales, **kw)
        gran = "tensor" if "tensor" in variant else "head"
        return Fp8PagedKVCache(c, kv_cache_dtype=kind, scale_granularity=gran,
                               center_keys="uncentered" not in variant, **kw)
    kind = "int4" if variant.startswith("int4") else "int8"
    extra = {}
    if "direct" in variant:
        extra["residual"] = False
    if "g8" in variant:
        extra["group_size"] = 8
    if "full-meta" in variant:
        extra["compact"] = False
    if "compact" in variant:
        extra["compact"] = True
    return IntPagedKVCache(c, kv_cache_dtype=kind, **extra, **kw)


def fill_history(cache, layer: int, seq_lens: list[int], seed: int):
    """Writes `seq_lens` tokens for sequences in shuffled blocks, one sequence per write as
    prefills would (offset keys: real keys sit off zero, which the centering and zero points
    exist for); returns their block tables."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs = cache.block_size
    need = [-(-n // bs) for n in seq_lens]
    ids = list(range(cache.num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    for n, table in zip(seq_lens, tables):
        if n:
            meta = build_attention_metadata([0], [n], [table], bs)
            k = (torch.randn(n, cache.num_kv_heads, cache.head_dim) * 2 + 1.5).bfloat16()
            v = torch.randn(n, cache.num_kv_heads, cache.head_dim).bfloat16()
            cache.write(layer, meta.slot_mapping, k, v)
    return tables


def samples(seed: int, shape=(64, 4, 64), outliers: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if outliers:
        # LLM keys have a few channels 10-100x larger than the rest (KIVI, KVQuant).
        x[..., 3] *= 80.0
        x.view(-1)[torch.randint(0, x.numel(), (20,), generator=g)] *= 50.0
    return x


def write_seq(cache, table, k, v, chunks):
    """Write a sequence's K/V `[n, H, D]` through its block table in chunks (prefill, then decodes)."""
    bs, pos = cache.block_size, 0
    for n in chunks:
        p = torch.arange(pos, pos + n)
        slots = torch.tensor(table)[p // bs] * bs + p % bs
        for layer in range(cache.num_layers):
            cache.write(layer, slots, k[pos:pos + n] * (layer + 1), v[pos:pos + n] * (layer + 1))
        pos += n


def all_kv(cache, layer):
    """K and V of every block of `layer`, token-major `[num_blocks * block_size, H, D]`."""
    return cache.gather(layer, torch.arange(cache.num_blocks))


def reference_float64(cache, layer, meta, q, window, scale, heads, kv_heads, fresh=None):
    """Straightforward attention per query row in float64 over the sequence's blocks; `fresh`
    (k, v) of the step's own tokens replaces what the cache holds for them (a quantized cache
    stores them rounded, attention sees them as computed)."""
    k_all, v_all = (t.double().unflatten(0, (cache.num_blocks, cache.block_size)) for t in all_kv(cache, layer))
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = heads // kv_heads
    for i in range(meta.num_seqs):
        blocks = meta.block_tables[i, :-(-meta.seq_lens[i] // meta.block_size)]
        keys = k_all[blocks].flatten(0, 1)[:meta.seq_lens[i]]
        vals = v_all[blocks].flatten(0, 1)[:meta.seq_lens[i]]
        if fresh is not None:
            rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
            keys[meta.start_pos[i]:], vals[meta.start_pos[i]:] = fresh[0][rows].double(), fresh[1][rows].double()
        for r in range(meta.query_lens[i]):
            row, pos = meta.query_start_loc[i] + r, meta.start_pos[i] + r
            lo = max(0, pos - window + 1) if window else 0
            for h in range(heads):
                s = keys[lo:pos + 1, h // g] @ q[row, h].double() * scale
                out[row, h] = torch.softmax(s, 0) @ vals[lo:pos + 1, h // g]
    return out


def assert_paths_agree(runs, reference, prompts, hf, roundings: int = 1, what: str = "") -> None:
    """Two of kvserve's paths over SmolLM2 (CompletionOutputs generated with logprobs >= 2) under
    tests/fidelity.py's rule, `reference` giving the gaps. D is measured on the reference's
    sequences from transformers' (`hf`, float32) own bf16 forward, once per bf16 rounding the two
    paths' values differ by: 2 where one of them also rounds dequantized K/V to bf16 (staging)."""
    ref = [run_of(o) for o in reference]
    seqs = [list(p) + r.tokens for p, r in zip(prompts, ref)]
    bound = roundings * bf16_bound(hf, seqs, [range(len(p) - 1, len(s) - 1) for p, s in zip(prompts, seqs)])
    assert_greedy_agrees([run_of(o) for o in runs], ref, bound, what=what)


# -- workloads for the offload tiers --

BS = 16
POOL = 40  # blocks: 640 tokens on the device
SMALL = dict(dtype="float32", block_size=BS, num_gpu_blocks_override=POOL, max_model_len=POOL * BS,
             max_num_batched_tokens=256, check_integrity=True)


def documents_workload(seed, num_docs=4, doc_len=330, questions=3, vocab=256):
    """Several long documents, each asked several questions, interleaved so that a document's
    blocks are evicted from the device pool before it is asked again (4 x 21 blocks >> pool)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(doc_len)] for _ in range(num_docs)]
    return [[d + [rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for d in docs]
            for _ in range(questions)]
