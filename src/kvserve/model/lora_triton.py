"""The LoRA delta of a mixed-adapter step on CUDA, in Triton (the BGMV idea of punica and vLLM):
each row reads its own adapter's A and B by its slot index, so rows of every adapter (and base
rows, slot -1, which are skipped) go through two launches per projection instead of one GEMM pair
per segment.

Imported only once triton is known to be usable (model/lora.py asks attention/triton.py); with
TRITON_INTERPRET=1 set before the first import the kernels run on CPU through triton's
interpreter (tests/test_lora_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_kernel(x_ptr, w_ptr, out_ptr, slot_ptr, K, N, stride_xm, stride_ws, stride_wk, stride_om,
                 ACCUMULATE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m, n] (+)= sum_k x[m, k] * w[slot[m], k, n], for rows whose slot is >= 0."""
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ptr + m)
    if slot >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + slot * stride_ws + offs_k[:, None] * stride_wk + offs_n[None, :],
                        mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None] * w, axis=0)
        out = out_ptr + m * stride_om + offs_n
        if ACCUMULATE:
            acc += tl.load(out, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _bgmv(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    m, k = x.shape
    n = w.shape[-1]
    block_n = min(128, triton.next_power_of_2(n))
    _bgmv_kernel[(m, triton.cdiv(n, block_n))](x, w, out, slots, k, n, x.stride(0), w.stride(0), w.stride(1),
                                              out.stride(0), ACCUMULATE=accumulate, BLOCK_K=32, BLOCK_N=block_n)


def lora_delta(x: torch.Tensor, row_slots: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """x `[M, in]`, row_slots int32 `[M]` (-1: no adapter), a_t `[S, in, R]`, b_t `[S, R, out]`:
    each row's x A^T B^T in a_t's dtype (zeros for base rows), `[M, out]`; the rank-wide middle
    is kept in float32."""
    x, a_t, b_t = x.contiguous(), a_t.contiguous(), b_t.contiguous()
    shrunk = torch.zeros(x.shape[0], a_t.shape[-1], dtype=torch.float32, device=x.device)
    _bgmv(x, a_t, row_slots, shrunk, accumulate=False)
    out = torch.zeros(x.shape[0], b_t.shape[-1], dtype=a_t.dtype, device=x.device)
    _bgmv(shrunk, b_t, row_slots, out, accumulate=False)
    return out
