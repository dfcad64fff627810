"""Linear layers with weights prepacked on CPU (bf16 / fp16).

bf16 without a bias, on CPUs with AVX512-BF16, goes through model/csrc/gemm_bf16.cpp: a
register-tiled VDPBF16PS loop over the weight packed once into that instruction's operand layout.
It took 20-35 % less time than oneDNN's packed linear for SmolLM2's projections from 1 to 128
rows (decode batches) and the same at 2,048 (bench/NOTES.md, session 10).

Elsewhere, oneDNN with the weight packed once: `F.linear` on a plain bf16 weight makes oneDNN
reorder the weight into its blocked layout on every call; for decode (a handful of rows) that
reorder costs as much as the product itself. Packing once at load time
(`mkldnn._reorder_linear_weight`, as inductor's CPU weight freezing does) halved the time of
SmolLM2's per-layer projections at 1 row and stays ahead at 64 and 512 rows, with bit-identical
results (bench/NOTES.md, "Engine optimisation").

float32 keeps `F.linear` (MKL sgemm): it is the reference dtype, token-exact against transformers.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def _mkldnn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """y = x W^T (+ b) for a fixed weight `[out, in]`; packs the weight when that pays."""

    __slots__ = ("weight", "bias", "packed", "out_features", "gemm")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = None
        self.gemm = None  # (kernel, packed weight) of gemm_bf16.cpp
        n, k = weight.shape
        if (pack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and bias is None
                and n % 64 == 0 and k % 2 == 0):
            from kvserve.model.attention.cpu_kernel import gemm_bf16_kernels
            kernels = gemm_bf16_kernels()
            if kernels is not None:
                packed = torch.empty(n * k, dtype=torch.bfloat16)
                w = weight.contiguous()  # held in a name: a temporary's memory is freed before the call
                kernels.pack(w.data_ptr(), n, k, packed.data_ptr())
                self.gemm, self.weight = (kernels.gemm, packed), None
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            kernel, packed = self.gemm
            k = packed.numel() // self.out_features
            if x.dtype != torch.bfloat16 or x.shape[-1] != k:
                raise TypeError(f"this bf16 linear layer takes bf16 inputs of {k} features, got "
                                f"{x.dtype} {list(x.shape)}")
            rows = x.reshape(-1, k).contiguous()
            y = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16)
            if rows.shape[0]:
                kernel(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), self.out_features, y.data_ptr())
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1])).view(*lead, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
