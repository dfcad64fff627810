"""Linear layers with weights prepacked on CPU (bf16 / fp16).

bf16 without a bias goes through a compiled kernel over the weight packed once into the
operand layout of VDPBF16PS (AMX's B-tile layout; without AMX, interleaved by K step):
  - on CPUs with AMX (Sapphire Rapids), ops/csrc/gemm_amx.cpp: TDPBF16PS tile products. Against
    oneDNN's packed linear (AMX too), SmolLM2's 30 layers with weights from DRAM: 9.1 vs 12.0 ms
    at 1 row (the memory's rate; oneDNN streams well under it), 14.5 vs 18.2 at 64, equal at 512,
    8 % slower at 2,048, where the fused epilogues win part of it back (bench/NOTES.md, "With AMX:
    gemm_amx.cpp, TDPBF16PS tiles over the same packed weight");
  - on CPUs with AVX512-BF16 but no AMX, ops/csrc/gemm_bf16.cpp: a register-tiled VDPBF16PS
    loop. It took 20-35 % less time than oneDNN from 1 to 128 rows and the same at 2,048
    (an AMD EPYC; bench/NOTES.md, "Without AMX: gemm_bf16.cpp, a register-tiled VDPBF16PS loop"). On Sapphire Rapids VDPBF16PS issues at half the float32 FMA rate,
    so this one runs only where AMX is missing.

Either kernel can also finish the projection with the elementwise pass that follows it (an
`Epilogue`): SiLU(gate) * up after the gate/up projection, the rotary embedding of q and k after
the q/k/v projection. The layer's `epilogue` says whether it does; where it is None the caller
runs the pass itself (model/fused.py).

Elsewhere, oneDNN with the weight packed once: `F.linear` on a plain bf16 weight makes oneDNN
reorder the weight into its blocked layout on every call; for decode (a handful of rows) that
reorder costs as much as the product itself. Packing once at load time
(`mkldnn._reorder_linear_weight`, as inductor's CPU weight freezing does) halved the time of
SmolLM2's per-layer projections at 1 row and stays ahead at 64 and 512 rows, with bit-identical
results (bench/NOTES.md, "Engine optimisation").

A weight loaded from GGUF blocks (Q4_1, Q8_0) is kept as those codes instead, on CPUs with AMX
(`codes=`, model/weight_codes.py): 3.2x / 1.9x fewer bytes than the bf16 weight, expanded tile by
tile to the same bf16 values in the product, so outputs are bit-identical. At decode sizes the
smaller weight stream is faster (1.1-1.25x); at prefill sizes the two measured alike, so the bf16
copy is not kept at all (bench/NOTES.md, "GGUF weight codes as the only weight
on AMX, expanded to bf16 tiles eight k-steps ahead"): SmolLM2's process is ~270 MB smaller.

float32 keeps `F.linear` (MKL sgemm): it is the reference dtype, token-exact against transformers.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvserve.model.weight_codes import GGUFBlocks, pack_tiles

log = logging.getLogger(__name__)

_PACKED_DTYPES = (torch.bfloat16, torch.float16)

# gemm_bf16.cpp's EpilogueKind: nothing; SiLU(gate) * up of the two output halves; rotary
# embedding of q and k.
_PLAIN_KIND, _SILU_MUL_KIND, _ROPE_KIND = 0, 1, 2


class Epilogue(NamedTuple):
    """What gemm_bf16.cpp does to a projection's output before storing it."""
    kind: int  # one of the kinds above
    head_dim: int = 0  # rope: heads of head_dim columns
    rope_cols: int = 0  # rope: the leading columns (q then k heads) that are rotated


PLAIN = Epilogue(_PLAIN_KIND)
SILU_MUL = Epilogue(_SILU_MUL_KIND)


def silu_mul_tiles(ops, gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a gate/up output `[T, 2I]` in the SiLU epilogue's column order (tiles
    of 32 gate then the same 32 up columns): each 64 columns are one (gate | up) row of 32."""
    t, two_i = gate_up.shape
    return ops.silu_mul(gate_up.reshape(t * two_i // 64, 64)).view(t, two_i // 2)


def rope_epilogue(head_dim: int, rope_cols: int) -> Epilogue:
    return Epilogue(_ROPE_KIND, head_dim, rope_cols)


def _epilogue_order(epi: Epilogue, n: int) -> torch.Tensor | None:
    """The permutation of the weight's output rows that puts what one 64-column tile combines
    together (gemm_bf16.cpp), or None where the epilogue cannot apply to n outputs."""
    if epi.kind == _SILU_MUL_KIND:  # tile p: gate outputs 32p + [0, 32), then the same up outputs
        i = n // 2
        if n % 64:
            return None
        p = torch.arange(i // 32)[:, None] * 32 + torch.arange(32)
        return torch.stack((p, p + i), 1).reshape(-1)
    if epi.kind != _ROPE_KIND:  # nothing to fuse
        return None
    d, cols = epi.head_dim, epi.rope_cols
    if d % 64 or cols % d or cols > n or n % 64:
        return None
    # tile (head h, i0): d = i0 + [0, 32) then i0 + d/2 + [0, 32); columns past rope_cols in place
    i0 = torch.arange(0, d // 2, 32)[:, None] + torch.arange(32)  # [d/64, 32]
    heads = torch.arange(cols // d)[:, None, None] * d
    rope = torch.stack((heads + i0, heads + i0 + d // 2), 2).reshape(-1)
    return torch.cat((rope, torch.arange(cols, n)))


def _mkldnn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """y = x W^T (+ b) for a fixed weight `[out, in]`; packs the weight when that pays."""

    __slots__ = ("weight", "bias", "packed", "out_features", "in_features", "gemm", "codes", "epilogue",
                 "order")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True,
                 epilogue: Epilogue | None = None, codes: GGUFBlocks | None = None) -> None:
        """`epilogue`: fuse that pass into the product where gemm_bf16.cpp runs this layer (then
        `self.epilogue` is set and calls return the pass's result), else leave it to the caller.
        `codes`: the same weight as GGUF blocks, kept instead of a bf16 copy where the AMX kernel reads them."""
        self.bias = bias
        n, k = self.out_features, self.in_features = weight.shape
        self.packed = None
        self.gemm = None  # (kernel, operand): gemm_bf16.cpp's packed weight, or gemm_amx.cpp's GGUF codes
        self.codes = None  # the GGUF type ("Q4_1", "Q8_0") where the operand is codes
        self.epilogue = None
        self.order = None  # the packed weight's row order where an epilogue needs one (plain())
        if (pack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and bias is None
                and n % 64 == 0):
            from kvserve.ops.cpu_kernels import gemm_bf16_kernels
            kernels = gemm_bf16_kernels()
            if kernels is not None and k % kernels.k_multiple == 0:
                order = _epilogue_order(epilogue, n) if epilogue is not None else None
                self.epilogue = epilogue if order is not None else None
                self.order = order
                self.weight = None
                if codes is not None and kernels.k_multiple == 32 and self._take_codes(codes, order, n, k):
                    return
                packed = torch.empty(n * k, dtype=torch.bfloat16)
                # held in a name: a temporary's memory is freed before the call
                w = (weight if order is None else weight[order]).contiguous()
                kernels.pack(w.data_ptr(), n, k, packed.data_ptr())
                self.gemm = (kernels.gemm, packed)
                return
        if pack and weight.device.type == "cpu" and weight.dtype in _PACKED_DTYPES and _mkldnn_linear_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
                probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
                torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                self.packed = packed
            except RuntimeError as e:  # an older oneDNN or an odd shape: the plain path works
                log.info("oneDNN weight packing unavailable (%s); using F.linear", e)
        # The plain weight is dropped once packed: the packed copy is the only one read.
        self.weight = weight if self.packed is None else None

    def _take_codes(self, codes: GGUFBlocks, order: torch.Tensor | None, n: int, k: int) -> bool:
        """Makes the codes this layer's operand; False where this CPU has no kernel for them."""
        from kvserve.ops.cpu_kernels import gemm_codes_kernel
        kernel = gemm_codes_kernel(codes.qtype)
        if kernel is None:
            return False
        if (codes.rows, codes.cols) != (n, k):
            raise ValueError(f"GGUF codes of {codes.rows} x {codes.cols} for a {n} x {k} weight")
        if order is not None:
            codes = GGUFBlocks(codes.qtype, codes.blocks[order], codes.cols)
        self.gemm, self.codes = (kernel, pack_tiles(codes)), codes.qtype
        return True

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) `[T, out]` without the epilogue, its columns in `self.order` where there is
        one (the packed weight's row order; undoing it would cost a gather of the output): what a
        LoRA delta, permuted the same way, adds to before the SiLU pass (model/lora.py)."""
        if self.epilogue is None:
            return self(x)
        kernel, operand = self.gemm
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16)
        if rows.shape[0]:
            kernel(rows.data_ptr(), rows.shape[0], self.in_features, operand.data_ptr(), self.out_features,
                   y.data_ptr(), _PLAIN_KIND, 0, 0, 0, 0)
        return y

    def __call__(self, x: torch.Tensor, cos: torch.Tensor | None = None,
                 sin_signed: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b); with a SiLU epilogue, SiLU(gate) * up `[..., out / 2]`; with a rotary one,
        q and k rotated by cos and sin_signed (rows of head_dim, one per row of x: fused.apply_rope's)."""
        if self.gemm is not None:
            kernel, operand = self.gemm
            k = self.in_features
            if x.dtype != torch.bfloat16 or x.shape[-1] != k:
                raise TypeError(f"this bf16 linear layer takes bf16 inputs of {k} features, got "
                                f"{x.dtype} {list(x.shape)}")
            rows = x.reshape(-1, k).contiguous()
            epi = self.epilogue or PLAIN
            out = self.out_features // 2 if epi.kind == _SILU_MUL_KIND else self.out_features
            cos_p = sin_p = 0
            if epi.kind == _ROPE_KIND:
                if (cos is None or sin_signed is None or not cos.is_contiguous() or not sin_signed.is_contiguous()
                        or cos.numel() != rows.shape[0] * epi.head_dim or sin_signed.shape != cos.shape
                        or cos.dtype != torch.bfloat16 or sin_signed.dtype != torch.bfloat16):
                    raise ValueError(f"a rotary projection needs contiguous bf16 cos and sin_signed of "
                                     f"{rows.shape[0]} x {epi.head_dim}")
                cos_p, sin_p = cos.data_ptr(), sin_signed.data_ptr()
            y = torch.empty(rows.shape[0], out, dtype=torch.bfloat16)
            if rows.shape[0]:
                kernel(rows.data_ptr(), rows.shape[0], k, operand.data_ptr(), self.out_features, y.data_ptr(),
                       epi.kind, cos_p, sin_p, epi.head_dim, epi.rope_cols)
            return y.view(*x.shape[:-1], out)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1])).view(*lead, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
