"""LoRA adapters: greedy tokens equal transformers + PEFT (float32) for each adapter in batches
that mix adapters and the base model, through prefix hits, chunked prefill, preemption and slot
swaps; the prefix cache never serves one adapter's blocks to another, nor an old adapter's to a
new one reloaded under the same name; every bad adapter is refused with the reason."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import greedy, rand_prompts
from hf_reference import hf_greedy, load_hf
from lora_adapters import make_adapter, peft_reference

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.engine.outputs import RequestError

GEN = 10


@pytest.fixture(scope="module")
def hf(tiny):
    return load_hf(tiny)  # its own copy: PEFT wraps its modules for a while


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(hf, d / "a", r=8, alpha=16, seed=1),
            "b": make_adapter(hf, d / "b", r=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "down_proj"),
                              rslora=True),
            "c": make_adapter(hf, d / "c", r=6, alpha=6, seed=3, targets=("k_proj", "o_proj", "gate_proj", "up_proj"))}


def lora(name: str | None, adapters: dict[str, str]) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, "abc".index(name) + 1, adapters[name])


def reference(hf, adapters, prompts, names, n=GEN):
    with peft_reference(hf, adapters) as select:
        return [hf_greedy(select(name), p, n) for p, name in zip(prompts, names)]


def test_mixed_batch_equals_peft_through_prefix_hits_chunks_preemption_and_swaps(tiny, hf, adapters):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
              check_integrity=True, block_size=16, max_num_batched_tokens=48, num_gpu_blocks_override=14,
              max_model_len=200)
    vocab = llm.engine.model_config.vocab_size
    shared = rand_prompts(7, [40], vocab)[0]
    prompts = [shared + [1, 2], shared + [3], *rand_prompts(8, [70, 9, 33, 51], vocab), shared + [4, 5], shared]
    names = ["a", "a", "b", None, "c", "b", "c", None]
    seen = []
    step = llm.engine.runner.lora.step

    def watch(scheduled, *args):
        seen.append({s.request.lora_id for s in scheduled if s.request.lora_id})
        return step(scheduled, *args)
    llm.engine.runner.lora.step = watch
    outs = llm.generate(prompts, greedy(GEN), lora_request=[lora(n, adapters) for n in names], use_tqdm=False)
    expect = reference(hf, adapters, prompts, names)
    assert [o.outputs[0].token_ids for o in outs] == expect
    assert max(map(len, seen)) <= 2  # never more adapters in a step than --max-loras
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.lora.num_slot_loads >= 3  # three adapters through two slots
    assert llm.engine.kv.pool.num_used_blocks == 0
    # each adapter alone gives what it gave in the mix
    for name in "abc":
        idx = [i for i, n in enumerate(names) if n == name]
        alone = llm.generate([prompts[i] for i in idx], greedy(GEN), lora_request=lora(name, adapters),
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in alone] == [expect[i] for i in idx]
    assert not llm.engine.runner.lora.pins  # every request let go of its adapter


def test_prefix_cache_shared_within_an_adapter_never_across(tiny, hf, adapters):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=16,
              kv_cache_memory=32 * 2**20)
    prompt = rand_prompts(11, [50], llm.engine.model_config.vocab_size)[0]
    first = llm.generate(prompt, greedy(GEN), lora_request=lora("a", adapters), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate(prompt, greedy(GEN), lora_request=lora("a", adapters), use_tqdm=False)[0]
    assert again.num_cached_tokens == 49 and again.outputs[0].token_ids == first.outputs[0].token_ids
    others = llm.generate([prompt, prompt], greedy(GEN), lora_request=[lora("b", adapters), None], use_tqdm=False)
    assert [o.num_cached_tokens for o in others] == [0, 0]
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in others] == \
        reference(hf, adapters, [prompt] * 3, ["a", "b", None])


def test_adapter_replaced_under_the_same_name_never_hits_the_old_blocks(tiny, hf, adapters, tmp_path):
    x = tmp_path / "x"
    shutil.copytree(adapters["a"], x)
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=16, kv_cache_memory=32 * 2**20)
    prompt = rand_prompts(12, [40], llm.engine.model_config.vocab_size)[0]
    req = LoRARequest("x", 1, str(x))
    old = llm.generate(prompt, greedy(GEN), lora_request=req, use_tqdm=False)[0]
    shutil.rmtree(x)
    shutil.copytree(adapters["b"], x)  # same name, same id, same path: other weights
    new = llm.generate(prompt, greedy(GEN), lora_request=req, use_tqdm=False)[0]
    assert new.num_cached_tokens == 0
    assert [old.outputs[0].token_ids, new.outputs[0].token_ids] == reference(hf, adapters, [prompt] * 2, ["a", "b"])
    assert llm.generate(prompt, greedy(GEN), lora_request=req, use_tqdm=False)[0].num_cached_tokens == 39


def test_adapter_blocks_on_the_disk_tier_serve_a_restart_only_with_the_same_files(tiny, hf, adapters, tmp_path):
    """The disk tier's blocks are keyed by the adapter's digest: a restarted engine with the same
    adapter files hits them; with other files under the same name and path, none."""
    x = tmp_path / "x"
    shutil.copytree(adapters["a"], x)
    opts = dict(dtype="float32", enable_lora=True, max_lora_rank=8, block_size=16, kv_cache_memory=32 * 2**20,
                kv_disk_path=str(tmp_path / "kv"))
    req = LoRARequest("x", 1, str(x))

    def once():
        llm = LLM(tiny, **opts)
        try:
            return llm.generate(prompt, greedy(GEN), lora_request=req, use_tqdm=False)[0]
        finally:
            llm.engine.close()  # writes the pool's blocks down to the disk tier
    prompt = rand_prompts(15, [40], 1000)[0]
    old = once()
    assert old.num_cached_tokens == 0
    again = once()
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == old.outputs[0].token_ids  # its 2 whole blocks
    shutil.rmtree(x)
    shutil.copytree(adapters["b"], x)  # same name, id and path: other weights
    new = once()
    assert new.num_cached_tokens == 0
    assert [old.outputs[0].token_ids, new.outputs[0].token_ids] == reference(hf, adapters, [prompt] * 2, ["a", "b"])


def test_zero_adapter_reproduces_the_base_model_bit_for_bit_in_bfloat16(tiny_d64, tmp_path):
    """bf16 on the compiled kernels: a LoRA step takes the Python loop with the projections'
    epilogues run apart (Linear.plain); with an adapter of zeros it must give the base tokens."""
    zero = make_adapter(load_hf(tiny_d64), tmp_path / "zero", r=4, magnitude=0.0)
    llm = LLM(tiny_d64, dtype="bfloat16", enable_lora=True, max_lora_rank=4, kv_cache_memory=32 * 2**20)
    prompts = rand_prompts(13, [30, 7, 64], llm.engine.model_config.vocab_size)
    base = llm.generate(prompts, greedy(GEN), use_tqdm=False)
    llm.reset_prefix_cache()
    zeros = llm.generate(prompts, greedy(GEN), lora_request=LoRARequest("zero", 1, zero), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in zeros] == [o.outputs[0].token_ids for o in base]


def test_compiled_layer_loop_adds_the_deltas_as_close_to_float32_as_the_python_loop(tiny_d64, tmp_path):
    """bf16 with packed slots: a LoRA step stays in the compiled layer loop, which adds each
    delta inside its projection (before rounding, where the Python loop adds a rounded delta to
    a rounded output), through mixed batches, prefill chunks, the last layer's kept rows and slot
    swaps. Its log-probs are as close to float32's as the Python loop's; base rows are unchanged."""
    hf = load_hf(tiny_d64)
    paths = {"a": make_adapter(hf, tmp_path / "a", r=8, seed=41, magnitude=2.0),
             "b": make_adapter(hf, tmp_path / "b", r=3, seed=42, magnitude=2.0, targets=("q_proj", "v_proj", "up_proj")),
             "c": make_adapter(hf, tmp_path / "c", r=16, seed=43, magnitude=2.0, targets=("k_proj", "o_proj", "down_proj"))}
    names = ["a", None, "b", "c", "a", "b"]
    reqs = [None if n is None else LoRARequest(n, "abc".index(n) + 1, paths[n]) for n in names]
    prompts = rand_prompts(14, [30, 7, 64, 45, 12, 80], 1000)
    opts = dict(enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory=32 * 2**20, max_num_batched_tokens=64,
                block_size=16, enable_prefix_caching=False)

    def run(llm):  # every prompt row's log-prob, and the first output token's top 5 (only kept rows)
        scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                              lora_request=reqs, use_tqdm=False)
        first = llm.generate(prompts, SamplingParams(max_tokens=1, logprobs=5, temperature=0), lora_request=reqs,
                             use_tqdm=False)
        return ([np.array([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in scored],
                [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in first])

    ref_rows, ref_first = run(LLM(tiny_d64, dtype="float32", **opts))
    llm = LLM(tiny_d64, dtype="bfloat16", **opts)
    model = llm.engine.runner.model
    decoder = model.compiled_decoder(llm.engine.runner.kv_cache)
    assert llm.engine.runner.lora.slots.packed and decoder is not None and decoder.takes_lora
    calls = []
    forward = decoder.forward

    def spy(*args, **kw):
        calls.append(args[8] if len(args) > 8 else kw.get("lora"))
        return forward(*args, **kw)
    decoder.forward = spy
    compiled_rows, compiled_first = run(llm)
    assert any(c is not None for c in calls)  # adapter steps ran in the compiled loop
    model.use_compiled_decoder = False
    python_rows, python_first = run(llm)
    for name, ref, comp, py in zip(names, ref_rows, compiled_rows, python_rows):
        err_compiled, err_python = np.abs(comp - ref).mean(), np.abs(py - ref).mean()
        if name is None:
            assert (comp == py).all()
        assert err_compiled <= 1.5 * err_python + 0.01, (name, err_compiled, err_python)
    def first_err(got):  # float32's first token: its log-prob's error (1 where not in the top 5)
        return np.mean([abs(g[t] - r[t]) if (t := max(r, key=r.get)) in g else 1.0 for r, g in zip(ref_first, got)])
    assert first_err(compiled_first) <= 1.5 * first_err(python_first) + 0.02


def _bad(tmp_path, source: str, edit) -> str:
    d = tmp_path / "bad"
    shutil.copytree(source, d)
    edit(d)
    return str(d)


def test_bad_adapters_are_refused_with_the_reason_and_the_engine_keeps_serving(tiny, hf, adapters, tmp_path):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=4, kv_cache_memory=32 * 2**20)

    def refused(path, match, name="bad"):
        with pytest.raises(RequestError, match=match) as e:
            llm.generate([1, 2, 3], greedy(2), lora_request=LoRARequest(name, 9, str(path)), use_tqdm=False)
        assert e.value.param == "lora_request"

    refused(adapters["a"], r"rank 8 .* above --max-lora-rank 4", "a")
    refused(tmp_path / "nowhere", "is not a directory")
    refused(_bad(tmp_path / "1", adapters["b"], lambda d: (d / "adapter_model.safetensors").unlink()),
            "adapter_model.safetensors is missing")
    refused(_bad(tmp_path / "2", adapters["b"], lambda d: (d / "adapter_model.safetensors").write_bytes(b"junk")),
            "not a readable safetensors file")
    from tiny_models import make_tiny_model
    wide = make_tiny_model(tmp_path / "wide", kind="llama_mha")  # hidden 96 instead of 64
    refused(make_adapter(load_hf(wide), tmp_path / "wide_adapter", r=2), r"layers\.0\.q_proj: .*\[2, 96\].*"
            r"base model's q_proj is \[64, 64\]")
    from peft import LoraConfig, get_peft_model
    emb = get_peft_model(load_hf(tiny), LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    emb.save_pretrained(str(tmp_path / "emb"))
    refused(tmp_path / "emb", "target module 'model.embed_tokens' is not supported")

    def dora(d):
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    refused(_bad(tmp_path / "3", adapters["b"], dora), "DoRA is not supported")
    # and everything else still runs
    ok = llm.generate([1, 2, 3], greedy(GEN), lora_request=lora("b", adapters), use_tqdm=False)[0]
    assert ok.outputs[0].token_ids == reference(hf, adapters, [[1, 2, 3]], ["b"])[0]
    plain = LLM(tiny, dtype="float32", kv_cache_memory=16 * 2**20)
    with pytest.raises(RequestError, match="LoRA is not enabled.*enable_lora=True"):
        plain.generate([1, 2], greedy(2), lora_request=lora("b", adapters), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 lora requests"):
        llm.generate([[1], [2]], greedy(2), lora_request=[lora("b", adapters)], use_tqdm=False)


def test_lora_request_fields_are_vllms():
    r = LoRARequest("sql", 1, "/adapters/sql")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("sql", 1, "/adapters/sql")
    for bad in (dict(lora_name="", lora_int_id=1, lora_path="/p"), dict(lora_name="x", lora_int_id=0, lora_path="/p")):
        with pytest.raises(ValueError):
            LoRARequest(**bad)


def test_slot_memory_is_charged_before_the_kv_cache(tiny):
    base = LLM(tiny, dtype="float32", kv_cache_memory=8 * 2**20).engine
    with_lora = LLM(tiny, dtype="float32", kv_cache_memory=8 * 2**20, enable_lora=True, max_loras=4,
                    max_lora_rank=64).engine
    charged = with_lora.setup.budget.lora_bytes
    assert charged == with_lora.runner.lora.slots.nbytes > 0
    assert with_lora.setup.num_blocks == (8 * 2**20 - charged) // base.setup.budget.bytes_per_block
    assert with_lora.setup.num_blocks < base.setup.num_blocks


@pytest.mark.slow
def test_smollm2_adapters_mixed_with_the_base_model_equal_peft(smollm2_hf, tmp_path):
    """The embedded SmolLM2 (float32) with two random adapters and the base model in one batch."""
    paths = {"x": make_adapter(smollm2_hf, tmp_path / "x", r=8, seed=31, magnitude=0.5),
             "y": make_adapter(smollm2_hf, tmp_path / "y", r=16, seed=32, rslora=True, magnitude=0.5,
                               targets=("q_proj", "v_proj", "gate_proj", "down_proj"))}
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory=128 * 2**20,
              max_model_len=512)
    prompts = [llm.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                                  "Once upon a time")]
    names = ["x", "y", None]
    reqs = [None if n is None else LoRARequest(n, i + 1, paths[n]) for i, n in enumerate(names)]
    outs = llm.generate(prompts, greedy(6), lora_request=reqs, use_tqdm=False)
    with peft_reference(smollm2_hf, paths) as select:
        expect = [hf_greedy(select(n), p, 6) for p, n in zip(prompts, names)]
        base = [hf_greedy(select(None), p, 6) for p in prompts[:2]]
    assert [o.outputs[0].token_ids for o in outs] == expect
    assert expect[:2] != base  # the adapters change the output


@pytest.mark.needs("cuda")
def test_mixed_adapters_on_cuda_equal_peft(tiny, hf, adapters):
    """CUDA runs the torch slots and per-segment GEMMs (no Triton kernel yet): a mixed batch's
    float32 tokens equal PEFT's."""
    llm = LLM(tiny, dtype="float32", device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory=32 * 2**20, block_size=16)
    prompts = rand_prompts(16, [20, 33, 9], llm.engine.model_config.vocab_size)
    names = ["a", None, "b"]
    outs = llm.generate(prompts, greedy(GEN), lora_request=[lora(n, adapters) for n in names], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(hf, adapters, prompts, names)


def test_an_adapter_request_with_h2o_stays_in_the_compiled_layer_loop(tiny_d64, tmp_path):
    """Both extras of the compiled layer loop in one step: an adapter's deltas inside its
    projections and h2o's per-block scores after attention. The step is one compiled call, its
    scores agree with the Python loop's, and the base neighbour's tokens are unchanged."""
    hf = load_hf(tiny_d64)
    req = LoRARequest("a", 1, make_adapter(hf, tmp_path / "a", r=8, seed=41, magnitude=2.0))
    prompts = rand_prompts(15, [150, 70], 1000)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             kv_compression={"method": "h2o", "heavy_tokens": 32, "window": 32}),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    runs = []
    for compiled in (True, False):
        llm = LLM(tiny_d64, dtype="bfloat16", enable_lora=True, max_loras=1, max_lora_rank=16, block_size=16,
                  kv_cache_memory=32 * 2**20, max_num_batched_tokens=64, enable_prefix_caching=False)
        eng, model = llm.engine, llm.engine.runner.model
        model.use_compiled_decoder = compiled
        both = []
        if compiled:
            decoder = model.compiled_decoder(eng.runner.kv_cache)
            forward = decoder.forward

            def spy(*args, **kw):
                both.append(bool(args[6]) and args[8] is not None)
                return forward(*args, **kw)
            decoder.forward = spy
            model.attn.score_blocks = lambda *a: (_ for _ in ()).throw(AssertionError("scores left the loop"))
        seen = []
        add = eng.kv.add_scores
        eng.kv.add_scores = lambda r, sc: (seen.append(sc), add(r, sc))
        outs = llm.generate(prompts, params, lora_request=[req, None], use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], seen))
        if compiled:
            assert any(both)  # one compiled call carried the adapter and the scored rows
    (tok_c, scores_c), (tok_p, scores_p) = runs
    assert tok_c[1] == tok_p[1] and len(scores_c) == len(scores_p) > 10
    for k, (a, b) in enumerate(zip(scores_c, scores_p)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.sum() == pytest.approx(b.sum(), rel=1e-3)  # the same mass: rows x heads x layers
        if k < 3:  # the prompt's chunks (later tokens may differ: the loops round the deltas apart)
            assert np.corrcoef(a, b)[0, 1] > 0.95, k
