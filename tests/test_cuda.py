"""The CUDA path on a real GPU: the Triton kernels compiled (not interpreted), the engine on the
device against transformers, and decode steps replayed as CUDA graphs against eager steps.

Skipped without a CUDA GPU (CI has none). Run it in its own process: test_triton_attention.py
sets TRITON_INTERPRET=1 when it is imported, after which triton interprets every kernel.
On a machine without the embedded model, point KVSERVE_SMOLLM2_TOKENIZER_DIR at a folder with
its tokenizer.json (bench/random_checkpoint.py DIR --no-weights writes one).
"""
from __future__ import annotations

import random

import pytest
import torch

# This file runs in a process of its own (tests/conftest.py, scripts/test.sh): test_triton_attention.py
# sets TRITON_INTERPRET for its process, under which triton cannot use a GPU.
pytestmark = pytest.mark.needs("cuda")

from attention_cases import HEADS, assert_matches, greedy_generate, run_step  # noqa: E402
from helpers import greedy, rand_prompts  # noqa: E402

GEN = 12

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.triton import interpreter_enabled  # noqa: E402


@pytest.fixture(autouse=True)
def compiled_kernels():
    assert not interpreter_enabled(), "TRITON_INTERPRET is set: run tests/test_cuda.py in its own process"
    # fp32 must be fp32: TF32 products would move greedy tokens against the float32 reference.
    torch.backends.cuda.matmul.allow_tf32 = False


# -- kernels: the interpreter tests' cases, compiled --

@pytest.mark.parametrize("max_splits", [1, 32], ids=["one-pass", "split"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", ["gqa", "mha", "gqa3"])
def test_decode_and_prefill_ragged(block_size: int, heads: str, max_splits: int) -> None:
    hq, hkv = HEADS[heads]
    starts = [0, 5, block_size - 1, block_size, 2 * block_size + 3, 300]
    out, ref, torch_out = run_step(num_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=block_size,
                                   start_pos=starts, query_lens=[1] * len(starts), device="cuda",
                                   max_decode_splits=max_splits)
    assert_matches(out, ref, torch.float32)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
    out, ref, torch_out = run_step(num_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=block_size,
                                   start_pos=[0, 7, block_size, 0], query_lens=[37, 20, 9, 2], device="cuda")
    assert_matches(out, ref, torch.float32)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window(window: int) -> None:
    out, ref, _ = run_step(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                           start_pos=[40, 3, 0, 25, 50], query_lens=[1, 1, 30, 18, 1], window=window,
                           device="cuda")
    assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_smollm2_shapes_default_tiles(dtype: torch.dtype) -> None:
    """SmolLM2's heads (9 query, 3 kv, head_dim 64), default 64x64 tiles, contexts of hundreds
    of keys over many blocks: decodes and chunks after a cached context in one step."""
    out, ref, _ = run_step(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                           start_pos=[300, 0, 511, 64, 1000], query_lens=[1, 200, 1, 130, 1],
                           dtype=dtype, block_m=None, block_n=None, device="cuda")
    assert_matches(out, ref, dtype)


def test_odd_head_dim_small_blocks() -> None:
    out, ref, _ = run_step(num_heads=6, num_kv_heads=2, head_dim=24, block_size=4,
                           start_pos=[0, 9, 13], query_lens=[70, 1, 6], block_m=None, block_n=None,
                           device="cuda")
    assert_matches(out, ref, torch.float32)


def test_tiny_model_cuda_matches_cpu_torch_backend(tmp_path) -> None:
    from tiny_models import make_tiny_model

    from kvserve.attention.selector import select_attention_backend
    from kvserve.model.llama import LlamaModel
    from kvserve.model.loader import load_model

    loaded = load_model(str(make_tiny_model(tmp_path, "llama_gqa")), torch.float32)
    c = loaded.config
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=gen).tolist() for n in (23, 9)]
    results = {}
    for name, device in (("torch", "cpu"), ("triton", "cuda")):
        backend = select_attention_backend(name, c, device)
        model = LlamaModel(c, loaded.weights, torch.float32, device, attention_backend=backend)
        results[name] = greedy_generate(model, c, prompts, steps=6, device=device)
    assert results["triton"][0] == results["torch"][0]
    for got, want in zip(results["triton"][1], results["torch"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# -- the engine on the GPU --

def generate(llm: LLM, prompts: list[list[int]], n: int = GEN) -> list[list[int]]:
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs]


def runner(llm: LLM):
    return llm.engine.runner


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_engine_matches_transformers(tiny, tiny_hf, enforce_eager: bool) -> None:
    """float32 on the GPU, token for token against transformers on the CPU: ragged batches
    (decode graphs of padded sizes), prefix hits, chunked prefill and preemption."""
    from hf_reference import hf_greedy

    path, hf = tiny, tiny_hf
    llm = LLM(str(path), dtype="float32", device="cuda", check_integrity=True, block_size=16,
              max_num_batched_tokens=64, max_num_seqs=16, num_gpu_blocks_override=24,
              max_model_len=320, enforce_eager=enforce_eager)
    graphs = runner(llm).graphs
    assert (graphs is None) == enforce_eager
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(3)
    base = [rng.randrange(vocab) for _ in range(100)]
    prompts = rand_prompts(1, [1, 2, 15, 16, 17, 90, 200], vocab) + [base[:60] + [5, 6], base[:70], base]
    for p, got in zip(prompts, generate(llm, prompts)):
        assert got == hf_greedy(hf, p, GEN), f"prompt of {len(p)} tokens diverged"
    if graphs is not None:
        assert graphs.replays > 0
    stats = llm.engine.kv.stats
    assert stats.hits > 0  # the shared prefix was reused
    assert llm.engine.scheduler.num_preemptions > 0  # 24 blocks of 16 cannot hold all 10 at once


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_step(tiny, dtype: str) -> None:
    """The same decode batch (no padding: its size is a captured size) through graphs and
    eagerly: the same kernels on the same shapes, so the same tokens and logprobs."""
    path = tiny
    prompts = rand_prompts(7, [5, 40, 33, 100, 64, 17, 250, 8], 49152)
    results = {}
    for eager in (True, False):
        llm = LLM(str(path), dtype=dtype, device="cuda", max_num_seqs=8, max_model_len=512,
                  num_gpu_blocks_override=256, enforce_eager=eager)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                          for o in outs]
        if not eager:
            assert runner(llm).graphs.replays >= 20
    for (tok_e, lp_e), (tok_g, lp_g) in zip(results[True], results[False]):
        assert tok_e == tok_g
        torch.testing.assert_close(torch.tensor(lp_g), torch.tensor(lp_e), rtol=0, atol=1e-6)


def test_batches_past_the_largest_graph_run_eagerly(tiny, tiny_hf) -> None:
    path, hf = tiny, tiny_hf
    from hf_reference import hf_greedy

    llm = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=12, max_cudagraph_capture_size=4,
              num_gpu_blocks_override=128, max_model_len=256)
    assert runner(llm).graphs.sizes == [1, 2, 4]
    prompts = rand_prompts(11, [3, 9, 30, 31, 50, 2, 7, 64, 80, 12, 5, 40], 49152)
    lengths = [4 + 2 * i for i in range(len(prompts))]  # the batch shrinks one request at a time
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    for p, n, o in zip(prompts, lengths, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n)
    assert runner(llm).graphs.replays >= 8  # the tail of the batch, once it shrank to <= 4


def test_quantized_cache_and_torch_backend_run_eagerly_on_cuda(tiny, tiny_hf) -> None:
    """What graphs cannot capture runs eagerly with the same results: the torch backend on
    CUDA (token-exact), an fp8 cache (close to full precision)."""
    path, hf = tiny, tiny_hf
    from hf_reference import hf_greedy

    prompts = rand_prompts(2, [20, 64, 7], 49152)
    torch_llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="torch",
                    num_gpu_blocks_override=64, max_model_len=256)
    assert runner(torch_llm).graphs is None
    for p, got in zip(prompts, generate(torch_llm, prompts)):
        assert got == hf_greedy(hf, p, GEN)
    fp8 = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_dtype="fp8",
              num_gpu_blocks_override=64, max_model_len=256)
    assert runner(fp8).graphs is None
    outs = generate(fp8, prompts)
    assert all(len(o) == GEN for o in outs)


def test_released_blocks_and_scores_beside_graph_replays(tiny) -> None:
    """KV compression on the GPU: steps holding a sequence with released blocks or scored rows
    run eagerly (a graph's captured positions and tables assume none released), and the plain
    requests beside them decode, through graphs where they can, as they do alone."""
    path = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=16, max_num_batched_tokens=64,
              num_gpu_blocks_override=128, max_model_len=320)
    prompts = rand_prompts(5, [150, 45, 70, 90], 49152)
    alone = generate(llm, prompts[1:], 60)
    comps = [{"method": "streaming", "sink_tokens": 4, "window": 32}, {"method": "h2o", "heavy_tokens": 32, "window": 32},
             {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 32, "window": 32, "observation_tokens": 8}]
    for comp in comps:
        outs = llm.generate(prompts, [greedy(60, kv_compression=comp)] + [greedy(60)] * 3, use_tqdm=False)
        llm.engine.kv.check_integrity()
        assert llm.engine.kv.pool.num_used_blocks == 0
        assert [o.outputs[0].token_ids for o in outs[1:]] == alone
        assert outs[0].outputs[0].num_attended_tokens <= 16 + 32 + 32 + 32
    assert runner(llm).graphs.replays > 0


def test_capture_sizes_follow_max_num_seqs(tiny) -> None:
    path = tiny
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_seqs=24, num_gpu_blocks_override=64,
              max_model_len=128)
    assert runner(llm).graphs.sizes == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_elementwise_kernels(dtype: torch.dtype) -> None:
    from fused_cases import check_fused_kernels

    check_fused_kernels(dtype, "cuda", rows=300)


@pytest.mark.needs("cuda_2")
def test_tp2_ranks_capture_and_replay_decode_graphs(tiny) -> None:
    """Tensor parallelism over NCCL, one GPU per rank: each rank captures its decode graphs with
    the all-reduces inside, and the ranks replay the same size at the same step; float32 tokens
    are TP=1's, through graphs and eagerly."""
    prompts = rand_prompts(4, [5, 40, 100, 17, 64, 8], 49152)
    kw = dict(dtype="float32", device="cuda", max_num_seqs=8, num_gpu_blocks_override=128, max_model_len=256)
    tp1 = LLM(str(tiny), enforce_eager=True, **kw)
    want = generate(tp1, prompts)
    tp1.engine.close()
    for eager in (True, False):
        llm = LLM(str(tiny), tensor_parallel_size=2, enforce_eager=eager, **kw)
        try:
            assert generate(llm, prompts) == want
            graphs = runner(llm).graphs
            assert (graphs is None) == eager
            if not eager:
                assert graphs.replays > 0
        finally:
            llm.engine.close()
