"""Tensor parallelism (--tensor-parallel-size): greedy tokens at TP=2, 3 and 4 against TP=1 through
prefix hits, chunked prefill and preemption (by recompute and by swap), on tiny checkpoints and
the embedded model; a rank killed mid-stream fails the requests and the
engine instead of hanging it; bad settings are start-up errors naming the flag."""
from __future__ import annotations

import os
import random
import re
import signal
import time

import httpx
import pytest
import torch
from helpers import wait_until

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError, EngineArgs, ModelConfig
from kvserve.model.shard import kv_heads_per_rank, rank_config, shard_weights

GEN = 16


def _shared_cpus(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving `ranks` ranks this process's CPUs in turn (more ranks than CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


def _cfg(hq: int, hkv: int, inter: int = 128) -> ModelConfig:
    return ModelConfig("llama", 100, 64, inter, 2, hq, hkv, 64 // hq, 128)


def test_kv_heads_split_replicated_or_refused_naming_both_numbers():
    assert kv_heads_per_rank(_cfg(4, 2), 2) == 1
    assert kv_heads_per_rank(_cfg(4, 2), 4) == 1  # each KV head held by two ranks
    assert kv_heads_per_rank(_cfg(8, 8), 4) == 2
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        kv_heads_per_rank(_cfg(4, 2), 3)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4 and the model's 3 KV heads"):
        kv_heads_per_rank(_cfg(12, 3), 4)
    with pytest.raises(ConfigError, match=r"MLP width 130"):
        kv_heads_per_rank(_cfg(4, 2, inter=130), 4)


def test_shards_put_back_together_are_the_model():
    """Column-parallel slices stacked and row-parallel slices side by side give the weights back;
    replicated KV heads are the head the rank's query heads read."""
    cfg = _cfg(4, 2)
    d = cfg.head_dim
    g = torch.Generator().manual_seed(0)
    w = {f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(n * d, 64, generator=g)
         for p, n in (("q", 4), ("k", 2), ("v", 2))}
    w["model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 4 * d, generator=g)
    w["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 128, generator=g)
    w["model.layers.0.mlp.down_proj.bias"] = torch.randn(64, generator=g)
    w["model.norm.weight"] = torch.randn(64, generator=g)
    for tp in (2, 4):
        shards = [shard_weights(w, cfg, r, tp) for r in range(tp)]
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(torch.cat([s[q] for s in shards]), w[q])
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(torch.cat([s[o] for s in shards], 1), w[o])
        assert all(torch.equal(s["model.norm.weight"], w["model.norm.weight"]) for s in shards)
        assert sum("model.layers.0.mlp.down_proj.bias" in s for s in shards) == 1  # added once, after the sum
        k = "model.layers.0.self_attn.k_proj.weight"
        for r, s in enumerate(shards):
            local = rank_config(cfg, tp)
            first_q = r * local.num_attention_heads
            kv_head = first_q // (cfg.num_attention_heads // cfg.num_key_value_heads)
            assert torch.equal(s[k][:d], w[k][kv_head * d:(kv_head + 1) * d])


def _workload(llm) -> tuple[list[list[int]], dict]:
    """Prompts that hit the prefix cache, take several chunks, and run under a pool small enough
    to preempt; the token ids of every output and the engine's counters."""
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(7)
    base = [rng.randrange(vocab) for _ in range(120)]
    first = llm.generate([base], SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True), use_tqdm=False)
    prompts = [base[:100] + [3, 4], base[:64], [rng.randrange(vocab) for _ in range(90)],
               [rng.randrange(vocab) for _ in range(40)], base[:30] + [9]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True), use_tqdm=False)
    llm.engine.kv.check_integrity()
    tokens = [list(o.outputs[0].token_ids) for o in first + outs]
    return tokens, {"cached": sum(o.num_cached_tokens for o in outs),
                    "preemptions": llm.engine.scheduler.num_preemptions,
                    "swapped": llm.engine.get_stats().num_swapped_preemptions}


def _run(path: str | None, tp: int, **kw) -> tuple[list[list[int]], dict]:
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, block_size=8, num_gpu_blocks_override=22,
              max_model_len=160, max_num_batched_tokens=48, check_integrity=True, **kw)
    try:
        return _workload(llm)
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tp1_tokens(tiny):
    return _run(tiny, 1)


def test_tp2_greedy_equals_tp1_through_prefix_hits_chunks_and_preemption(tiny, tp1_tokens):
    """Float32, a tiny GQA checkpoint (4 query / 2 KV heads): one KV head per rank. The pool of
    each rank holds as many blocks as TP=1's (its heads only), so the scheduler sees the same
    pool and preempts at the same points."""
    want, counters = tp1_tokens
    assert counters["cached"] > 100 and counters["preemptions"] > 0, counters  # the paths were taken
    got, tp_counters = _run(tiny, 2)
    assert got == want
    assert tp_counters == counters


def test_tp4_replicates_kv_heads_and_equals_tp1(tiny, tp1_tokens, monkeypatch):
    """TP=4 over 2 KV heads: each KV head held by two ranks (as vLLM does); four ranks share the
    cores by an explicit binding."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", _shared_cpus(4))
    got, _ = _run(tiny, 4)
    assert got == tp1_tokens[0]


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_tp3_greedy_equals_tp1_on_six_heads_over_three(tmp_path_factory, monkeypatch, swap):
    """TP=3 on a checkpoint whose 6 query / 3 KV heads and MLP split in three (one KV head per
    rank), float32, through prefix hits, chunks and preemption by recompute or by swap (the host
    tier restoring every rank's heads)."""
    from tiny_models import make_tiny_model
    path = str(make_tiny_model(tmp_path_factory.mktemp("h6kv3"), kind="llama_h6kv3"))
    kw = dict(preemption_mode="swap", swap_space=0.01) if swap else {}
    want, counters = _run(path, 1, **kw)
    assert counters["cached"] > 100 and counters["preemptions"] > 0 and (counters["swapped"] > 0) == swap, counters
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", _shared_cpus(3))
    got, tp_counters = _run(path, 3, **kw)
    assert got == want
    assert tp_counters == counters  # each rank's pool holds as many blocks: the same schedule


@pytest.mark.slow
def test_tp3_on_the_embedded_model_equals_tp1_in_fp32(monkeypatch):
    """SmolLM2-135M (9 query / 3 KV heads) in float32 at TP=3, token for token against TP=1,
    through prefix hits, chunks and preemption by swap with its host-tier restores."""
    kw = dict(quantization="none", preemption_mode="swap", swap_space=0.05)
    want, counters = _run(None, 1, **kw)
    assert counters["cached"] > 100 and counters["swapped"] > 0, counters
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", _shared_cpus(3))
    got, tp_counters = _run(None, 3, **kw)
    assert got == want
    assert tp_counters == counters


def test_swap_preemption_at_tp2_moves_every_ranks_heads(tiny, tp1_tokens):
    """Preemption by swap: the host tier holds each preempted block's heads of both ranks, and
    the resumed requests decode as TP=1's did."""
    llm = LLM(tiny, dtype="float32", tensor_parallel_size=2, block_size=8, num_gpu_blocks_override=22,
              max_model_len=160, max_num_batched_tokens=48, check_integrity=True, preemption_mode="swap",
              swap_space=0.01)
    try:
        got, _ = _workload(llm)
        s = llm.engine.get_stats()
        assert s.num_swapped_preemptions > 0 and s.tier_hits["host"] > 0, s
        assert got == tp1_tokens[0]
    finally:
        llm.engine.close()


def test_disk_tier_entries_hold_every_rank_and_another_tp_size_never_reads_them(tiny, tmp_path):
    """Blocks written down at TP=2 come back at TP=2 after a restart; at TP=1 (another
    fingerprint) none is read, and one planted under TP=1's own name is refused by the
    fingerprint in its frame and counted, never restored."""
    import shutil

    from kvserve.kv.hashing import extend_block_hashes, root_hash
    disk_dir = tmp_path / "kv"
    common = dict(dtype="float32", block_size=16, num_gpu_blocks_override=40, max_model_len=512,
                  kv_disk_path=str(disk_dir), kv_disk_size="64MiB")
    rng = random.Random(3)
    prompts = [[rng.randrange(4000) for _ in range(160)] for _ in range(3)]
    filler = [[rng.randrange(4000) for _ in range(160)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)

    def tokens(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    a = LLM(tiny, tensor_parallel_size=2, **common)
    want = tokens(a.generate(prompts, params, use_tqdm=False))
    a.generate(filler, params, use_tqdm=False)
    fp2 = a.engine.setup.fingerprint.hex
    a.engine.close()
    assert any(n.startswith(fp2) for n in os.listdir(disk_dir))
    b = LLM(tiny, tensor_parallel_size=2, **common)
    try:
        assert tokens(b.generate(prompts, params, use_tqdm=False)) == want
        assert b.engine.get_stats().tier_hits["disk"] >= 3 * 144
    finally:
        b.engine.close()
    c = LLM(tiny, tensor_parallel_size=1, **common)
    fp1 = c.engine.setup.fingerprint.hex
    c.engine.close()
    assert fp1 != fp2
    key = extend_block_hashes([], root_hash("auto"), prompts[0], 16)[0].hex()
    shutil.copy(disk_dir / f"{fp2}-{key}.kvb", disk_dir / f"{fp1}-{key}.kvb")
    c = LLM(tiny, tensor_parallel_size=1, **common)
    try:
        assert tokens(c.generate(prompts, params, use_tqdm=False)) == want
        s = c.engine.get_stats()
        assert s.tier_incompatible["disk"] == 1 and s.tier_hits["disk"] == 0
    finally:
        c.engine.close()


def test_lora_adapters_split_as_their_projections_equal_tp1(tiny, tmp_path):
    """Three adapters (all seven targets; q, v, down with rsLoRA; k, o, gate, up) in mixed
    batches over two slots, so adapters are swapped in and out: every rank loads each adapter
    split as its projections are, and TP=2's tokens are TP=1's."""
    from hf_reference import load_hf
    from lora_adapters import make_adapter

    from kvserve import LoRARequest
    hf = load_hf(tiny)
    names = {"a": make_adapter(hf, tmp_path / "a", r=8, alpha=16, seed=1),
             "b": make_adapter(hf, tmp_path / "b", r=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "down_proj"),
                               rslora=True),
             "c": make_adapter(hf, tmp_path / "c", r=6, alpha=6, seed=3,
                               targets=("k_proj", "o_proj", "gate_proj", "up_proj"))}
    prompts = [[(13 * i + k) % 4000 + 10 for i in range(n)] for k, n in enumerate((40, 41, 70, 9, 33, 51))]
    which = ["a", "a", "b", None, "c", "b"]
    requests = [None if n is None else LoRARequest(n, "abc".index(n) + 1, names[n]) for n in which]
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(tiny, dtype="float32", tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8,
                  max_cpu_loras=2, kv_cache_memory=8 << 20, max_num_batched_tokens=48)
        try:
            runs.append([list(o.outputs[0].token_ids)
                         for o in llm.generate(prompts, params, lora_request=requests, use_tqdm=False)])
            assert llm.engine.get_stats().lora_slot_loads >= 3
        finally:
            llm.engine.close()
    assert runs[1] == runs[0]
    plain = _tokens(tiny, 1, prompts[:1], params)
    assert plain[0] != runs[0][0]  # the adapter changed the output


def _tokens(path: str, tp: int, prompts, params, **kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=8 << 20, block_size=16, **kw)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_per_rank_equals_tp1(tiny, kv_cache_dtype):
    """Each rank quantizes its own heads: scales are per head, so the codes are TP=1's."""
    prompts = [[(7 * i + 3) % 4000 + 10 for i in range(n)] for n in (70, 23)]
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    want = _tokens(tiny, 1, prompts, params, kv_cache_dtype=kv_cache_dtype)
    assert _tokens(tiny, 2, prompts, params, kv_cache_dtype=kv_cache_dtype) == want


def test_h2o_scores_are_summed_over_the_ranks(tiny):
    """h2o keeps the blocks that received the most attention over all heads: each rank scores its
    own heads, the sum decides, so the same blocks go and the tokens are TP=1's."""
    prompt = [(11 * i + 5) % 4000 + 10 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            kv_compression={"method": "h2o", "window": 32, "heavy_tokens": 32})
    want = _tokens(tiny, 1, [prompt], params)
    assert _tokens(tiny, 2, [prompt], params) == want


def test_offline_llm_restores_the_callers_cpus(tiny):
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    llm = LLM(tiny, dtype="float32", tensor_parallel_size=2, kv_cache_memory=4 << 20)
    assert llm.engine.runner.tensor_parallel_size == 2
    llm.engine.close()
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


def test_a_rank_that_hangs_fails_the_step_after_the_timeout(tiny, monkeypatch):
    """A stopped rank (SIGSTOP: alive, silent) holds rank 0's all-reduce only until
    KVSERVE_TP_TIMEOUT_S; the step fails, and so does every later one, without waiting again."""
    from kvserve.errors import TensorParallelError
    monkeypatch.setenv("KVSERVE_TP_TIMEOUT_S", "3")
    llm = LLM(tiny, dtype="float32", tensor_parallel_size=2, kv_cache_memory=4 << 20)
    pid = llm.engine.runner._ranks[0].proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="KVSERVE_TP_TIMEOUT_S"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError, match="cannot run another step"):
            llm.engine.runner.execute(None)
    finally:
        os.kill(pid, signal.SIGCONT)
        llm.engine.close()


@pytest.mark.slow
def test_tp3_on_the_embedded_model_agrees_with_tp1_in_bf16(smollm2_hf, monkeypatch):
    """SmolLM2-135M's 9 query / 3 KV heads at TP=3 (one KV head per rank), bf16, against TP=1 on
    the same weights: the tokens agree up to near-ties within the bound transformers' own bf16
    rounding sets. Each rank's projections over its share of the Q4_1 codes (--quantization gguf)
    give the bits of its dequantized bf16 shard (--quantization none): the same tokens and logprobs."""
    from fidelity import TEXT, assert_greedy_agrees, bf16_bound, run_of

    from kvserve.ops.cpu_kernels import gemm_codes_kernel
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", _shared_cpus(3))
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=5)
    words = TEXT.split()
    texts = [" ".join(words[i:i + n]) for i, n in ((0, 40), (50, 12), (0, 25))]  # the third hits the first's prefix
    runs = {}
    for tp, q in ((1, "gguf"), (3, "none"), (3, "gguf")):
        llm = LLM(None, dtype="bfloat16", quantization=q, tensor_parallel_size=tp, kv_cache_memory=64 << 20,
                  max_model_len=512, max_num_batched_tokens=32)
        try:
            layer = llm.engine.runner.model.layers[0]  # rank 0's
            coded = q == "gguf" and gemm_codes_kernel("Q4_1") is not None
            assert {p.codes for p in layer.projections().values()} == {"Q4_1" if coded else None}
            outs = llm.generate(texts, params, use_tqdm=False)
            runs[tp, q] = [run_of(o.outputs[0]) for o in outs]
            prompts = [list(o.prompt_token_ids) for o in outs]
        finally:
            llm.engine.close()
    assert runs[3, "gguf"] == runs[3, "none"]
    seqs = [p + r.tokens for p, r in zip(prompts, runs[1, "gguf"])]
    bound = bf16_bound(smollm2_hf, seqs, [range(len(p) - 1, len(s) - 1) for p, s in zip(prompts, seqs)])
    assert_greedy_agrees(runs[3, "gguf"], runs[1, "gguf"], bound, what="TP=3 vs TP=1")


def test_bad_settings_are_start_up_errors_naming_the_flag(tiny, monkeypatch):
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        LLM(tiny, dtype="float32", tensor_parallel_size=3)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    with pytest.raises(ConfigError, match=rf"--tensor-parallel-size {cores * 2} needs at least one CPU per replica.*"
                                          rf"lower --tensor-parallel-size to at most {cores}"):
        LLM(tiny, dtype="float32", tensor_parallel_size=cores * 2)
    with pytest.raises(ConfigError, match=r"--distributed-executor-backend uni runs one process"):
        EngineArgs(model=tiny, tensor_parallel_size=2, distributed_executor_backend="uni").validate()
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size must be >= 1"):
        EngineArgs(model=tiny, tensor_parallel_size=0).validate()


@pytest.mark.slow
@pytest.mark.parametrize("core_process", ["1", "0"])
def test_serve_tp2_and_a_rank_killed_mid_stream_fails_the_request_and_the_engine(tiny, core_process):
    """`kvserve serve -tp 2` (the engine core in its own process, or on a thread): a completion,
    then a stream during which rank 1 is SIGKILLed: the stream ends with an error naming the
    rank, /health turns unhealthy, no wait is unbounded."""
    from server_util import SMALL, start_server
    server = start_server(*SMALL, "--model", tiny, "-tp", "2", "--disable-log-stats",
                          env={"KVSERVE_TP_TIMEOUT_S": "20", "VLLM_ENABLE_V1_MULTIPROCESSING": core_process})
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello there", "max_tokens": 8,
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        pid = int(wait_until(lambda: re.search(r"tensor-parallel rank 1 of 2 running in process (\d+)", server.log()),
                             timeout=10, what="rank 1's start line").group(1))
        body = {"prompt": "count", "max_tokens": 800, "ignore_eos": True, "stream": True, "temperature": 0}
        lines, killed_at = [], None
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                lines.append(line)
                if killed_at is None and len(lines) > 10:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None and time.monotonic() - killed_at < 30
        text = "\n".join(lines)
        assert "tensor-parallel rank 1" in text and "killed by signal 9" in text, text[-2000:]
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code != 200, timeout=30,
                   what="/health unhealthy")
        wait_until(lambda: "the engine cannot continue" in server.log(), timeout=10, what="the core's exit line")
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_through_swap_and_a_disk_restore_equals_tp1(tiny, tmp_path, kv_cache_dtype):
    """Quantized blocks move through the tiers as every rank's codes and scales (and an open
    block's full-precision residual, under swap): swap preemption, then a restart restoring the
    prompts from disk, give TP=1's tokens, and the restart reads the blocks rather than recomputing."""
    common = dict(dtype="float32", block_size=8, num_gpu_blocks_override=22, max_model_len=160,
                  max_num_batched_tokens=48, check_integrity=True, preemption_mode="swap", swap_space=0.01,
                  kv_cache_dtype=kv_cache_dtype, kv_disk_size="32MiB")

    def run(tp: int, disk: str):
        tokens, hits = [], []
        for _ in range(2):  # the second engine starts on the first one's disk tier
            llm = LLM(tiny, tensor_parallel_size=tp, kv_disk_path=disk, **common)
            try:
                got, _ = _workload(llm)
                s = llm.engine.get_stats()
                tokens.append(got)
                hits.append((s.num_swapped_preemptions, s.tier_hits["host"], s.tier_hits["disk"]))
            finally:
                llm.engine.close()
        return tokens, hits

    want, want_hits = run(1, str(tmp_path / "tp1"))
    got, got_hits = run(2, str(tmp_path / "tp2"))
    assert want_hits[0][0] > 0 and want_hits[0][1] > 0 and want_hits[1][2] > 0, want_hits  # the paths were taken
    assert got == want
    assert got_hits == want_hits
