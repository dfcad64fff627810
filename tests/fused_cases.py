"""fused_triton's kernels against fused.py's torch ops, shared by the interpreter test (fp16 on
CPU: triton's interpreter rounds bfloat16 differently from a GPU) and test_cuda.py (bf16, fp16).

Rotary: the same roundings in the same order, so equal. RMSNorm sums its row in another order
and SiLU's exp is the GPU's own: a few elements of those intermediates differ by a unit in the
last place, which the product with the weight (or with up) makes at most two of the result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model import fused_triton
from kvserve.model.fused import apply_rope, rms_norm


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 1, max_differing: float = 0.01) -> None:
    # eps * |value| bounds the spacing at that value; the larger of the two values covers a
    # result that rounded across a power of two.
    ulp = torch.finfo(want.dtype).eps * torch.maximum(got.float().abs(), want.float().abs()).clamp_min(
        torch.finfo(want.dtype).tiny)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= ulp * (ulps + 0.01)).all()), f"max diff {diff.max().item()} beyond {ulps} ulp"
    assert (got != want).float().mean().item() <= max_differing


def check_fused_kernels(dtype: torch.dtype, device: str, rows: int = 7) -> None:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    h, delta, w = rand(rows, 576), rand(rows, 576), 1 + rand(576, scale=0.1)
    got_h, want_h = h.clone(), h.clone()
    got = fused_triton.add_rms_norm(got_h, delta, w, 1e-5)
    want = rms_norm(want_h.add_(delta), w, 1e-5)
    assert torch.equal(got_h, want_h)  # the residual sum, rounded once
    assert_within_ulps(got, want, ulps=2)
    assert_within_ulps(fused_triton.add_rms_norm(h.clone(), None, w, 1e-6), rms_norm(h, w, 1e-6), ulps=2)

    # q and k heads of a fused qkv row (v after them stays untouched), positions up to 7,000.
    qkv = rand(rows, 15 * 64)
    pos = torch.randint(0, 7000, (rows,), generator=gen).float()
    freqs = pos[:, None] / 100000 ** (torch.arange(0, 64, 2).float() / 64)
    c, s = freqs.cos().to(dtype), freqs.sin().to(dtype)
    cos, sin = torch.cat((c, c), -1)[:, None, :].to(device), torch.cat((-s, s), -1)[:, None, :].to(device)
    want = apply_rope(qkv[:, :12 * 64].view(rows, 12, 64), cos, sin)
    got_qkv = qkv.clone()
    fused_triton.rope(got_qkv[:, :12 * 64].view(rows, 12, 64), cos, sin)
    got = got_qkv[:, :12 * 64].view(rows, 12, 64)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ, " \
        f"max {(got.float() - want.float()).abs().max().item()}"
    assert torch.equal(got_qkv[:, 12 * 64:], qkv[:, 12 * 64:])

    gate_up = rand(rows, 2 * 1536, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_ulps(fused_triton.silu_mul(gate_up), F.silu(gate).mul_(up), ulps=2)
