"""The engine's greedy output equals transformers' token for token (float32), whatever batching,
prefix caching, chunked prefill or preemption did on the way."""
from __future__ import annotations

import random

import pytest
from helpers import greedy, rand_prompts
from hf_reference import hf_greedy, load_hf
from tiny_models import make_tiny_model

from kvserve import LLM, SamplingParams
from kvserve.engine.outputs import RequestError

GEN = 12




def check(llm, hf, prompts, n=GEN):
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens diverged"
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0
    return outs


@pytest.mark.slow
def test_batch1_and_batch32(tiny, tiny_hf):
    path, hf = tiny, tiny_hf
    llm = LLM(str(path), dtype="float32", check_integrity=True, kv_cache_memory=64 * 2**20)
    vocab = llm.engine.model_config.vocab_size
    check(llm, hf, rand_prompts(0, [37], vocab))
    lengths = [1, 2, 15, 16, 17, 600] + [random.Random(i).randint(1, 600) for i in range(26)]
    check(llm, hf, rand_prompts(1, lengths, vocab))


def test_prefix_cache_hits_chunked_prefill_and_branching(tiny, tiny_hf):
    path, hf = tiny, tiny_hf
    llm = LLM(str(path), dtype="float32", check_integrity=True, block_size=16,
              max_num_batched_tokens=64, kv_cache_memory=64 * 2**20)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(5)
    base = [rng.randrange(vocab) for _ in range(200)]
    prompts = [
        base[:10] + [1, 2, 3],          # shares less than one block
        base[:16] + [4, 5],             # exactly one block
        base[:150] + [6, 7, 8, 9],      # many blocks, then branches
        base[:150] + [7, 6],            # branches from the same prefix
        base[:155],                     # ends mid-block inside a cached prefix
        [9] * 40,                       # shares nothing
    ]
    check(llm, hf, [base])              # warm the cache with the full base prompt
    outs = check(llm, hf, prompts)
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 10 and cached[1] == 16, cached  # partial blocks hit too (copy-on-write)
    assert cached[2] == 150 and cached[3] == 150 and cached[4] == 154, cached
    assert cached[5] == 0
    assert llm.engine.kv.stats.partial_hit_tokens > 0


@pytest.mark.slow
def test_forced_preemption(tiny, tiny_hf):
    path, hf = tiny, tiny_hf
    llm = LLM(str(path), dtype="float32", check_integrity=True, block_size=8,
              num_gpu_blocks_override=14, max_model_len=96, max_num_batched_tokens=64)
    vocab = llm.engine.model_config.vocab_size
    prompts = rand_prompts(3, [40, 33, 25, 50, 9, 44], vocab)
    check(llm, hf, prompts, n=30)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
def test_block_sizes(tiny, tiny_hf, block_size):
    path, hf = tiny, tiny_hf
    llm = LLM(str(path), dtype="float32", check_integrity=True, block_size=block_size,
              kv_cache_memory=32 * 2**20)
    vocab = llm.engine.model_config.vocab_size
    check(llm, hf, rand_prompts(block_size, [1, block_size, block_size + 3, 300], vocab), n=6)


@pytest.mark.slow
def test_n_sequences_share_prompt_blocks_and_match_seeded_runs(tiny):
    path = tiny
    llm = LLM(str(path), dtype="float32", check_integrity=True, block_size=8, kv_cache_memory=32 * 2**20)
    prompt = rand_prompts(9, [45], llm.engine.model_config.vocab_size)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    eng = llm.engine
    eng.add_request("g", prompt, params)
    shared_seen = False
    while eng.has_unfinished_requests():
        eng.step()
        tables = [eng.kv.block_table(r) for r in (eng.scheduler.requests.get(f"g#{i}") for i in range(3)) if r]
        if len(tables) == 3 and all(len(t) >= 5 for t in tables):
            # 45 prompt tokens = 5 full blocks of 8: all three sequences hold the same 5 blocks.
            assert tables[0][:5] == tables[1][:5] == tables[2][:5]
            assert all(eng.kv.pool.blocks[b].ref_cnt == 3 for b in tables[0][:5])
            assert len({t[5] for t in tables if len(t) > 5}) == len([t for t in tables if len(t) > 5])
            shared_seen = True
    assert shared_seen
    together = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    singles = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10,
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
               for i in range(3)]
    assert [o.token_ids for o in together] == [o.token_ids for o in singles]
    assert len({tuple(o.token_ids) for o in together}) > 1  # sampling really happened


@pytest.mark.slow
def test_errors_name_the_problem(tiny, tmp_path):
    path = tiny
    from kvserve.config import ConfigError
    with pytest.raises(ConfigError, match=r"max seq len \(1024\) is larger than the maximum number of tokens.*\(64\)"):
        LLM(str(path), dtype="float32", max_model_len=1024, block_size=16, num_gpu_blocks_override=4)
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=8 * 2**20)
    with pytest.raises(RequestError, match="maximum context length is 64 tokens"):
        llm.generate([[1] * 80], greedy(GEN))
    # The engine keeps serving others after the rejection.
    out = llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # One bad prompt in a batch: the call fails as a whole, naming the prompt, and leaves nothing
    # queued (its good requests used to stay in the engine and break every later call).
    with pytest.raises(RequestError, match="prompt 1 of 3: .*maximum context length is 64"):
        llm.generate([[1, 2], [1] * 80, [3]], greedy(4), use_tqdm=False)
    with pytest.raises(RequestError, match="prompt 2 of 3: prompt token ids must be integers"):
        llm.generate([[1], [2], [-1]], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    again = llm.generate([[1, 2, 3], [4, 5]], greedy(4), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in again] == [4, 4]
    # vLLM's prompt dicts (TokensPrompt / TextPrompt) give the same tokens as the bare forms.
    as_dicts = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}], greedy(4),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in as_dicts] == [o.outputs[0].token_ids for o in again]
    assert as_dicts[0].prompt_token_ids == [1, 2, 3]
    single = llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(4), use_tqdm=False)
    assert single[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    with pytest.raises(RequestError, match=r"prompt 1 of 2: prompt dict keys \['multi_modal_data'\]"):
        llm.generate([[1], {"prompt_token_ids": [2], "multi_modal_data": {}}], greedy(4), use_tqdm=False)
    with pytest.raises(RequestError, match="exactly one of 'prompt'"):
        llm.generate({"prompt": "a", "prompt_token_ids": [1]}, greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # max_tokens past the context is capped there (finish reason "length"), as vLLM's engine does.
    long = llm.generate([[1] * 60], greedy(30), use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) == 4 and long.finish_reason == "length"
    bad = make_tiny_model(tmp_path / "bad", kind="llama_gqa")
    cfg = (bad / "config.json").read_text().replace("LlamaForCausalLM", "FalconForCausalLM")
    (bad / "config.json").write_text(cfg.replace('"llama"', '"falcon"'))
    from kvserve.model.loader import ModelLoadError
    with pytest.raises(ModelLoadError, match="FalconForCausalLM.*not supported"):
        LLM(str(bad), dtype="float32")


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers():
    llm = LLM(None, dtype="float32", max_model_len=1024, kv_cache_memory=256 * 2**20)
    hf = load_hf(None)
    prompts = rand_prompts(11, [1, 7, 64, 129, 300], 49152)
    prompts.append(llm.tokenizer.encode("The history of the printing press begins"))
    check(llm, hf, prompts, n=10)
    outs = llm.chat([{"role": "user", "content": "What is 2+2?"}], greedy(16))
    assert "4" in outs[0].outputs[0].text
