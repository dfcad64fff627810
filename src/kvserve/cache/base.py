"""The interface every KV cache offers to attention backends, and what all caches share.

The KV cache *manager* (kvserve.kv.manager) decides which block ids a request owns; a cache
only holds the tensors those ids index. Block `b` holds token slots
`b*block_size .. b*block_size + block_size - 1`. One class per storage format: paged.py (the
model dtype), quantized.py (what the quantized formats share), fp8.py, kivi.py (int8 / int4);
factory.py picks one by `kv_cache_dtype` and sizes the pool.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from kvserve.config import ModelConfig
from kvserve.core.step import BlockCopy

KV_LAYOUTS = ("tokens", "pairs")  # element orders within a block (paged.py); quantized caches: "tokens"


class KVCache(ABC):
    """Interface every KV cache (full precision or quantized) offers to attention backends."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # compute dtype that `gather` returns
    device: torch.device

    @abstractmethod
    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[T, num_kv_heads, head_dim]` at flat slots `slot_mapping` `[T]` of `layer`."""

    @abstractmethod
    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of exactly `block_ids` (in that order), contiguous
        `[len(block_ids) * block_size, num_kv_heads, head_dim]` in the compute dtype."""

    @abstractmethod
    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """For each copy: the first `num_tokens` slots of `src` -> `dst`, in every layer."""

    def finish_step(self) -> None:
        """Called by the model runner after each forward: work a cache does once per step for
        all layers (a quantized cache seals the blocks the step filled) rather than per write."""

    @staticmethod
    @abstractmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> int:
        """True bytes one block takes across all layers, K and V, including any scales."""

    def read_blocks(self, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """The stored form of whole blocks (offload tiers): tensors `[len(block_ids), ...]`, one per
        storage field, exactly what `write_blocks` takes back."""
        raise NotImplementedError(f"{type(self).__name__} cannot offload blocks (read_blocks)")

    def write_blocks(self, block_ids: torch.Tensor, data: Sequence[torch.Tensor]) -> None:
        """Inverse of `read_blocks`: overwrite whole blocks with previously read contents."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore blocks (write_blocks)")

    def check_block_ids(self, block_ids: torch.Tensor) -> None:
        if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks}): "
                             f"min {int(block_ids.min())}, max {int(block_ids.max())}")


def copy_slot_indices(copies: Sequence[BlockCopy], block_size: int, num_blocks: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat source and destination slot indices for a list of block copies (vectorised)."""
    src, dst, n = (torch.tensor(col, dtype=torch.long) for col in zip(*copies))
    if int(n.min()) < 0 or int(n.max()) > block_size:
        raise ValueError(f"BlockCopy.num_tokens must be in [0, {block_size}], got {n.tolist()}")
    for name, ids in (("src", src), ("dst", dst)):
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise IndexError(f"BlockCopy.{name} out of range [0, {num_blocks}): {ids.tolist()}")
    offsets = torch.arange(block_size)
    keep = offsets[None, :] < n[:, None]  # [C, block_size]
    src_slots = (src[:, None] * block_size + offsets)[keep]
    dst_slots = (dst[:, None] * block_size + offsets)[keep]
    return src_slots, dst_slots
