"""model/fused.py: the compiled bf16 residual-add + RMSNorm and rotary passes against torch's ops
(transformers' arithmetic), including the fallbacks for layouts the passes do not take."""
from __future__ import annotations

import pytest
import torch

from kvserve.model.fused import ElementwiseOps, apply_rope, rms_norm

compiled = pytest.mark.needs("avx512_bf16")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@compiled
@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (2048, 576), (7, 100), (3, 24)])
def test_add_rms_norm_matches_torch(rows, hidden):
    """The residual add is torch's bit for bit; the norm differs only where the float32 sum of
    squares, summed in another order, moves a value across a bf16 rounding boundary."""
    torch.manual_seed(rows)
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    h = torch.randn(rows, hidden).bfloat16()
    delta = torch.randn(rows, 2 * hidden).bfloat16()[:, :hidden]  # a strided view, as o_proj's rows may be
    w = torch.randn(hidden).bfloat16()
    for d in (delta, None):
        h_ours, h_ref = h.clone(), h.clone()
        ours = ops.add_rms_norm(h_ours, d, w, 1e-5)
        if d is not None:
            h_ref.add_(d)
        ref = rms_norm(h_ref, w, 1e-5)
        assert torch.equal(h_ours, h_ref)
        diff = ulps(ours, ref)
        assert diff.max() <= 2 and (diff == 0).float().mean() > 0.999


@compiled
@pytest.mark.parametrize("head_dim,heads", [(64, 12), (128, 4), (16, 6), (24, 3)])
def test_rope_in_place_equals_torch(head_dim, heads):
    torch.manual_seed(head_dim)
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    t = 37
    qkv = torch.randn(t, heads * head_dim + 40).bfloat16()  # rotated columns, then others (v)
    freqs = torch.arange(t).float()[:, None] * (1e4 ** -(torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]
    ref = apply_rope(qkv[:, :heads * head_dim].view(t, heads, head_dim), cos, sin)
    mine = qkv.clone()
    got = ops.rope(mine[:, :heads * head_dim].view(t, heads, head_dim), cos, sin)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(got, ref)
    assert torch.equal(mine[:, heads * head_dim:], qkv[:, heads * head_dim:])  # nothing else touched


@compiled
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (2048, 1536), (5, 40), (3, 8)])
def test_silu_mul_matches_torch(rows, inter):
    """bf16(bf16(silu(gate)) * up) as torch's F.silu(gate).mul_(up): equal except where the float32
    SiLU, whose exp is within 1-2 ulps of torch's, sits that close to a bf16 rounding boundary."""
    torch.manual_seed(rows)
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).bfloat16()  # saturated ends, zero
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate).mul_(up)
    ours = ops.silu_mul(gate_up)
    diff = ulps(ours, ref)
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.999, (diff.max(), (diff == 0).float().mean())
    strided = torch.cat((gate_up, gate_up[:, :16]), 1)[:, :2 * inter]  # rows further apart than 2I
    assert torch.equal(ops.silu_mul(strided), ours)


def test_other_layouts_and_dtypes_take_torchs_ops():
    """float32 never uses the compiled passes (token-exact reference); a non-contiguous residual
    stream falls back to torch, with the same in-place semantics."""
    assert ElementwiseOps(torch.float32, "cpu")._add_rms_norm is None
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    h = torch.randn(8, 64).bfloat16().T.contiguous().T  # column-major [8, 64]
    delta, w = torch.randn(8, 64).bfloat16(), torch.randn(64).bfloat16()
    expect_h = h + delta
    out = ops.add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(h, expect_h) and torch.equal(out, rms_norm(expect_h, w, 1e-6))
