"""Quantized KV caches on CPU: each layer's blocks for the step are dequantized into a small bf16
scratch in the "pairs" layout, and the varlen kernel reads that (cpu.py).

The varlen kernel reads bf16 pairs in place; a quantized cache (fp8, int8, int4) holds codes,
scales and a full-precision residual for open blocks instead. Attending over those through SDPA,
on padded gathered copies dequantized per sequence, made `random` 7-12x slower than over a
bf16 cache (bench/NOTES.md, "Quantized blocks staged into a bf16 pairs
scratch for prompt steps and cascade groups"), which turned the memory saved into a speed lost.

Here every block the step reads is dequantized once per layer - a block many sequences share (a
cached prefix) once for all of them - and the step's block tables are renumbered into the
scratch. The step's own new tokens are then written over their scratch slots at full precision:
attention sees this step's keys as computed (as the SDPA path does for a fresh prompt), and
quantization applies to what the cache keeps for later steps. Sequences are taken in parts
whose distinct blocks fit `STAGE_BYTES`: the scratch stays in the last-level cache between being
written and being read, and a long context never needs a second full-size copy of its KV.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from kvserve.cache.quantized import DequantField, MetaRef
from kvserve.ops.cpu_kernels import MetaRefC, QFieldC, stage_quantized_kernel, store_pairs_kernel

# Scratch per part: written by the dequantisation, read by the kernel right after, so it should
# stay in the last-level cache (32 MB here) beside the codes being read. A batch-64 int8 decode
# step, 8 alternating rounds: 8 MiB 112-131 ms, 16 MiB 123-139 ms (4 and 32 MiB no better).
STAGE_BYTES = 8 << 20


class StagePart(NamedTuple):
    seqs: slice  # the step's sequences this part covers
    block_ids: torch.Tensor  # [U] int64: the distinct cache blocks they read
    tables: np.ndarray  # [n, max_blocks] int64: their block tables renumbered into the scratch


def _renumbered(seqs: slice, block_tables: np.ndarray, read: np.ndarray) -> StagePart:
    ids, index = np.unique(block_tables[seqs][read[seqs]], return_inverse=True)
    tables = np.zeros((seqs.stop - seqs.start, block_tables.shape[1]), dtype=np.int64)
    tables[read[seqs]] = index
    return StagePart(seqs, torch.from_numpy(ids.astype(np.int64)), tables)


def plan_stage_parts(block_tables: np.ndarray, first_block: np.ndarray, num_blocks: np.ndarray,
                     max_stage_blocks: int) -> list[StagePart]:
    """Split the step's sequences (in order) into parts of at most `max_stage_blocks` distinct
    blocks - at least one sequence per part, however long - and renumber each part's tables.
    Sequence i reads table columns [first_block[i], num_blocks[i]); other entries become 0."""
    n = block_tables.shape[0]
    cols = np.arange(block_tables.shape[1])[None, :]
    read = (cols >= first_block[:, None]) & (cols < num_blocks[:, None])
    whole = _renumbered(slice(0, n), block_tables, read)
    if whole.block_ids.numel() <= max_stage_blocks:  # the common case: everything fits one part
        return [whole]
    bounds, start, seen = [], 0, set()
    for i in range(n):
        row = set(block_tables[i, read[i]].tolist())
        if i > start and len(seen | row) > max_stage_blocks:
            bounds.append(slice(start, i))
            start, seen = i, set()
        seen |= row
    bounds.append(slice(start, n))
    return [_renumbered(seqs, block_tables, read) for seqs in bounds]


_CODE_KINDS = {"uint8": 0, "int4": 1, "e4m3": 2, "e5m2": 3}
_META_KINDS = {torch.float32: 0, torch.float16: 1, torch.float8_e4m3fn: 2, torch.int8: 3}


def _meta_c(m: MetaRef | None) -> MetaRefC:
    if m is None:
        return MetaRefC()
    if m.tensor.dtype not in _META_KINDS:
        raise TypeError(f"no staging kernel reads {m.tensor.dtype} quantization metadata")
    return MetaRefC(m.tensor.data_ptr(), *m.tensor.stride(), m.group_tokens, m.group_channels,
                    _META_KINDS[m.tensor.dtype])


def _field_c(f: DequantField) -> QFieldC:
    return QFieldC(f.codes.data_ptr(), f.codes.stride(0), _CODE_KINDS[f.code_format], f.code_offset,
                   _meta_c(f.scale), _meta_c(f.zero), _meta_c(f.exponent))


def step_token_slots(tables: np.ndarray, start_pos: np.ndarray, query_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Scratch slots of a part's own tokens for this step, in token-row order (their positions
    run from start_pos[i] for query_lens[i] tokens; `tables` renumbered into the scratch)."""
    seq = np.repeat(np.arange(len(query_lens)), query_lens)
    first_row = np.cumsum(query_lens) - query_lens
    pos = np.repeat(start_pos, query_lens) + np.arange(len(seq)) - np.repeat(first_row, query_lens)
    return tables[seq, pos // block_size] * block_size + pos % block_size


class CacheDescription:
    """A quantized cache's layers as the compiled kernels take them (csrc/quant_fields.h): K and V
    `QFieldC`, and the bf16 residual pool's rows and entry-per-block pointers (None without one).
    Built once per layer: the cache's tensors persist and only their contents change, but for the
    residual pool, which a rare step grows (`residual_generation`)."""

    def __init__(self) -> None:
        self._cache = None
        self._generation = 0
        self._layers: dict[int, tuple] = {}

    def layer(self, kv_cache, layer: int) -> tuple[QFieldC, QFieldC, int | None, int | None]:
        generation = getattr(kv_cache, "residual_generation", 0)  # the residual pool was reallocated
        if kv_cache is not self._cache or generation != self._generation:
            self._cache, self._generation, self._layers = kv_cache, generation, {}
        if layer not in self._layers:
            kf, vf = kv_cache.dequant_fields(layer)
            res = kv_cache.residual(layer)
            if res is not None and res[0].dtype != torch.bfloat16:
                raise TypeError("the quantized-cache kernels read bf16 residual rows only")
            self._layers[layer] = (_field_c(kf), _field_c(vf), *((None, None) if res is None else
                                                                 (res[0].data_ptr(), res[1].data_ptr())),
                                   (kf, vf, res))  # keeps the described views alive
        return self._layers[layer][:4]


class StageScratch:
    """The bf16 pairs-layout scratch a part is dequantized into (grown on demand, reused), and
    the way there: the compiled `stage_quantized_pairs`, or, where it is not built, the cache's
    own `gather` followed by `store_kv_pairs`."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots = torch.zeros(0, dtype=torch.int64)
        self._stage = stage_quantized_kernel()
        self._store_pairs = store_pairs_kernel()
        self.described = CacheDescription()

    def fill(self, kv_cache, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize `block_ids` of `layer` into scratch blocks 0..U-1; returns (K, V) storage
        in the pairs layout, `[U, H, D/2, bs, 2]` and `[U, H, bs/2, D, 2]`."""
        H, D, bs, u = kv_cache.num_kv_heads, kv_cache.head_dim, kv_cache.block_size, block_ids.numel()
        shape = (H, D // 2, bs, 2)
        if self.k is None or self.k.shape[1:] != shape:
            self.k = self.v = None
        if self.k is None or self.k.shape[0] < u:
            cap = u if self.k is None else max(u, 2 * self.k.shape[0])
            self.k = torch.empty(cap, *shape, dtype=torch.bfloat16)
            self.v = torch.empty(cap, H, bs // 2, D, 2, dtype=torch.bfloat16)
        if self._stage is not None:
            kf, vf, res, block_res = self.described.layer(kv_cache, layer)
            self._stage(ctypes.byref(kf), ctypes.byref(vf), res, block_res, block_ids.data_ptr(), u,
                        self.k.data_ptr(), self.v.data_ptr(), H, D, bs)
            return self.k, self.v
        if self.slots.numel() < u * bs:
            self.slots = torch.arange(self.k.shape[0] * bs, dtype=torch.int64)
        k, v = kv_cache.gather(layer, block_ids)  # [u * bs, H, D], dequantized, open blocks too
        k, v = k.to(torch.bfloat16).contiguous(), v.to(torch.bfloat16).contiguous()
        self._store_pairs(k.data_ptr(), v.data_ptr(), self.slots.data_ptr(), u * bs, k.stride(0), v.stride(0),
                          self.k.data_ptr(), self.v.data_ptr(), H, D, bs)
        return self.k, self.v

    def overlay(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
        """Write this step's own K/V `[T, H, D]` (bf16, full precision) over their scratch slots."""
        H, D = k.shape[1:]
        if k.stride()[1:] != (D, 1) or v.stride()[1:] != (D, 1) or k.stride(0) % 2 or v.stride(0) % 2:
            k, v = k.contiguous(), v.contiguous()
        self._store_pairs(k.data_ptr(), v.data_ptr(), slots.data_ptr(), slots.numel(), k.stride(0), v.stride(0),
                          self.k.data_ptr(), self.v.data_ptr(), H, D, block_size)
