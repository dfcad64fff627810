"""The compiled CPU decode kernel against the SDPA path over the same paged cache.

Both run through TorchAttentionBackend.forward on one step's metadata, so block tables, slot
mapping, GQA grouping, sliding windows and the scattered placement of blocks are exercised as the
engine uses them. Skipped only where no C++ compiler is installed.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model.attention.base import build_attention_metadata
from kvserve.model.attention.cpu_kernel import decode_kernel_for
from kvserve.model.attention.torch_backend import TorchAttentionBackend
from kvserve.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(decode_kernel_for(torch.float32, 64, torch.device("cpu")) is None,
                                reason="no C++ compiler: the kernel falls back to SDPA")


def cfg(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * head_dim,
                       intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096)


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
                         dtype=dtype)
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
        backend = TorchAttentionBackend(heads, kv_heads, head_dim, scale=head_dim ** -0.5,
                                        sliding_window=window, use_cpu_kernel=use_kernel)
        meta.backend_state.clear()
        outs.append(backend.forward(1, q, k, v, cache, meta).float())
    return outs


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
