"""The decoder's residual add + RMSNorm, rotary embedding and SiLU(gate) * up, in torch or as one
compiled pass each.

The torch versions are transformers' arithmetic in as few ops as torch allows. For bf16 on CPUs
with AVX512-BF16 each step is also one pass of compiled code (csrc/elementwise_bf16.cpp, built
with the attention kernels): torch runs an RMSNorm as ~8 small ops, and at decode sizes their
dispatch and memory passes, not the arithmetic, are the cost; at prefill sizes, the passes over
memory. On CUDA, bf16 and fp16 take one Triton kernel per step (fused_triton.py) for the same
reason: a GPU kernel's fixed cost. The compiled passes round to bf16 where torch's ops do.
float32 always takes the torch ops: it is the reference dtype, token-exact against transformers.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`: torch's fused rms_norm
    normalises in float32 and rounds once, bit-identical to those five ops (checked for fp32,
    bf16 and fp16 at hidden sizes 64..4096) in one kernel."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos [T, 1, D] (cos repeated over both halves); sin_signed [T, 1, D] = (-sin, sin).
    HF's x*cos + rotate_half(x)*sin with rotate_half(x) = (-x2, x1): the same products and sum
    in the same dtype, so bit-identical, in four ops instead of ten."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    rotated.mul_(sin_signed)
    return (x * cos).add_(rotated)


class ElementwiseOps:
    """The steps for one model's dtype and device: compiled where they apply, torch otherwise."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self._add_rms_norm = self._rope = self._silu_mul = None
        self._triton = None  # fused_triton, on CUDA
        dev = torch.device(device)
        if dtype == torch.bfloat16 and dev.type == "cpu":
            from kvserve.ops.cpu_kernels import elementwise_kernels
            self._add_rms_norm, self._rope, self._silu_mul = elementwise_kernels() or (None, None, None)
        elif dtype in (torch.bfloat16, torch.float16) and dev.type == "cuda" and importlib.util.find_spec("triton"):
            from kvserve.model import fused_triton
            self._triton = fused_triton

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h += delta in place (the residual stream; no add when delta is None), then a new
        tensor RMSNorm(h) * weight. h `[T, H]`."""
        if self._triton is not None and self._triton.applies(h) and (delta is None or self._triton.applies(delta)):
            return self._triton.add_rms_norm(h, delta, weight, eps)
        if (self._add_rms_norm is not None and h.is_contiguous() and weight.is_contiguous()
                and (delta is None or (delta.dtype == h.dtype and delta.stride(-1) == 1))):
            out = torch.empty_like(h)
            self._add_rms_norm(h.data_ptr(), 0 if delta is None else delta.data_ptr(),
                               0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(),
                               h.shape[0], h.shape[1], eps)
            return out
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """`apply_rope(x, cos, sin_signed)`; the compiled pass rotates x in place and returns it."""
        d = x.shape[-1]
        half = d // 2  # fused_triton's rotary tiles a half head: a power of two
        if (self._triton is not None and x.stride(2) == 1 and x.stride(1) == d and half and half & (half - 1) == 0
                and cos.is_contiguous() and sin_signed.is_contiguous()):
            return self._triton.rope(x, cos, sin_signed)
        if (self._rope is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and cos.is_contiguous() and sin_signed.is_contiguous()):
            t, heads, d = x.shape
            self._rope(x.data_ptr(), x.stride(0), t, heads, d, cos.data_ptr(), sin_signed.data_ptr())
            return x
        return apply_rope(x, cos, sin_signed)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up `[T, 2I]` = (gate | up), as a new `[T, I]` tensor; the
        compiled pass reads gate_up once instead of torch's two passes."""
        t, two_i = gate_up.shape
        if self._triton is not None and self._triton.applies(gate_up) and two_i % 2 == 0:
            return self._triton.silu_mul(gate_up)
        if self._silu_mul is not None and gate_up.stride(1) == 1 and two_i % 2 == 0:
            out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
            self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, two_i // 2)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
