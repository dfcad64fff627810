"""The full-precision paged KV cache: the preallocated K/V pool in the model dtype.

Layout: one tensor `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`.
Keeping tokens of a block contiguous with heads innermost means a write is one `index_copy_`
over flattened slots, a gather is one `index_select` over blocks that yields `[tokens, H, D]` in
the order SDPA's `[B, H, L, D]` view wants after a transpose, and `copy_blocks` moves the
same slots of every layer, K and V, in a single indexed assignment.

Layout "pairs" (`PagedKVCache(layout="pairs")`, chosen by the attention backend: the bf16 CPU
kernel) keeps that allocation but orders each block's elements for AVX512-BF16 dot products, which
multiply-add *pairs* of bf16 along the reduction axis: K as `[H, D/2, block_size, 2]` (16 keys'
(d, d+1) pairs fill one register: the q.k operand) and V as `[H, block_size/2, D, 2]` (keys t, t+1
interleaved per d: the p.V operand). The kernel then reads both in place, where the token-major
layout cost it a 16x16 transpose per 16 keys of K and an unpack per key pair of V. Writes and
gathers go through strided views of the same memory; block copies, offload and swap move whole
blocks and do not care.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvserve.cache.base import KV_LAYOUTS, KVCache, copy_slot_indices
from kvserve.config import ConfigError, ModelConfig
from kvserve.core.step import BlockCopy
from kvserve.ops.host_alloc import zeros_huge_pages


class PagedKVCache(KVCache):
    """Full-precision paged KV cache (`kv_cache_dtype="auto"`: stored in the model dtype)."""

    def __init__(self, model_config: ModelConfig, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto", layout: str = "tokens") -> None:
        if layout not in KV_LAYOUTS:
            raise ConfigError(f"KV cache layout must be one of {', '.join(KV_LAYOUTS)}, got {layout!r}")
        if layout == "pairs" and (block_size % 16 or model_config.head_dim % 2):
            raise ConfigError(f"the 'pairs' KV layout needs a block size that is a multiple of 16 and "
                              f"an even head_dim (got --block-size {block_size}, head_dim "
                              f"{model_config.head_dim})")
        if kv_cache_dtype != "auto":
            raise ConfigError(f"PagedKVCache stores the model dtype (kv_cache_dtype='auto'), got "
                              f"{kv_cache_dtype!r}; build quantized caches with create_kv_cache")
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least 1 block, got num_blocks={num_blocks}; "
                              f"raise --kv-cache-memory or --num-gpu-blocks-override")
        self.num_layers = model_config.num_hidden_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = layout
        # zeros, not empty: padded gathers read unused blocks and must not meet NaN bit patterns
        # (0 * NaN in the masked softmax·V product would poison the output).
        self.kv = zeros_huge_pages(self.num_layers, 2, num_blocks, block_size, self.num_kv_heads,
                                   self.head_dim, dtype=dtype, device=self.device)
        # [layers, 2, slots, H, D] view for slot-addressed writes and copies.
        self._slots = self.kv.view(self.num_layers, 2, num_blocks * block_size, self.num_kv_heads,
                                   self.head_dim)
        # Per-layer views made once: every layer of every step indexes them (saves 8 selects/layer).
        self._layer_slots = [(self._slots[i, 0], self._slots[i, 1]) for i in range(self.num_layers)]
        self._layer_blocks = [(self.kv[i, 0], self.kv[i, 1]) for i in range(self.num_layers)]
        if layout == "pairs":
            # Token-addressed views of the pairs layout: K [L, blocks, bs, H, D/2, 2] indexed by
            # (block, offset), V [L, blocks, bs/2, 2, H, D] by (block, offset // 2, offset % 2).
            L, H, D, bs = self.num_layers, self.num_kv_heads, self.head_dim, block_size
            self._k_tok = self.kv[:, 0].view(L, num_blocks, H, D // 2, bs, 2).permute(0, 1, 4, 2, 3, 5)
            self._v_tok = self.kv[:, 1].view(L, num_blocks, H, bs // 2, D, 2).permute(0, 1, 3, 5, 2, 4)
            # The compiled store (4x faster than the strided index_put below at decode sizes).
            self._store_pairs = None
            if self.device.type == "cpu" and self.kv.element_size() == 2:
                from kvserve.ops.cpu_kernels import store_pairs_kernel
                self._store_pairs = store_pairs_kernel()

    def _store_pairs_takes(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
        """Whether k, v `[T, H, D]` and slots are in the form `store_kv_pairs` reads directly."""
        return (k.dtype == v.dtype == self.dtype and slots.dtype == torch.int64 and slots.is_contiguous()
                and k.stride()[1:] == v.stride()[1:] == (self.head_dim, 1)
                and k.stride(0) % 2 == 0 and k.data_ptr() % 4 == 0 and k.shape[0] == v.shape[0] == slots.numel())

    @property
    def layout_tag(self) -> str:
        """What decides a stored block's bytes beyond the dtype (goes into the tier fingerprint)."""
        return "" if self.layout == "tokens" else self.layout

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.layout == "pairs":
            if self._store_pairs is not None and self._store_pairs_takes(k, v, slot_mapping):
                k_blocks, v_blocks = self._layer_blocks[layer]
                self._store_pairs(k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(), slot_mapping.numel(),
                                  k.stride(0), v.stride(0), k_blocks.data_ptr(), v_blocks.data_ptr(),
                                  self.num_kv_heads, self.head_dim, self.block_size)
                return
            blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
            self._k_tok[layer][blk, off] = k.to(self.dtype).view(*k.shape[:2], -1, 2)
            self._v_tok[layer][blk, off // 2, off % 2] = v.to(self.dtype)
            return
        k_slots, v_slots = self._layer_slots[layer]
        k_slots.index_copy_(0, slot_mapping, k.to(self.dtype))
        v_slots.index_copy_(0, slot_mapping, v.to(self.dtype))

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage of one layer, `[num_blocks, ...]` each, contiguous, in `self.layout`
        (kernels that read blocks in place): "tokens" `[block_size, H, D]` per block for both;
        "pairs" `[H, D/2, block_size, 2]` for K and `[H, block_size/2, D, 2]` for V."""
        return self._layer_blocks[layer]

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (block_ids.numel() * self.block_size, self.num_kv_heads, self.head_dim)
        if self.layout == "pairs":
            return (self._k_tok[layer][block_ids].reshape(shape),
                    self._v_tok[layer][block_ids].reshape(shape))
        k = self.kv[layer, 0].index_select(0, block_ids).view(shape)
        v = self.kv[layer, 1].index_select(0, block_ids).view(shape)
        return k, v

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        if not copies:
            return
        src_slots, dst_slots = copy_slot_indices(copies, self.block_size, self.num_blocks)
        src_slots, dst_slots = src_slots.to(self.device), dst_slots.to(self.device)
        # The right-hand side is gathered before any write, so chains (a->b, b->c) read old data.
        if self.layout == "pairs":
            bs = self.block_size
            (sb, so), (db, do) = ((s // bs, s % bs) for s in (src_slots, dst_slots))
            self._k_tok[:, db, do] = self._k_tok[:, sb, so]
            self._v_tok[:, db, do // 2, do % 2] = self._v_tok[:, sb, so // 2, so % 2]
            return
        self._slots[:, :, dst_slots] = self._slots[:, :, src_slots]

    def read_blocks(self, block_ids: torch.Tensor) -> list[torch.Tensor]:
        # [n, layers, 2, block_size, H, D]: one block's bytes contiguous, for packing per block.
        return [self.kv.index_select(2, block_ids.to(self.device)).movedim(2, 0).contiguous()]

    def write_blocks(self, block_ids: torch.Tensor, data: Sequence[torch.Tensor]) -> None:
        (blocks,) = data
        self.kv[:, :, block_ids.to(self.device)] = blocks.to(self.device, self.dtype).movedim(0, 2)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> int:
        if kv_cache_dtype != "auto":
            raise ConfigError(f"PagedKVCache stores the model dtype only (kv_cache_dtype='auto'), "
                              f"got {kv_cache_dtype!r}")
        element = torch.empty((), dtype=model_dtype).element_size()
        return int(block_size * model_config.kv_bytes_per_token(element))
