"""The Triton LoRA kernel (model/lora_triton.py: every adapter's rows of a step in two launches,
by each row's slot) on CPU through triton's interpreter; tests/test_cuda.py runs the engine's
mixed-adapter batches against PEFT on a GPU, where LoRAStep.delta uses it."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, or kernels get compiled

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_each_row_gets_its_own_adapters_delta_and_base_rows_none(dtype, tol):
    from kvserve.model.lora_triton import lora_delta
    g = torch.Generator().manual_seed(0)
    slots, d_in, rank, d_out = 3, 40, 24, 70  # neither a power of two: the masks are exercised
    a_t = (torch.randn(slots, d_in, rank, generator=g) / 4).to(dtype)
    b_t = (torch.randn(slots, rank, d_out, generator=g) / 4).to(dtype)
    row_slots = torch.tensor([-1, 0, 0, 2, -1, 1, 1, 1, 2, 0, -1, 2, 1], dtype=torch.int32)
    x = torch.randn(row_slots.numel(), d_in, generator=g).to(dtype)
    got = lora_delta(x, row_slots, a_t, b_t)
    assert got.dtype == dtype and got.shape == (row_slots.numel(), d_out)
    for m, s in enumerate(row_slots.tolist()):
        if s < 0:
            assert torch.all(got[m] == 0), m
            continue
        want = x[m].double() @ a_t[s].double() @ b_t[s].double()
        assert torch.allclose(got[m].double(), want, rtol=tol, atol=tol), m
