"""The bf16 projection kernels behind `Linear` (ops/csrc/gemm_bf16.cpp with AVX512-BF16 dot
products, gemm_amx.cpp with AMX tiles), against float32 products. Every test runs on each kernel
this CPU has.

They accumulate in float32 like oneDNN, in another order, so results equal oneDNN's but for the
last bit of a few elements: each output must be the float32 product rounded to bf16, within one
bf16 step (2^-8 relative) plus the float32 accumulation's own error."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.fused import ElementwiseOps, apply_rope
from kvserve.model.linear import SILU_MUL, Linear, rope_epilogue
from kvserve.ops import cpu_kernels as cpu_kernel

_KERNELS = {"avx512bf16": cpu_kernel.gemm_bf16_kernels(amx=False), "amx": cpu_kernel.gemm_bf16_kernels(amx=True)}
_NEEDS = {"avx512bf16": "avx512_bf16", "amx": "amx"}


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.needs(_NEEDS[name])) for name in _KERNELS])
def gemm(request, monkeypatch):
    """Makes `Linear` take one kernel; returns it."""
    kernel = _KERNELS[request.param]
    monkeypatch.setattr(cpu_kernel, "gemm_bf16_kernels", lambda amx=None: kernel)
    return kernel


@pytest.mark.slow
@pytest.mark.parametrize("n,k", [(64, 2), (960, 576), (576, 1536), (3072, 576), (128, 30), (128, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 10, 13, 16, 17, 31, 32, 33, 64, 130, 300, 1100])
def test_gemm_matches_the_float32_product_within_a_bf16_step(gemm, n, k, rows):
    g = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    lin = Linear(w)
    if k % gemm.k_multiple:  # AMX tiles take 32 k at a time: oneDNN runs this one
        assert lin.gemm is None
        return
    assert lin.gemm is not None and lin.weight is None
    ref = x.double() @ w.double().t()
    got = lin(x).double()
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().t()) * 2.0 ** -20
    assert bool(((got - ref).abs() <= bound).all()), float((got - ref).abs().max())
    one = F.linear(x, w).double()  # oneDNN, within the same bound of the exact product
    assert bool(((got - one).abs() <= 2 * bound).all())


def test_gemm_takes_views_batched_inputs_and_empty_batches(gemm):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(192, 64, generator=g) * 0.1).bfloat16()
    lin = Linear(w)
    big = torch.randn(4, 3, 65, generator=g).bfloat16()
    x = big[..., 1:]  # not contiguous, odd element offset: copied into rows first
    got = lin(x)
    assert got.shape == (4, 3, 192)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=2e-2, rtol=2 ** -7)
    assert lin(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 192)
    wt = (torch.randn(64, 128, generator=g) * 0.1).bfloat16().t()  # a non-contiguous weight is packed from a copy
    x2 = torch.randn(300, 64, generator=g).bfloat16()  # several 48-row chunks per panel
    torch.testing.assert_close(Linear(wt)(x2).float(), F.linear(x2, wt).float(), atol=2e-2, rtol=2 ** -7)
    with pytest.raises(TypeError, match="bf16 inputs of 64 features"):
        lin(torch.randn(2, 64))


def test_shapes_the_kernel_does_not_take_go_to_onednn_or_torch():
    w = torch.randn(100, 64).bfloat16()  # 100 columns: not a multiple of 64
    cases = [(Linear(w), torch.bfloat16),
             (Linear(torch.randn(128, 64).bfloat16(), torch.randn(128).bfloat16()), torch.bfloat16),  # a bias
             (Linear(torch.randn(128, 64)), torch.float32)]
    for lin, dtype in cases:
        assert lin.gemm is None
        assert lin(torch.randn(3, 64).to(dtype)).shape == (3, lin.out_features)


def test_cpus_without_either_kernel_keep_onednn(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "gemm_bf16_kernels", lambda amx=None: None)
    lin = Linear(torch.randn(128, 64).bfloat16(), epilogue=SILU_MUL)
    assert lin.gemm is None and lin.epilogue is None  # the caller runs the SiLU pass


@pytest.mark.parametrize("rows", [1, 7, 64, 300, 1100])
@pytest.mark.parametrize("inter", [32, 1536])
def test_silu_epilogue_equals_the_separate_pass(gemm, rows, inter):
    """SiLU(gate) * up fused into the gate/up product: bit-equal to the product followed by the
    compiled elementwise pass (the same roundings, in the same order)."""
    g = torch.Generator().manual_seed(rows + inter)
    w = (torch.randn(2 * inter, 96, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    fused = Linear(w, epilogue=SILU_MUL)
    assert fused.epilogue == SILU_MUL
    got = fused(x)
    assert got.shape == (rows, inter)
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    assert torch.equal(got, ops.silu_mul(Linear(w)(x)))


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 2)])
@pytest.mark.parametrize("rows", [1, 13, 200])
def test_rope_epilogue_equals_the_separate_pass(gemm, head_dim, heads, kv_heads, rows):
    """q and k rotated inside the q/k/v product (head_dim 128: a head spans two tiles, the weight
    rows permuted so each tile holds the pairs it rotates); v untouched; bit-equal to the product
    followed by the compiled rotary pass."""
    g = torch.Generator().manual_seed(head_dim + rows)
    n = (heads + 2 * kv_heads) * head_dim
    rope_cols = (heads + kv_heads) * head_dim
    w = (torch.randn(n, 128, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, 128, generator=g).bfloat16()
    ang = torch.randn(rows, head_dim // 2, generator=g) * 3
    cos = torch.cat((ang.cos(), ang.cos()), -1).bfloat16()[:, None, :]
    sin = torch.cat((-ang.sin(), ang.sin()), -1).bfloat16()[:, None, :]
    fused = Linear(w, epilogue=rope_epilogue(head_dim, rope_cols))
    assert fused.epilogue is not None
    got = fused(x, cos, sin)
    ref = Linear(w)(x)
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    ops.rope(ref[:, :rope_cols].view(rows, heads + kv_heads, head_dim), cos, sin)
    assert torch.equal(got, ref)
    assert torch.equal(got[:, :rope_cols].view(rows, -1, head_dim),
                       apply_rope(Linear(w)(x)[:, :rope_cols].view(rows, -1, head_dim), cos, sin))
    with pytest.raises(ValueError, match="cos and sin_signed"):
        fused(x)


def test_epilogues_that_cannot_apply_are_left_to_the_caller():
    """An odd head size or an output count the tiles do not divide: no fusion, plain products."""
    w = torch.randn(3 * 96, 64).bfloat16()
    assert Linear(w, epilogue=rope_epilogue(96, 192)).epilogue is None
    assert Linear(torch.randn(96, 64).bfloat16(), epilogue=SILU_MUL).epilogue is None
    assert Linear(torch.randn(128, 64), epilogue=SILU_MUL).epilogue is None  # float32: torch runs it
