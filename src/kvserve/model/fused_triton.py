"""fused.py's elementwise steps as one Triton kernel each, for bf16 / fp16 on CUDA.

In torch a decode step runs each RMSNorm, rotary embedding and SiLU * up as 3-5 small
kernels; at decode sizes a kernel's fixed cost (~2 us on an H100), not its bytes, is the price,
and they took 40 % of the GPU time of SmolLM2's batch-64 decode step on an H100 (0.75 of 1.87
ms; 0.18 ms as these kernels; bench/NOTES.md, "One Triton kernel per elementwise step,
compiled without FP fusion").
Each kernel here rounds to the model dtype where torch's ops do (the residual sum, the
normalised row before the weight, each rotary product, SiLU before the product). Rotary is
then bit-identical to torch's; RMSNorm sums its row in another order and SiLU's exp is the
GPU's own, so a few elements differ by a unit in the last place of that intermediate (two of
the result, once multiplied by the weight or by up).

Import only where triton is importable (`ElementwiseOps` checks); TRITON_INTERPRET=1 runs
the kernels on CPU for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, out_ptr, stride_h, stride_d, stride_o, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    x = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * inv).to(h_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, heads,
                 HALF: tl.constexpr, H_PAD: tl.constexpr):
    """In place, one program per token: x = x * cos + rotate_half(x) * sin for every head.
    Each thread loads and stores the same elements of both halves, so no thread can overwrite
    a value another has yet to read."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF)[None, :]
    mask = h < heads
    lo = x_ptr + t * stride_t + h * stride_h + i
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    rope = t * 2 * HALF + i
    c1 = tl.load(cos_ptr + rope).to(tl.float32)
    c2 = tl.load(cos_ptr + rope + HALF).to(tl.float32)
    s1 = tl.load(sin_ptr + rope).to(tl.float32)  # -sin: the sign of rotate_half
    s2 = tl.load(sin_ptr + rope + HALF).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    out1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s1).to(dt).to(tl.float32)
    out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(lo, out1.to(dt), mask=mask)
    tl.store(lo + HALF, out2.to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch's silu, rounded before the product
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [T, H] += delta in place, then a new RMSNorm(h) * weight (fused.ElementwiseOps)."""
    t, n = h.shape
    out = torch.empty_like(h)
    if t:
        _add_rms_norm_kernel[(t,)](h, h if delta is None else delta, weight, out, h.stride(0),
                                   0 if delta is None else delta.stride(0), out.stride(0), n, eps,
                                   HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (D contiguous, heads D apart) rotated in place; cos / sin_signed [T, 1, D]."""
    t, heads, d = x.shape
    if t:
        # Without fusion: the compiler would make `x2 * s1 + a` one bf16 FMA, rounding once
        # where torch rounds the product and then the sum.
        _rope_kernel[(t,)](x, cos, sin_signed, x.stride(0), x.stride(1), heads,
                           HALF=d // 2, H_PAD=triton.next_power_of_2(heads), enable_fp_fusion=False)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2I] = (gate | up) as a new [T, I]."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                          inter, BLOCK=block)
    return out


def applies(x: torch.Tensor) -> bool:
    """Shapes these kernels take: the last dim contiguous."""
    return x.stride(-1) == 1
