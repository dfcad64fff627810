"""The official `openai` client against the real server: completions, chat, streaming, n, logprobs,
cached_tokens from the prefix cache."""
from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from server_util import MAIN_ARGS, shared_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *MAIN_ARGS)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_lists_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_stream_equals_non_stream(client):
    # ignore_eos: exactly max_tokens, whatever the model would say (an EOS cannot end it early)
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # greedy: streaming changes the transport, not the tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Name a fruit."}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    stream = list(client.chat.completions.create(**kw, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content
    assert stream[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n2_gives_two_indexed_choices(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 12  # both sequences' tokens are counted
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          n=2, seed=5)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_streamed_n2_sends_one_finish_per_choice(client):
    """A choice that stopped early used to repeat its finish chunk on every later step of its sibling."""
    kw = dict(model=MODEL, max_tokens=20, n=2, temperature=1.0, seed=11, stream=True)
    for chunks in (client.completions.create(prompt="List some fruits:", stop=[","], **kw),
                   client.chat.completions.create(messages=[{"role": "user", "content": "List fruits, comma separated"}],
                                                  stop=[","], **kw)):
        finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
        assert sorted(finishes) == [0, 1], finishes


def test_truncate_prompt_tokens_and_continue_final_message(client, server):
    r = client.completions.create(model=MODEL, prompt="one two three four five six seven", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    messages = [{"role": "user", "content": "Name a color"}, {"role": "assistant", "content": "The color is"}]
    cont = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "continue_final_message": True,
                                                       "add_generation_prompt": False, "return_token_strs": True}).json()
    closed = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    # vocabulary pieces (Ġ: a leading space), and no end-of-turn after the last message
    assert "".join(cont["token_strs"]).replace("\u0120", " ").endswith("The color is")
    assert cont["tokens"] == closed["tokens"][:cont["count"]] and closed["count"] > cont["count"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert chat.usage.prompt_tokens == cont["count"] and chat.choices[0].message.content


def test_cors_as_vllm_by_default(server):
    r = httpx.options(f"{server.url}/v1/models", headers={"Origin": "http://localhost:3000",
                                                           "Access-Control-Request-Method": "GET"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_seeded_n2_matches_two_seeded_single_runs(client):
    """Sequence i of a seeded n-request samples with seed + i (vLLM's contract, the engine's too):
    n=2 with seed s gives the texts of n=1 with seed s and n=1 with seed s + 1."""
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})
    both = client.completions.create(**kw, n=2, seed=11)
    first = client.completions.create(**kw, n=1, seed=11)
    second = client.completions.create(**kw, n=1, seed=12)
    texts = [c.text for c in sorted(both.choices, key=lambda c: c.index)]
    assert texts == [first.choices[0].text, second.choices[0].text]
    assert texts[0] != texts[1]  # seeds 11 and 12 sample differently here: the comparison means something


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the top token
    # logprobs=0: the sampled token alone in top_logprobs, as vLLM's completions send it
    r0 = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=2, temperature=0, logprobs=0)
    lp0 = r0.choices[0].logprobs
    assert [list(t) for t in lp0.top_logprobs] == [[tok] for tok in lp0.tokens]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_cached_tokens_on_shared_system_prompt(client):
    system = f"[{uuid.uuid4()}] You are a support assistant for a bicycle shop. " + \
        "Answer questions about gears, brakes, tyres, chains and saddles politely and briefly. " * 12
    usages = []
    for question in ("How do I fix a flat tyre?", "How often should I oil the chain?"):
        r = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        usages.append(r.usage)
    assert usages[0].prompt_tokens > 200
    # A fresh uuid: only the chat template's fixed header ("<|im_start|>system\n") can hit, as the
    # engine also reuses partial blocks.
    assert usages[0].prompt_tokens_details.cached_tokens <= 4
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 160 and cached < usages[1].prompt_tokens  # the shared system prompt, not the question


def test_token_id_prompts_and_batches(client, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["Hello there", "The sky is"], max_tokens=3,
                                      temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text[:len(batch.choices[0].text)]


def test_stop_string_and_vllm_extras(client):
    kw = dict(model=MODEL, prompt="a b c d e f g h", max_tokens=20, temperature=0)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "min_tokens": 3, "top_k": 1,
                                                    "repetition_penalty": 1.0, "priority": 0})
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"  # ignore_eos: max_tokens
    full = r.choices[0].text
    # A stop string taken from the middle of the greedy text: the same greedy run stops at its first
    # occurrence, which is left out of the text (include_stop_str_in_output keeps it).
    middle = full[len(full) // 2:].split()
    assert middle, full
    stop = middle[0]
    cut = full.index(stop)
    assert cut > 0, (stop, full)
    s = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == full[:cut], (stop, full)
    assert s.choices[0].model_extra["stop_reason"] == stop  # vLLM's field: which stop string matched
    assert s.usage.completion_tokens < 20
    kept = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True,
                                                                     "include_stop_str_in_output": True})
    assert kept.choices[0].finish_reason == "stop" and kept.choices[0].text == full[:cut + len(stop)]


def test_echo_sends_the_prompt_back_as_sent(client, server):
    prompt = "<|im_start|>user\nHi"  # special tokens included, as vLLM echoes them
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    # raw stream chunks carry every key, null ones too, and one `created` (vLLM's stream)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert all("finish_reason" in c["choices"][0] and "logprobs" in c["choices"][0] for c in chunks)
    assert len({c["created"] for c in chunks}) == 1
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()
    assert detok["prompt"] == prompt  # special tokens kept, as transformers' decode and vLLM


def test_echo_with_logprobs_scores_the_prompt(client):
    """lm-eval's log-likelihood request: echo + logprobs returns the prompt's tokens with their
    logprobs (None for the first) before the output's, streamed or not."""
    kw = dict(model=MODEL, prompt="The capital of France is Paris", max_tokens=1, temperature=0, echo=True,
              logprobs=1)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(kw["prompt"])
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    slp = [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert slp[0] is None and slp[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, server):
    """OpenAI's and vLLM's echo-only request: the prompt, with its logprobs when asked, and nothing
    generated after it, streamed or not."""
    kw = dict(model=MODEL, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=0)
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text == kw["prompt"] and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens and "".join(c.logprobs.tokens) == kw["prompt"]
    assert c.logprobs.token_logprobs[0] is None and all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    streamed = [ch for ch in client.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in streamed) == kw["prompt"]
    assert [v for ch in streamed for v in ch.choices[0].logprobs.token_logprobs] == \
        pytest.approx(c.logprobs.token_logprobs, abs=1e-5)


def test_prompt_logprobs_request_field(server):
    """vLLM's prompt_logprobs extra field: completions give them per choice, chat on the response,
    as [None, {token id: {logprob, rank, decoded_token}}, ...] with the prompt token and the top k;
    they agree with echo + logprobs on the same prompt."""
    prompt = "The capital of France is Paris"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and 2 <= len(entry) <= 3  # the prompt token plus the top 2
        assert {1, 2} <= {e["rank"] for e in entry.values()}  # the top 2, whether or not they hold the prompt token
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())
    assert r["choices"][0]["text"] and not r["choices"][0]["text"].startswith(prompt)  # no echo asked
    echoed = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": None, "echo": True,
                                                              "logprobs": 0}, timeout=60).json()
    ref = echoed["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])] == pytest.approx(ref, abs=1e-5)
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the prompt token alone


def test_continuous_usage_is_per_choice(server):
    """stream_options.continuous_usage_stats, as vLLM: each chunk carries its own choice's counts
    so far (the role chunks 0 completion tokens), not the sum over choices."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 2 and all(c["usage"]["completion_tokens"] == 0 for c in roles)
    seen = {0: 0, 1: 0}
    for c in chunks:
        if c["choices"] and "role" not in c["choices"][0]["delta"]:
            i, n = c["choices"][0]["index"], c["usage"]["completion_tokens"]
            assert seen[i] <= n <= 4  # one choice's running count
            seen[i] = n
    assert chunks[-1]["usage"]["completion_tokens"] == sum(seen.values())  # the final chunk: the total


def test_tokenize_detokenize_round_trip(server):
    t = httpx.post(f"{server.url}/tokenize", json={"prompt": "Paged attention!"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 1024
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Paged attention!"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


def test_version_and_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
