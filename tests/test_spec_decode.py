"""N-gram speculative decoding (sched/spec_decode.py): the proposer, --speculative-config, and
the engine's output with guesses equal to the output without them (and to transformers')."""
from __future__ import annotations

import random

import pytest
from hf_reference import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError, EngineArgs, SpeculativeConfig, parse_speculative_config
from kvserve.core.request import Request
from kvserve.sched.spec_decode import NgramProposer, speculation_allowed

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# -- --speculative-config ---------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == SpeculativeConfig("ngram", 2, 4, 4)
    assert parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 2}) == SpeculativeConfig("ngram", 2, 2, 2)


@pytest.mark.parametrize("value, needle", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle' is not implemented"),
    ('{"method": "ngram"}', "num_speculative_tokens, an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens, an integer >= 1"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must be <= prompt_lookup_max=2"),
    ('{"num_speculative_tokens": 2, "model": "x"}', "model not supported"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 0}', "prompt_lookup_max must be an integer >= 1"),
    ("ngram", "not valid JSON"),
    ("[4]", "must be a JSON object"),
])
def test_bad_config_is_refused_with_what_to_change(value, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineArgs(speculative_config=value).validate()


# -- the proposer -----------------------------------------------------------------------------------
def make_request(tokens: list[int]) -> Request:
    return Request("r", list(tokens), SamplingParams(temperature=0.0))


def reference_draft(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Brute force: the longest n in [lo, hi] whose last-n suffix occurs earlier (latest such
    occurrence), the k tokens after it, a loop shorter than k continued with its period."""
    end = len(tokens)
    for n in range(hi, lo - 1, -1):
        if end < n:
            continue
        for s in range(end - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[end - n:]:
                start = s + n
                draft = tokens[start:start + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (end - start)])
                return draft
    return []


def test_proposer_examples():
    p = NgramProposer(SpeculativeConfig("ngram", 4, 1, 3))
    assert p.propose(make_request([1, 2, 3, 4, 1, 2, 3]), 4) == [4, 1, 2, 3]
    assert p.propose(make_request([7, 8, 9]), 4) == []  # nothing repeats
    p.forget("r")
    assert p.propose(make_request([5, 5, 5]), 4) == [5, 5, 5, 5]  # a loop of one token, continued
    p.forget("r")
    assert p.propose(make_request([1, 2, 3, 4, 1, 2, 3]), 2) == [4, 1]  # max_tokens caps the guesses
    p.forget("r")
    assert p.propose(make_request([1, 2, 3]), 0) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 3),
       st.integers(0, 3), st.lists(st.integers(1, 5), max_size=8))
def test_proposer_matches_brute_force_as_the_history_grows(tokens, k, lo, extra, growth):
    """The incremental tables give the brute-force answer at every step of a growing history."""
    hi = lo + extra
    p = NgramProposer(SpeculativeConfig("ngram", k, lo, hi))
    req = make_request(tokens)
    rng = random.Random(len(tokens))
    assert p.propose(req, k) == reference_draft(req.all_token_ids, k, lo, hi)
    for g in growth:
        for _ in range(g):
            req.append_output_token(rng.randrange(4))
        assert p.propose(req, k) == reference_draft(req.all_token_ids, k, lo, hi)


def test_only_plain_greedy_requests_speculate():
    assert speculation_allowed(SamplingParams(temperature=0.0), 0)
    assert not speculation_allowed(SamplingParams(temperature=0.7), 0)
    assert not speculation_allowed(SamplingParams(temperature=0.0, logprobs=2), 0)
    assert not speculation_allowed(SamplingParams(temperature=0.0, stop=["\n"]), 0)
    assert not speculation_allowed(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0)
    assert not speculation_allowed(SamplingParams(temperature=0.0, min_tokens=5), 4)
    assert speculation_allowed(SamplingParams(temperature=0.0, min_tokens=5), 5)


# -- the engine -------------------------------------------------------------------------------------
def loop_prompts(vocab: int, seed: int, count: int) -> list[list[int]]:
    """Half repeat a short random phrase (guesses come true), half are random (they mostly fail)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            phrase = [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
            prompts.append((phrase * 40)[:rng.randint(20, 120)])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(5, 90))])
    return prompts


def test_greedy_output_with_guesses_equals_transformers(tiny, tiny_hf):
    path, hf = tiny, tiny_hf
    llm = LLM(str(path), dtype="float32", check_integrity=True, kv_cache_memory=64 * 2**20,
              speculative_config=NGRAM)
    prompts = loop_prompts(llm.engine.model_config.vocab_size, 0, 12)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)
    s = llm.engine.scheduler
    assert s.num_accepted_tokens > 0 and s.num_draft_tokens > s.num_accepted_tokens  # some kept, some not
    assert llm.engine.num_steps < 12 * 24  # fewer steps than one token per request per step
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_guesses_change_nothing_but_the_step_count(tiny):
    """Stop tokens inside a kept run of guesses, max_tokens limits, sampled and logprobs requests
    in the same batch, and prefix-cache hits on blocks written by guessed steps: all as without."""
    path = tiny
    vocab = None
    results = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        llm = LLM(str(path), dtype="float32", check_integrity=True, kv_cache_memory=64 * 2**20,
                  max_num_batched_tokens=64, speculative_config=spec)
        vocab = llm.engine.model_config.vocab_size
        prompts = loop_prompts(vocab, 1, 8)
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
        # a stop token the greedy output reaches mid-way (a token of its 11th output)
        stop_tok = plain[0].outputs[0].token_ids[10]
        mixed_params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]),
                        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                        SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
                        SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True)]
        mixed = llm.generate(prompts[:4], mixed_params, use_tqdm=False)
        again = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)  # prompts + outputs now in the prefix cache
        results[name] = ([o.outputs[0].token_ids for o in plain + mixed + again],
                         [o.outputs[0].finish_reason for o in mixed],
                         [o.outputs[0].text for o in plain],
                         [[sorted(lp) for lp in o.outputs[0].logprobs] for o in mixed[3:]])
        llm.engine.kv.check_integrity()
        assert llm.engine.kv.pool.num_used_blocks == 0
        if spec:
            assert llm.engine.scheduler.num_accepted_tokens > 0
    assert results["ngram"] == results["plain"]
    assert results["plain"][1][0] == "stop"
