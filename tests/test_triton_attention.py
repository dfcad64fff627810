"""Triton paged-attention kernels on CPU through triton's interpreter (TRITON_INTERPRET=1).

Each case builds a step of ragged sequences over a pool whose block ids are shuffled, so a
wrong block-table walk or slot offset reads another sequence's keys. Outputs are compared with
a float64 softmax over the true K/V of each sequence (kept here, not read back from the cache),
so the cache write kernel, the decode kernel and the varlen prefill kernel are all checked.

The cases and their tolerances are in attention_cases.py. The CUDA path is the same kernels
compiled instead of interpreted: test_cuda.py runs these cases on a GPU. Sizes are tiny because
the interpreter runs every program in Python.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, or kernels get compiled

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401  (the interpreter runs the kernels)
from attention_cases import HEADS, assert_matches, cache_for, greedy_generate, run_step  # noqa: E402

from kvserve.attention import triton as triton_backend  # noqa: E402
from kvserve.attention.base import build_attention_metadata  # noqa: E402
from kvserve.attention.cpu import CPUAttentionBackend  # noqa: E402
from kvserve.attention.selector import select_attention_backend  # noqa: E402
from kvserve.attention.triton import TritonAttentionBackend, triton_support  # noqa: E402
from kvserve.config import ConfigError, ModelConfig  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", ["gqa", "mha"])
def test_decode_batch_ragged(block_size: int, heads: str) -> None:
    hq, hkv = HEADS[heads]
    # Contexts ending inside, at the end of, and one past a block; one single-token prompt.
    starts = [0, 5, block_size - 1, block_size, 2 * block_size + 3]
    out, ref, torch_out = run_step(num_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=block_size,
                                   start_pos=starts, query_lens=[1] * len(starts))
    assert_matches(out, ref, torch.float32)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("max_splits", [1, 2, 32])
def test_decode_split_into_key_ranges(max_splits: int) -> None:
    """Flash-decoding: each decode's keys in `splits` ranges, combined; 1 is the one-pass kernel.
    Contexts from 1 key (most ranges empty) to several tiles per range."""
    starts = [0, 3, 40, 95, 200]
    backend = TritonAttentionBackend(6, 2, 16, 0.25, device="cpu", max_decode_splits=max_splits)
    assert backend.decode_splits(len(starts)) == min(4, max_splits)  # 16 "SMs" x 4 / 10 programs
    out, ref, torch_out = run_step(num_heads=6, num_kv_heads=2, head_dim=16, block_size=16,
                                   start_pos=starts, query_lens=[1] * len(starts), max_decode_splits=max_splits)
    assert_matches(out, ref, torch.float32)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


def test_decode_splits_follow_the_batch() -> None:
    backend = TritonAttentionBackend(9, 3, 64, 0.125, device="cpu")  # 16 "SMs" under the interpreter
    assert [backend.decode_splits(n) for n in (1, 2, 5, 21, 22, 64)] == [16, 8, 4, 1, 1, 1]
    assert TritonAttentionBackend(9, 3, 64, 0.125, device="cpu", max_decode_splits=4).decode_splits(1) == 4
    with pytest.raises(ValueError, match="max_decode_splits"):
        TritonAttentionBackend(9, 3, 64, 0.125, device="cpu", max_decode_splits=0)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", ["gqa", "mha"])
def test_prefill_and_chunked_prefill_ragged(block_size: int, heads: str) -> None:
    hq, hkv = HEADS[heads]
    # A whole prompt spanning tiles, chunks continuing mid-block and at a block boundary.
    out, ref, torch_out = run_step(num_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=block_size,
                                   start_pos=[0, 7, block_size, 0], query_lens=[37, 20, 9, 2])
    assert_matches(out, ref, torch.float32)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window_mixed_step(window: int) -> None:
    # Decodes far past the window (whole blocks fall out) next to chunks straddling it.
    out, ref, torch_out = run_step(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                                   start_pos=[40, 3, 0, 25, 50], query_lens=[1, 1, 30, 18, 1],
                                   window=window)
    assert_matches(out, ref, torch.float32)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_odd_group_odd_head_dim_small_blocks_default_tiles() -> None:
    # 3 query heads per kv head (SmolLM2's ratio), head_dim 24 (padded to 32), block size 4
    # below the 16-key tile, default 64x64 tiles; an MQA step with a 1-token-prompt too.
    out, ref, _ = run_step(num_heads=6, num_kv_heads=2, head_dim=24, block_size=4,
                           start_pos=[0, 9, 13], query_lens=[70, 1, 6], block_m=None, block_n=None)
    assert_matches(out, ref, torch.float32)
    out, ref, _ = run_step(num_heads=3, num_kv_heads=1, head_dim=16, block_size=16,
                           start_pos=[0, 21], query_lens=[1, 1])
    assert_matches(out, ref, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    out, ref, _ = run_step(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                           start_pos=[0, 18, 33], query_lens=[20, 1, 1], dtype=dtype)
    assert_matches(out, ref, dtype)


def test_write_skips_negative_slots() -> None:
    cache = cache_for(2, 16, 16, 4, torch.float32)
    backend = TritonAttentionBackend(2, 2, 16, 0.25, device="cpu")
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    backend.write_kv(k, v, cache.kv[0, 0], cache.kv[0, 1], torch.tensor([17, -1, 63]))
    flat_k = cache.kv[0, 0].reshape(64, 2, 16)
    assert torch.equal(flat_k[17], k[0]) and torch.equal(flat_k[63], k[2])
    assert int((flat_k.abs().sum((1, 2)) != 0).sum()) == 2  # the padding token wrote nothing


# -- availability and selection --

def tiny_config(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=8, hidden_size=32, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64)
    return ModelConfig(**{**base, **overrides})


def test_cpu_without_interpreter_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    support = triton_support("cpu")
    assert not support.available and "TRITON_INTERPRET=1" in support.reason
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", tiny_config(), "cpu")
    assert isinstance(select_attention_backend("auto", tiny_config(), "cpu"), CPUAttentionBackend)


def test_missing_triton_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = triton_backend.importlib.util.find_spec
    monkeypatch.setattr(triton_backend.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    support = triton_support("cuda")
    assert not support.available and "pip install triton" in support.reason


def test_selection_rules() -> None:
    assert isinstance(select_attention_backend("torch", tiny_config(), "cpu"), CPUAttentionBackend)
    # Under the interpreter "triton" runs on CPU; "auto" still keeps CPU on torch.
    chosen = select_attention_backend("triton", tiny_config(sliding_window=8), "cpu")
    assert isinstance(chosen, TritonAttentionBackend) and chosen.window == 8
    assert isinstance(select_attention_backend("auto", tiny_config(), "cpu"), CPUAttentionBackend)
    with pytest.raises(ConfigError, match="--attention-backend must be one of"):
        select_attention_backend("flash", tiny_config(), "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8", "int4"])
def test_quantized_cache_matches_torch_backend(kv_dtype: str) -> None:
    """Quantized caches: both backends write through the cache (same codes) and read the same
    dequantized values - the torch backend by gathering, triton through its step-sized scratch
    pool and renumbered block tables - so outputs agree to float32 accumulation order (1e-5).
    Decodes and chunked prefills over scattered blocks, open (residual) blocks included."""
    from kvserve.cache.factory import create_kv_cache

    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512)
    bs, gen = 16, torch.Generator().manual_seed(0)
    start_pos, query_lens = [40, 0, 17, 70], [1, 20, 9, 1]
    seq_lens = [s + n for s, n in zip(start_pos, query_lens)]
    ids = list(range(sum(-(-n // bs) for n in seq_lens) + 3))
    random.Random(0).shuffle(ids)
    tables, at = [], 0
    for n in seq_lens:
        tables.append(ids[at:at + -(-n // bs)])
        at += -(-n // bs)
    caches = [create_kv_cache(cfg, num_blocks=len(ids), block_size=bs, kv_cache_dtype=kv_dtype,
                              dtype=torch.float32, num_residual_blocks=8) for _ in range(2)]
    for i, s in enumerate(start_pos):  # history, written identically into both caches
        if s:
            slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(s)])
            kh, vh = (torch.randn(s, 2, 32, generator=gen) for _ in range(2))
            for c in caches:
                c.write(1, slots, kh, vh)
    meta = build_attention_metadata(start_pos, query_lens, tables, bs)
    q = torch.randn(meta.num_tokens, 4, 32, generator=gen)
    k, v = (torch.randn(meta.num_tokens, 2, 32, generator=gen) for _ in range(2))
    got = TritonAttentionBackend(4, 2, 32, 32 ** -0.5, device="cpu").forward(1, q, k, v, caches[0], meta)
    want = CPUAttentionBackend(4, 2, 32, 32 ** -0.5).forward(
        1, q, k, v, caches[1], build_attention_metadata(start_pos, query_lens, tables, bs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- end to end: the tiny model generates greedily with either backend --

@pytest.mark.parametrize("kind", ["llama_gqa", pytest.param("mistral_swa", marks=pytest.mark.slow)])
def test_tiny_model_greedy_matches_torch_backend(kind: str, tmp_path) -> None:
    from tiny_models import make_tiny_model

    from kvserve.model.llama import LlamaModel
    from kvserve.model.loader import load_model

    loaded = load_model(str(make_tiny_model(tmp_path, kind)), torch.float32)
    c = loaded.config
    gen = torch.Generator().manual_seed(0)
    # 23 tokens: longer than mistral_swa's window of 16, so the window bites from the prefill on.
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=gen).tolist() for n in (23, 9)]
    results = {}
    for name in ("torch", "triton"):
        backend = select_attention_backend(name, c, "cpu")
        model = LlamaModel(c, loaded.weights, torch.float32, "cpu", attention_backend=backend)
        results[name] = greedy_generate(model, c, prompts, steps=6)
    assert results["triton"][0] == results["torch"][0]
    for got, want in zip(results["triton"][1], results["torch"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# -- the same kernels compiled (not interpreted) for an H100, without a GPU --

AOT_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvserve.attention import triton_kernels as K

    INT_PTRS = {"block_tables_ptr", "seq_lens_ptr", "seq_ids_ptr", "token_rows_ptr",
                "query_start_loc_ptr", "slot_mapping_ptr"}
    FP32_PTRS = {"m_ptr", "l_ptr", "acc_ptr"}  # flash-decoding partials

    def compile_for(fn, dtype, constexprs):
        sig = {n: "constexpr" if n in constexprs else "*i64" if n in INT_PTRS else "*fp32" if n in FP32_PTRS
               else "*" + dtype if n.endswith("_ptr") else "fp32" if n in ("qk_scale_log2", "eps") else "i32"
               for n in fn.arg_names}
        ce = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32))
        assert out.asm.get("cubin"), fn.__name__
        print(fn.__name__, dtype, "cubin", len(out.asm["cubin"]), "shared", out.metadata.shared)

    for dtype, precision in (("fp32", "ieee"), ("bf16", "tf32")):
        tile = dict(HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_N=64, SLIDING_WINDOW=7,
                    PRECISION=precision, DOT_FP32=False, GROUP=3)
        compile_for(K.paged_decode_kernel, dtype, dict(tile, GROUP_PAD=16))
        compile_for(K.paged_prefill_kernel, dtype, dict(tile, BLOCK_M=64))
        compile_for(K.paged_decode_split_kernel, dtype, dict(tile, GROUP_PAD=16, NUM_SPLITS=8))
        compile_for(K.paged_decode_reduce_kernel, dtype,
                    dict(GROUP=3, GROUP_PAD=16, HEAD_DIM=64, D_PAD=64, NUM_SPLITS=8, SPLITS_PAD=8))
    compile_for(K.reshape_and_cache_kernel, "bf16",
                dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_SIZE=16, H_PAD=4, D_PAD=64))
    from kvserve.model import fused_triton as F  # the CUDA model's norm, rotary and SiLU kernels
    compile_for(F._add_rms_norm_kernel, "bf16", dict(HAS_DELTA=True, BLOCK=1024))
    compile_for(F._rope_kernel, "bf16", dict(HALF=32, H_PAD=16))
    compile_for(F._silu_mul_kernel, "bf16", dict(BLOCK=1024))
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """The interpreter accepts code the compiler rejects (type mismatches across branches, dot
    shapes below 16); compile to cubin for sm_90 in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cubin") == 12, proc.stdout


def test_fused_elementwise_kernels_interpreted() -> None:
    """fused_triton (the CUDA model's norm, rotary and SiLU kernels) under the interpreter, in
    fp16; test_cuda.py runs bf16 too on a GPU."""
    from fused_cases import check_fused_kernels

    check_fused_kernels(torch.float16, "cpu")
