"""GGUF-quantized weights kept as their codes, for the AMX GEMM to expand in L1 (csrc/weight_tiles.h).

A GGUF checkpoint's projections are Q4_1 or Q8_0 blocks of 32 weights along K. The loader
dequantizes them to bf16; on CPUs with AMX, a projection keeps the codes instead (5 or 8.5 bits a
weight against 16) and the GEMM expands each 32 x 16 tile to the same bf16 values just before its
products. Decode reads every weight once per step, so fewer bytes are a shorter step; prefill runs
as fast as over bf16; outputs are bit-identical (tests/test_weight_codes.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

BLOCK = 32  # weights per GGUF block (Q4_1, Q8_0), along K
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # d (+ m) float16, then the codes


class GGUFBlocks(NamedTuple):
    """A weight `[rows, cols]` as GGUF blocks: `blocks` is uint8 `[rows, cols / 32 * block bytes]`,
    so row permutations and concatenations apply to it as to the dense weight."""
    qtype: str  # "Q4_1" or "Q8_0"
    blocks: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, cols]`, as gguf's own dequantizer computes it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        arr = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.asarray(arr, dtype=np.float32).reshape(self.rows, self.cols))


def supported(qtype: str) -> bool:
    return qtype in _BLOCK_BYTES


def cat(parts: list[GGUFBlocks]) -> GGUFBlocks | None:
    """The blocks of torch.cat(weights), or None unless every part has codes of one type."""
    if not parts or any(p is None for p in parts) or len({(p.qtype, p.cols) for p in parts}) != 1:
        return None
    return GGUFBlocks(parts[0].qtype, torch.cat([p.blocks for p in parts]), parts[0].cols)


def _f16_fields(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[..., start:start + 2].contiguous().view(torch.float16)[..., 0]


def pack_tiles(w: GGUFBlocks) -> torch.Tensor:
    """The codes in weight_tiles.h's tile order: uint8 `[rows / 16, cols / 32, tile bytes]`."""
    n, k = w.rows, w.cols
    if n % 16 or k % BLOCK:
        raise ValueError(f"tiles need rows % 16 == 0 and cols % 32 == 0, got {n} x {k}")
    s, p = k // BLOCK, n // 16
    b = w.blocks.view(n, s, _BLOCK_BYTES[w.qtype])
    d = _f16_fields(b, 0).view(p, 16, s).permute(0, 2, 1)  # [panel, step, column]
    scales = [d]
    if w.qtype == "Q4_1":
        scales.append(_f16_fields(b, 2).view(p, 16, s).permute(0, 2, 1))
        qs = b[..., 4:]
        q = torch.cat((qs & 15, qs >> 4), -1)  # [n, s, 32]: element k of the block
    else:
        q = b[..., 2:]
    # lane 2c + (k & 1) of row k // 2, for column c of the panel
    q = q.reshape(p, 16, s, 16, 2).permute(0, 2, 3, 1, 4).reshape(p, s, 16, 32)
    if w.qtype == "Q4_1":
        q = q[..., :16] | (q[..., 16:] << 4)
    parts = [q.reshape(p, s, -1)] + [x.contiguous().view(torch.uint8).reshape(p, s, 32) for x in scales]
    return torch.cat(parts, -1).contiguous()
