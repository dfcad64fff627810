"""Linear layers with weights prepacked for oneDNN on CPU (bf16 / fp16).

`F.linear` on a plain bf16 weight makes oneDNN reorder the weight into its blocked layout on every
call; for decode (a handful of rows) that reorder costs as much as the product itself. Packing once
at load time (`mkldnn._reorder_linear_weight`, as inductor's CPU weight freezing does) halved the
time of SmolLM2's per-layer projections at 1 row and stays ahead at 64 and 512 rows, with
bit-identical results (bench/NOTES.md, "Engine optimisation").

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

    __slots__ = ("weight", "bias", "packed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = None
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
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1])).view(*lead, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
