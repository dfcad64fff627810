"""The offline API as a vLLM script uses it: LLM's arguments and methods, SamplingParams, and the
shape of RequestOutput / CompletionOutput (vllm/entrypoints/llm.py, vllm/outputs.py,
vllm/logprobs.py). Found by auditing kvserve with vLLM-style scripts."""
import json
import math

import numpy as np
import pytest
from helpers import greedy
from tiny_models import make_tiny_model

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.core.sampling_params import RequestOutputKind, SamplingParamsError
from kvserve.engine.outputs import Logprob, RequestError


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("offline"), kind="llama_gqa")


@pytest.fixture(scope="module")
def llm(path):
    # vLLM scripts pass these; each is accepted as a no-op or its harmless value
    return LLM(str(path), dtype=__import__("torch").float32, kv_cache_memory=2**24, max_model_len=256,
               trust_remote_code=True, enforce_eager=True, tensor_parallel_size=1, quantization=None,
               revision=None, disable_custom_all_reduce=True, generation_config="vllm")


def test_vllm_arguments_refused_with_the_reason(path):
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 is not supported: .*pipeline parallelism"):
        LLM(str(path), pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="--quantization must be one of gguf, none or unset \\(got 'awq'\\)"):
        LLM(str(path), quantization="awq")
    with pytest.raises(TypeError, match=r"unknown engine arguments \['no_such_thing'\]"):
        LLM(str(path), no_such_thing=1)
    with pytest.raises(TypeError, match="both kv_cache_memory and kv_cache_memory_bytes"):
        LLM(str(path), kv_cache_memory=2**24, kv_cache_memory_bytes=2**24)


@pytest.mark.slow
def test_vllm_launch_arguments_map_or_are_accepted(path):
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=2**22, max_model_len=64, download_dir="/models",
              compilation_config={"level": 3}, optimization_level=3)
    assert llm.llm_engine.args.kv_cache_memory == 2**22
    assert llm.generate([{"prompt_token_ids": [1, 2, 3]}])[0].outputs[0].token_ids


def test_logprobs_have_vllms_shape(llm):
    out = llm.generate([[5, 6, 7]], greedy(6, logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs is None and out.finished
    o = out.outputs[0]
    assert o.finished() and len(o.logprobs) == len(o.token_ids) == 6
    for tok, entry in zip(o.token_ids, o.logprobs):
        assert tok in entry and all(isinstance(v, Logprob) for v in entry.values())
        ranks = sorted(v.rank for t, v in entry.items() if t != tok or v.rank <= 3)
        assert ranks[:3] == [1, 2, 3]  # the top 3, the sampled one among them (greedy: rank 1)
        assert entry[tok].rank == 1 and entry[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
        assert all(v.logprob <= 0 for v in entry.values())
    assert math.isclose(o.cumulative_logprob, sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))
    plain = llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    sampled = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, seed=1, logprobs=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert all(list(e) == [t] and e[t].rank >= 1 for t, e in zip(sampled.token_ids, sampled.logprobs))


def test_a_stop_token_leaves_no_text(llm):
    base = llm.generate([[5, 6, 7]], greedy(12), use_tqdm=False)[0].outputs[0]
    ids = base.token_ids
    i = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and llm.tokenizer.decode([ids[i]], skip_special_tokens=True))
    out = llm.generate([[5, 6, 7]], greedy(12, stop_token_ids=[ids[i]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:i + 1] and out.finish_reason == "stop" and out.stop_reason == ids[i]
    assert out.text == llm.tokenizer.decode(ids[:i], skip_special_tokens=True)  # vLLM: the stop token's text is not output
    kept = llm.generate([[5, 6, 7]], greedy(12, stop_token_ids=[ids[i]], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(ids[:i + 1], skip_special_tokens=True)


def test_min_tokens_holds_back_stop_strings(llm):
    base = llm.generate([[5, 6, 7]], greedy(12), use_tqdm=False)[0].outputs[0]
    first = llm.tokenizer.decode(base.token_ids[:1], skip_special_tokens=True)
    assert first
    stopped = llm.generate([[5, 6, 7]], greedy(12, stop=[first]), use_tqdm=False)[0].outputs[0]
    assert len(stopped.token_ids) == 1 and stopped.text == ""
    held = llm.generate([[5, 6, 7]], greedy(12, stop=[first], min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) > 3 and held.text.startswith(first)


def test_the_tokenizer_argument_is_used(path, tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok_dir / name).write_bytes((path / name).read_bytes())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    import shutil
    model = shutil.copytree(path, tmp_path / "m")
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    llm = LLM(str(model), tokenizer=str(tok_dir), dtype="float", kv_cache_memory=2**22, max_model_len=128)
    assert llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    assert 7 in llm.get_tokenizer().eos_token_ids  # the model's stop ids hold with another tokenizer
    assert llm.llm_engine is llm.engine
    tok = llm.get_tokenizer()  # transformers' calls scripts make on it
    ids = tok("Hello world")["input_ids"]
    assert tok("Hello world").input_ids == ids and tok(["a", "b"]).input_ids == [tok.encode("a"), tok.encode("b")]
    assert tok.batch_decode([ids]) == [tok.decode(ids)] == ["Hello world"]
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.get_vocab()["<|im_end|>"]
    assert tok.convert_tokens_to_ids(["<|im_end|>"]) == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert len(tok) == tok.vocab_size


def test_chat_takes_vllms_keywords(llm):
    conv = [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Hello"}]
    out = llm.chat(conv, greedy(3), use_tqdm=False, add_generation_prompt=False, continue_final_message=True,
                   chat_template_kwargs={"enable_thinking": False}, lora_request=None)[0]
    expected = llm.tokenizer.apply_chat_template(conv, continue_final_message=True)
    assert out.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected).endswith("Hello")
    with pytest.raises(ValueError, match="custom chat templates are not implemented"):
        llm.chat(conv, chat_template="{{ messages }}")


def test_user_mistakes_name_the_problem(llm):
    with pytest.raises(TypeError, match="prompts must be .* got int"):
        llm.generate(5)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams .* got dict"):
        llm.generate("x", {"max_tokens": 3})
    with pytest.raises(ValueError, match="scheduling policy is fcfs"):
        llm.generate(["a", "b"], greedy(2), priority=[5, -3], use_tqdm=False)
    with pytest.raises(RequestError, match="prompt_token_ids is a string"):
        llm.generate({"prompt_token_ids": llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False)}, use_tqdm=False)
    with pytest.raises(RequestError, match="lora_request must be a kvserve.LoRARequest, got object"):
        llm.generate("x", lora_request=object())
    # Refused when constructed, as vLLM does
    with pytest.raises(SamplingParamsError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(SamplingParamsError, match="stop_token_ids must be a list of non-negative integer"):
        SamplingParams(stop_token_ids=["13003"])
    for kwargs, message in ((dict(best_of=3), "best_of is not supported by kvserve"),
                            (dict(prompt_logprobs=-1), r"prompt_logprobs must be in \[0, "),
                            (dict(logit_bias={5: 2.0}), "logit_bias is not supported"),
                            (dict(structured_outputs={"json": {}}), "structured output is not implemented"),
                            (dict(detokenize=False), "detokenize=False is not supported")):
        with pytest.raises(SamplingParamsError, match=message):
            SamplingParams(**kwargs)
    two = llm.generate([[5, 6, 7]], SamplingParams(n=2, best_of=2, max_tokens=3, seed=0), use_tqdm=False)[0]
    assert len(two.outputs) == 2  # best_of equal to n is vLLM V1's only accepted value
    assert not llm.engine.has_unfinished_requests()
    # numpy integers are token ids, in prompts and stop_token_ids
    arr = np.array([5, 6, 7])
    a = llm.generate([list(arr)], greedy(4, stop_token_ids=[np.int64(0)]), use_tqdm=False)[0].outputs[0]
    assert a.token_ids == llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
def test_seed_none_and_default_sampling_params(path):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, max_model_len=128, seed=None)
    assert isinstance(llm.engine.args.seed, int)
    assert llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate("Hello", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 16  # vLLM's default max_tokens


@pytest.mark.slow
def test_generation_config_defaults_as_vllm(path, tmp_path):
    import shutil
    d = shutil.copytree(path, tmp_path / "m")
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1, "max_new_tokens": 4, "temperature": 0.6}))
    llm = LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=4, temperature=0.6)
    runs = [llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert len(runs[0]) <= 4 and runs[0] == runs[1]  # top_k=1: greedy whatever the temperature
    off = LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128, generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams()
    other = tmp_path / "gen"  # vLLM's --generation-config DIR: that folder's file instead of the model's
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    folder = LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128, generation_config=str(other))
    assert folder.get_default_sampling_params() == SamplingParams(temperature=0.3)
    # vLLM's override_generation_config: generation_config.json keys merged over the chosen config
    over = LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128,
               override_generation_config={"temperature": 0.9, "max_new_tokens": 8})
    assert over.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=8, temperature=0.9)
    only = LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128, generation_config="vllm",
               override_generation_config={"top_p": 0.5})
    assert only.get_default_sampling_params() == SamplingParams(top_p=0.5)
    dropped = LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128,
                  override_generation_config={"top_k": None})  # null drops the model's value, as vLLM's update
    assert dropped.get_default_sampling_params() == SamplingParams(max_tokens=4, temperature=0.6)
    with pytest.raises(ConfigError, match=r"--override-generation-config \{'top_p': 0\}: top_p .*fix the value"):
        LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128, override_generation_config={"top_p": 0})
    (d / "generation_config.json").write_text(json.dumps({**gen, "top_p": 0.0}))
    with pytest.raises(ConfigError, match="generation_config.json gives sampling defaults .*top_p"):
        LLM(str(d), dtype="float32", kv_cache_memory=2**22, max_model_len=128)


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(path):
    """vLLM's prompt_logprobs: None, then each prompt token's logprob given the tokens before it
    (with the top-k), as transformers computes it; over several prefill chunks, and the same on a
    second run although the prompt's blocks are then in the prefix cache."""
    import torch
    from hf_reference import load_hf
    hf = load_hf(path)
    prompt = [(7 * i + 3) % 1000 + 20 for i in range(70)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, max_model_len=256, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for run in range(2):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for pos in range(1, len(prompt)):
            entry, tok = lps[pos], prompt[pos]
            assert abs(entry[tok].logprob - ref[pos - 1, tok].item()) < 1e-4, (run, pos)
            assert entry[tok].rank == int((ref[pos - 1] >= ref[pos - 1, tok] - 1e-9).sum())
            assert set(ref[pos - 1].topk(3).indices.tolist()) <= set(entry)  # the top 3 alternatives
    assert llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None
    assert out.num_cached_tokens == 0  # scoring the prompt reads nothing from the cache


@pytest.mark.slow
def test_final_only_outputs_come_once_and_match_the_cumulative_ones(llm):
    """vLLM's RequestOutputKind: FINAL_ONLY requests yield one output, when they finish, equal to
    the last CUMULATIVE one, and DELTA outputs add up to it (with stop strings and n > 1 too);
    LLM.generate asks for FINAL_ONLY without touching the caller's SamplingParams."""
    engine = llm.engine
    stop = llm.tokenizer.decode(llm.generate([[5, 6, 7]], greedy(12), use_tqdm=False)[0].outputs[0].token_ids[3:5])
    kinds = {"c": RequestOutputKind.CUMULATIVE, "f": RequestOutputKind.FINAL_ONLY, "d": RequestOutputKind.DELTA}
    for extra in ({}, {"stop": [stop]}, {"n": 2, "temperature": 1.0, "seed": 3}):
        seen = {k: [] for k in kinds}
        for k, kind in kinds.items():
            engine.add_request(k, [5, 6, 7], SamplingParams(**{**dict(temperature=0.0, max_tokens=12, ignore_eos=True),
                                                               **extra, "output_kind": kind}))
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
        assert len(seen["c"]) > 1 and len(seen["f"]) == 1 and seen["f"][0].finished
        last, final = seen["c"][-1], seen["f"][0]
        assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in final.outputs] == \
               [(o.index, o.text, o.token_ids, o.finish_reason) for o in last.outputs]
        assert final.outputs[0].delta_token_ids == final.outputs[0].token_ids  # nothing was taken before
        for o in last.outputs:  # DELTA: the pieces add up to the cumulative output
            pieces = [p for out in seen["d"] for p in out.outputs if p.index == o.index]
            assert sum((p.token_ids for p in pieces), []) == o.token_ids
            assert "".join(p.text for p in pieces) == o.text and pieces[-1].finish_reason == o.finish_reason
    params = greedy(4)
    assert llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)[1].finished
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(SamplingParamsError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="final")


def test_stream_interval_gathers_tokens_into_fewer_outputs(tiny):
    """vLLM's --stream-interval N: a streamed request's outputs come every N tokens, its first token
    and its end at once; the tokens are the same."""
    from kvserve.config import EngineArgs
    from kvserve.engine.engine import LLMEngine

    def outputs(interval: int) -> list[list[int]]:
        engine = LLMEngine(EngineArgs(model=tiny, dtype="float32", stream_interval=interval, kv_cache_memory=2**24))
        engine.add_request("r", [1, 2, 3, 4], greedy(10))
        got = []
        while engine.has_unfinished_requests():
            got += [o.outputs[0].delta_token_ids for o in engine.step() if o.request_id == "r"]
        return got

    every, gathered = outputs(1), outputs(4)
    assert [len(d) for d in every] == [1] * 10
    assert [len(d) for d in gathered] == [1, 4, 4, 1] and sum(gathered, []) == sum(every, [])
