"""The varlen bf16 kernel's AMX path (ops/csrc/attend_amx.h) against its AVX512-BF16 path and
a float64 reference, on CPUs with AMX: decodes, a prefill chunk after a cached context (15-row
sub-items with causal masks), a partly filled last block and a peaky softmax."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.attention.base import build_attention_metadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.cache.paged import PagedKVCache
from kvserve.config import ModelConfig

H, KVH, D, BS = 9, 3, 64, 16

pytestmark = pytest.mark.needs("amx")


@pytest.mark.parametrize("cached,new,qscale", [(100, 40, 1.0), (37, 100, 4.0), (300, 1, 4.0), (5, 1, 1.0)])
def test_amx_attention_is_as_accurate_as_the_dot_product_path(cached, new, qscale, monkeypatch):
    g = torch.Generator().manual_seed(cached + new)
    batch, ctx = 4, cached + new
    per_seq = -(-ctx // BS)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=H * D, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=KVH, head_dim=D,
                      max_position_embeddings=1 << 16)
    cache = PagedKVCache(cfg, num_blocks=len(blocks), block_size=BS, dtype=torch.bfloat16, layout="pairs")
    k = torch.randn(batch, ctx, KVH, D, generator=g)
    k[:, 0] *= 6  # a sink-like key: one score far above the rest
    k, v = k.bfloat16(), torch.randn(batch, ctx, KVH, D, generator=g).bfloat16()
    q = (torch.randn(batch, ctx, H, D, generator=g) * qscale).bfloat16()
    backend = CPUAttentionBackend(H, KVH, D, scale=D ** -0.5, cascade=False)
    meta = build_attention_metadata([0] * batch, [cached] * batch, tables, BS)
    backend.forward(0, q[:, :cached].reshape(-1, H, D), k[:, :cached].reshape(-1, KVH, D),
                    v[:, :cached].reshape(-1, KVH, D), cache, meta)
    kk, vv = k.double().repeat_interleave(H // KVH, 2), v.double().repeat_interleave(H // KVH, 2)
    s = torch.einsum("bqhd,bthd->bhqt", q.double(), kk) * D ** -0.5
    s = s.masked_fill(torch.ones(ctx, ctx, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqt,bthd->bqhd", s.softmax(-1), vv)[:, cached:]
    outs = {}
    for amx in ("1", "0"):
        monkeypatch.setenv("KVSERVE_AMX_ATTENTION", amx)  # read by the kernel on every call
        meta = build_attention_metadata([cached] * batch, [new] * batch, tables, BS)
        outs[amx] = backend.forward(0, q[:, cached:].reshape(-1, H, D), k[:, cached:].reshape(-1, KVH, D),
                                    v[:, cached:].reshape(-1, KVH, D), cache, meta).double().view(batch, new, H, D)
    err = {a: (o - ref).abs() for a, o in outs.items()}
    # both within the output's bf16 rounding plus the bf16 probabilities' error
    assert float(err["1"].max()) < 0.02 and float(err["0"].max()) < 0.02
    assert float(err["1"].mean()) <= 1.05 * float(err["0"].mean()) + 1e-6
    # the same products and roundings: the two paths differ by at most a bf16 step here and there
    assert float((outs["1"] - outs["0"]).abs().max()) <= 2 ** -6
