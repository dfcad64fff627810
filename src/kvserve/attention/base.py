"""Per-step attention metadata and the interface attention backends implement.

The runner builds one `AttentionMetadata` per step (vectorised, no per-token Python) and every
layer's attention reads it. Tokens of all sequences are flattened: sequence `i` owns token rows
`query_start_loc[i] : query_start_loc[i+1]` at positions `start_pos[i] .. seq_lens[i]-1`.

A sequence whose chunk is a single token is a *decode* (whatever its phase: a 1-token prefill
chunk attends exactly like a decode step), so all of them go through the batched decode path.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from kvserve.cache.base import KVCache


@dataclass
class AttentionMetadata:
    block_size: int
    positions: torch.Tensor  # [T] long: position of every flattened token
    slot_mapping: torch.Tensor  # [T] long: block_table[pos // bs] * bs + pos % bs
    query_start_loc: list[int]  # [S+1] token row where each sequence's chunk starts
    query_lens: list[int]  # [S] tokens of each sequence in this step
    start_pos: list[int]  # [S] tokens already in the cache before this step (context offset)
    seq_lens: list[int]  # [S] context length after this step (start_pos + query_len)
    seq_lens_tensor: torch.Tensor  # [S] long, on device
    block_tables: torch.Tensor  # [S, max_blocks] long, padded with 0 (never read past seq_lens)
    decode_seq_ids: torch.Tensor  # [Nd] long: sequences with a 1-token chunk
    decode_token_ids: torch.Tensor  # [Nd] long: their token rows
    prefill_seq_ids: list[int]  # sequences with longer chunks (attended one by one)
    # Backends cache derived per-step tensors here (masks, gather indices): built once per
    # step, reused by every layer.
    backend_state: dict[str, Any] = field(default_factory=dict, repr=False)
    # Score-based KV compression (h2o, snapkv): sequences whose attention per block is summed
    # (score_blocks), for each the (last, stride) of its query rows scored (the chunk's last
    # `last` rows, every stride-th, each counted stride times), and the sums so far (float32
    # [blocks of the sequence's table], over layers, heads and those queries).
    score_seqs: list[int] = field(default_factory=list)
    score_rows: list[tuple[int, int]] = field(default_factory=list)
    block_scores: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_ids.numel())


def build_attention_metadata(start_pos: Sequence[int], query_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Positions, slot mapping and padded block tables for one step, computed with numpy."""
    num_seqs = len(query_lens)
    if not (len(start_pos) == num_seqs == len(block_tables)):
        raise ValueError("start_pos, query_lens and block_tables must have one entry per sequence")
    starts = np.asarray(start_pos, dtype=np.int64).reshape(num_seqs)
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    if num_seqs and int(qlens.min()) < 1:
        raise ValueError(f"every scheduled sequence needs >= 1 new token, got query_lens={qlens.tolist()}")
    seq_lens = starts + qlens
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    num_tokens = int(qsl[-1])

    table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
    short = np.nonzero(table_lens * block_size < seq_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequence {i}: block table of {table_lens[i]} blocks x {block_size} slots "
                         f"cannot hold {seq_lens[i]} tokens")
    max_blocks = int(table_lens.max()) if num_seqs else 0
    tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
    for i, t in enumerate(block_tables):  # per sequence, not per token
        tables[i, :len(t)] = t

    seq_of_token = np.repeat(np.arange(num_seqs), qlens)
    positions = np.arange(num_tokens, dtype=np.int64) - qsl[:-1][seq_of_token] + starts[seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    is_decode = qlens == 1
    decode_seqs = np.nonzero(is_decode)[0]
    dev = torch.device(device)
    return AttentionMetadata(
        block_size=block_size,
        positions=torch.from_numpy(positions).to(dev),
        slot_mapping=torch.from_numpy(slots).to(dev),
        query_start_loc=qsl.tolist(),
        query_lens=qlens.tolist(),
        start_pos=starts.tolist(),
        seq_lens=seq_lens.tolist(),
        seq_lens_tensor=torch.from_numpy(seq_lens).to(dev),
        block_tables=torch.from_numpy(tables).to(dev),
        decode_seq_ids=torch.from_numpy(decode_seqs).to(dev),
        decode_token_ids=torch.from_numpy(qsl[:-1][decode_seqs]).to(dev),
        prefill_seq_ids=np.nonzero(~is_decode)[0].tolist(),
    )


class AttentionBackend(ABC):
    """Paged attention for one model: writes the step's K/V into the cache, then attends."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def kv_cache_layout(self, kv_cache_dtype: str, dtype: torch.dtype, block_size: int,
                        device: torch.device) -> str:
        """The element order this backend wants the KV cache in (kv_cache.KV_LAYOUTS); the runner
        builds the cache with it."""
        return "tokens"

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q `[T, num_heads, D]`, k/v `[T, num_kv_heads, D]` (RoPE applied) -> `[T, num_heads, D]`."""

    def score_blocks(self, layer: int, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> None:
        """Add the attention each block of meta.score_seqs' tables got at this layer (after
        `forward` wrote the step's K/V) to meta.block_scores. Recomputes the softmax for those
        sequences' scored rows alone, over keys gathered in the compute dtype: any backend, any
        cache format, and no cost to the sequences (or steps) that do not ask. The compiled
        layer loop does the same in csrc/score_blocks_bf16.cpp."""
        bs = meta.block_size
        for i, (last, stride) in zip(meta.score_seqs, meta.score_rows):
            start, seq_len = meta.start_pos[i], meta.seq_lens[i]
            n = seq_len - start
            rows = torch.arange(n - 1, n - 1 - last, -stride)  # chunk rows, latest first
            nb = -(-seq_len // bs)
            ks, _ = kv_cache.gather(layer, meta.block_tables[i, :nb])
            ks = ks[:seq_len].float()  # [L, Hkv, D]
            qs = q[meta.query_start_loc[i] + rows.to(q.device)].float()  # [r, Hq, D]
            group = self.num_heads // self.num_kv_heads
            qs = qs.view(qs.shape[0], self.num_kv_heads, group, self.head_dim)
            logits = torch.einsum("nhgd,lhd->hgnl", qs, ks) * self.scale
            q_pos = (start + rows).to(ks.device)
            visible = torch.arange(seq_len, device=ks.device)[None, :] <= q_pos[:, None]  # [r, L]
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            per_key = probs.sum(dim=(0, 1, 2)) * stride  # [L]
            per_block = torch.nn.functional.pad(per_key, (0, nb * bs - seq_len)).view(nb, bs).sum(1)
            acc = meta.block_scores.get(i)
            meta.block_scores[i] = per_block if acc is None else acc + per_block
