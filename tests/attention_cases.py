"""Attention cases shared by the Triton tests: a step of ragged sequences over shuffled blocks,
checked against a float64 softmax, and greedy decoding through a model with either backend.

Imported by test_triton_attention.py (kernels under triton's interpreter, CPU) and test_cuda.py
(the same kernels compiled for a GPU). It does not import triton: whether the kernels are
interpreted is decided by TRITON_INTERPRET, which the importing test sets first (or not).

Tolerance for float32 inputs: the kernels accumulate in float32 over <= ~100 keys, so the
error is a few float32 ulps times log(keys): 1e-5 relative/absolute on O(1) outputs leaves
~10x margin while a wrong mask, scale or block (errors ~1e-1) cannot pass. float16 / bfloat16
inputs are rounded before the reference sees them; what remains is the kernel rounding the
softmax weights to the input type before P @ V plus the output rounding: ~2 ulps of the type.
"""
from __future__ import annotations

import random

import torch

from kvserve.attention.base import build_attention_metadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.attention.triton import TritonAttentionBackend
from kvserve.cache.paged import PagedKVCache
from kvserve.config import ModelConfig

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cache_for(num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
              dtype: torch.dtype, device: str = "cpu") -> PagedKVCache:
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_hidden_layers=2, num_attention_heads=num_kv_heads,
                      num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=512)
    return PagedKVCache(cfg, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)


def reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_pos: torch.Tensor,
              scale: float, window: int | None) -> torch.Tensor:
    """float64 softmax attention; q [n, Hq, D], keys/vals [L, Hkv, D], q_pos [n]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = vals.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    dist = q_pos[:, None] - torch.arange(keys.shape[0])[None, :]
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def run_step(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             start_pos: list[int], query_lens: list[int], window: int | None = None,
             dtype: torch.dtype = torch.float32, layer: int = 1, seed: int = 0,
             block_m: int = 16, block_n: int = 16, device: str = "cpu", max_decode_splits: int = 32):
    """One attention step through the triton backend on `device` (CPU: the interpreter); returns
    (out, reference, torch backend out), all on the CPU. The torch backend runs on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s + n for s, n in zip(start_pos, query_lens)]
    needs = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needs) + 3  # spare blocks stay zero and must never be read
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in needs:
        tables.append(ids[at:at + n])
        at += n
    cache = cache_for(num_kv_heads, head_dim, block_size, num_blocks, dtype)
    meta = build_attention_metadata(start_pos, query_lens, tables, block_size, device)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # The whole K/V history of every sequence; the context part goes in through the torch
    # cache's own write, the step's part through the triton write kernel inside forward.
    keys = [rand(n, num_kv_heads, head_dim) for n in seq_lens]
    vals = [rand(n, num_kv_heads, head_dim) for n in seq_lens]
    for i, s in enumerate(start_pos):
        if s:
            slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size
                                  for p in range(s)])
            cache.write(layer, slots, keys[i][:s], vals[i][:s])
    k = torch.cat([keys[i][s:] for i, s in enumerate(start_pos)])
    v = torch.cat([vals[i][s:] for i, s in enumerate(start_pos)])
    q = rand(meta.num_tokens, num_heads, head_dim)
    scale = head_dim ** -0.5

    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, window,
                                     device=device, block_m=block_m, block_n=block_n,
                                     max_decode_splits=max_decode_splits)
    torch_cache = cache_for(num_kv_heads, head_dim, block_size, num_blocks, dtype)
    torch_cache.kv.copy_(cache.kv)
    dev_cache = cache_for(num_kv_heads, head_dim, block_size, num_blocks, dtype, device)
    dev_cache.kv.copy_(cache.kv)
    out = backend.forward(layer, q.to(device), k.to(device), v.to(device), dev_cache, meta).cpu()
    cache.kv.copy_(dev_cache.kv)

    ref = torch.empty(q.shape, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(start_pos, query_lens)):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        ref[rows] = reference(q[rows], keys[i], vals[i], torch.arange(s, s + n), scale, window)
    # The write kernel must leave the pool exactly as the torch cache's write does.
    torch_cache.write(layer, meta.slot_mapping.cpu(), k, v)
    assert torch.equal(cache.kv, torch_cache.kv)
    torch_out = CPUAttentionBackend(num_heads, num_kv_heads, head_dim, scale, window).forward(
        layer, q, k, v, torch_cache, build_attention_metadata(start_pos, query_lens, tables, block_size))
    return out, ref, torch_out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


HEADS = {"gqa": (4, 2), "gqa3": (6, 2), "mha": (4, 4), "mqa": (3, 1)}



def greedy_generate(model, config: ModelConfig, prompts: list[list[int]], steps: int,
                    block_size: int = 16, device: str = "cpu") -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of `prompts` batched together. The first prompt is prefilled in two
    chunks (the second chunk shares a step with the other prompt's first decode), blocks are
    handed out in a scattered order. Returns the generated ids and every step's logits (on the CPU)."""
    lens = [len(p) for p in prompts]
    per_seq = -(-(max(lens) + steps) // block_size)
    ids = list(range(len(prompts) * per_seq))
    random.Random(1).shuffle(ids)
    tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(len(prompts))]
    cache = PagedKVCache(config, num_blocks=len(ids), block_size=block_size, dtype=model.dtype, device=device)
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    split = lens[0] // 2
    first = [(0, split, False)] + [(i, lens[i], True) for i in range(1, len(prompts))]
    plan = [first, [(0, lens[0] - split, True)] + [(i, 1, True) for i in range(1, len(prompts))]]
    plan += [[(i, 1, True) for i in range(len(prompts))]] * steps
    all_logits = []
    for step in plan:
        seqs = [s for s, _, _ in step]
        meta = build_attention_metadata([done[s] for s in seqs], [n for _, n, _ in step],
                                        [tables[s] for s in seqs], block_size, device)
        input_ids = torch.tensor([t for s, n, _ in step for t in tokens[s][done[s]:done[s] + n]], device=device)
        hidden = model.forward(input_ids, meta.positions, meta, cache)
        rows = [meta.query_start_loc[j + 1] - 1 for j, (_, _, sample) in enumerate(step) if sample]
        logits = model.compute_logits(hidden[torch.tensor(rows, device=device)]).cpu()
        all_logits.append(logits)
        sampled = [s for s, _, sample in step if sample]
        for s, n, _ in step:
            done[s] += n
        for s, row in zip(sampled, logits.argmax(-1).tolist()):
            tokens[s].append(row)
    return [t[len(p):] for t, p in zip(tokens, prompts)], all_logits
