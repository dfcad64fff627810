"""Bad input gets a 4xx with an OpenAI error object naming the field and the limit; disconnects abort
their requests and free their blocks; the server stays up throughout."""
from __future__ import annotations

import json

import httpx
import pytest
from server_util import MAIN_ARGS, open_request, shared_server, wait_until

pytestmark = pytest.mark.slow
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *MAIN_ARGS)


def post(server, path, body=None, raw: bytes | None = None, headers=None):
    h = {"content-type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


CASES = [
    # (id, path, body or raw bytes, status, words the message must contain, param)
    ("bad-json", COMPLETIONS, b'{"prompt": ', 400, ["not valid JSON"], None),
    ("not-an-object", COMPLETIONS, b"[1, 2]", 400, ["valid dictionary"], None),
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, ["not valid UTF-8", "0xff"], None),
    ("wrong-type-max-tokens", COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, ["max_tokens", "integer"],
     "max_tokens"),
    ("wrong-type-temperature", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, ["temperature"],
     "temperature"),
    ("wrong-type-stream", CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400,
     ["stream"], "stream"),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 3}, 400, ["prompt", "required"], "prompt"),
    ("unknown-model", COMPLETIONS, {"prompt": "x", "model": "gpt-4o"}, 404, ["gpt-4o", "does not exist"], "model"),
    ("zero-max-tokens", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens", "at least 1", "echo"],
     "max_tokens"),
    ("nan-temperature", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, ["temperature", "finite"],
     "temperature"),
    ("mixed-prompt-list", COMPLETIONS, {"prompt": ["x", [1, 2]]}, 400, ["prompt", "list of token-id lists", "mix"],
     "prompt"),
    ("negative-max-tokens", CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, 400,
     ["max_tokens"], "max_tokens"),
    ("huge-max-tokens", COMPLETIONS, {"prompt": "x", "max_tokens": 10**9}, 400,
     ["maximum context length is 1024", "at most"], "max_tokens"),
    ("max-tokens-over-context", CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1020}, 400,
     ["maximum context length is 1024"], "max_tokens"),
    ("n-over-limit", COMPLETIONS, {"prompt": "x", "n": 1000}, 400, ["n", "128"], "n"),
    ("batch-times-n-over-limit", COMPLETIONS, {"prompt": ["a"] * 20, "n": 10}, 400, ["200 choices", "128"], "n"),
    ("prompt-over-max-model-len", COMPLETIONS, {"prompt": "hello " * 3000}, 400,
     ["maximum context length is 1024", "3001"], "prompt"),
    ("token-prompt-over-max-model-len", COMPLETIONS, {"prompt": [100] * 1024}, 400, ["1024"], "prompt"),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400, ["prompt", "empty"], "prompt"),
    ("empty-prompt-list", COMPLETIONS, {"prompt": []}, 400, ["prompt", "empty"], "prompt"),
    ("empty-messages", CHAT, {"messages": []}, 400, ["messages"], "messages"),
    ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, ["role"], "messages.0.role"),
    ("token-out-of-vocab", COMPLETIONS, {"prompt": [49152]}, 400, ["[0, 49152)"], "prompt"),
    ("kv-compression-method", COMPLETIONS, {"prompt": "x", "kv_compression": {"method": "snap"}}, 400,
     ["kv_compression.method", "streaming"], "kv_compression.method"),
    ("kv-compression-window", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                     "kv_compression": {"method": "streaming", "window": 0}}, 400,
     ["kv_compression.window", ">= 1"], "kv_compression.window"),
    ("kv-compression-over-context", COMPLETIONS, {"prompt": "x", "kv_compression": {"method": "streaming",
                                                                                   "window": 4096}}, 400,
     ["kv_compression.window", "1024"], "kv_compression"),
    ("kv-compression-observation", COMPLETIONS, {"prompt": "x", "kv_compression": {
        "method": "snapkv", "heavy_tokens": 64, "window": 64, "observation_tokens": 0}}, 400,
     ["kv_compression.observation_tokens", ">= 1"], "kv_compression.observation_tokens"),
    ("cache-retention-priority", COMPLETIONS, {"prompt": "x", "cache_retention": {"priority": 101}}, 400,
     ["cache_retention.priority", "[0, 100]"], "cache_retention.priority"),
    ("cache-retention-ttl", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                   "cache_retention": {"priority": 80, "ttl_s": -5}}, 400,
     ["cache_retention.ttl_s", ">= 0"], "cache_retention.ttl_s"),
    ("negative-token", COMPLETIONS, {"prompt": [-1]}, 400, ["[0, 49152)"], "prompt"),
    ("top-p-zero", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, ["top_p"], "top_p"),
    ("temperature-over-2", COMPLETIONS, {"prompt": "x", "temperature": 9}, 400, ["temperature", "2"], "temperature"),
    ("logprobs-over-limit", COMPLETIONS, {"prompt": "x", "logprobs": 50}, 400, ["logprobs", "20"], "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, ["logprobs"], "top_logprobs"),
    ("min-tokens-over-max", COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, ["min_tokens"],
     "min_tokens"),
    ("empty-stop", COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, ["stop"], "stop"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, ["image_url", "not supported"], None),
    ("tools", CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     ["tools"], "tools"),
    ("json-mode", CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, ["json_object"], "response_format"),
    ("logit-bias", COMPLETIONS, {"prompt": "x", "logit_bias": {"1": 5}}, 400, ["logit_bias"], "logit_bias"),
    ("suffix", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, ["suffix"], "suffix"),
    ("body-too-large", COMPLETIONS, b'{"prompt": "' + b"a" * (2 * 1024 * 1024) + b'"}', 413,
     ["limit", "1048576"], None),
    # vLLM parameters kvserve lacks: refused by name, never a 200 that ignored them.
    ("guided-choice", CHAT, {"messages": [{"role": "user", "content": "x"}], "guided_choice": ["yes", "no"]}, 400,
     ["guided_choice", "structured output"], "guided_choice"),
    ("beam-search", COMPLETIONS, {"prompt": "x", "use_beam_search": True}, 400, ["beam search"], "use_beam_search"),
    ("allowed-token-ids", COMPLETIONS, {"prompt": "x", "allowed_token_ids": [30]}, 400, ["allowed_token_ids"],
     "allowed_token_ids"),
    ("prompt-logprobs-streamed", COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     ["not available when stream"], "prompt_logprobs"),
    ("prompt-logprobs-over-limit", CHAT, {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 50},
     400, ["prompt_logprobs", "20", "--max-logprobs"], "prompt_logprobs"),
    ("chat-echo", CHAT, {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, ["echo"], "echo"),
    ("modalities-audio", CHAT, {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     400, ["modalities"], "modalities"),
    ("stream-options-without-stream", COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}},
     400, ["stream is true"], "stream_options"),
    ("priority-under-fcfs", COMPLETIONS, {"prompt": "x", "priority": 5}, 400, ["--scheduling-policy priority"],
     "priority"),
    ("continue-and-generation-prompt", CHAT, {"messages": [{"role": "user", "content": "x"},
                                                           {"role": "assistant", "content": "y"}],
                                              "continue_final_message": True}, 400, ["cannot both be true"],
     "messages"),
    ("truncate-zero", COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, [">= 1"],
     "truncate_prompt_tokens"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10**7]}, 400, ["tokens"], "tokens"),
    # a seed the sampler's generator cannot take: refused before it reaches the engine step
    ("seed-over-int64", COMPLETIONS, {"prompt": "x", "temperature": 1, "seed": 2**64}, 400, ["seed"], "seed"),
    ("seed-plus-n-over-int64", COMPLETIONS, {"prompt": "x", "temperature": 1, "n": 2, "seed": 2**63 - 1}, 400,
     ["seed", "seed + i"], "seed"),
    # an unpaired surrogate escape is not Unicode text: a 400 naming where, not a plain-text 500
    ("lone-surrogate-prompt", COMPLETIONS, b'{"prompt": ["ok", "Hi \\ud800"]}', 400,
     ["`prompt[1]`", "unpaired", "surrogate"], None),
    ("lone-surrogate-model", COMPLETIONS, b'{"prompt": "x", "model": "\\udfff"}', 400, ["`model`", "surrogate"],
     None),
    ("lone-surrogate-tokenize", "/tokenize", b'{"prompt": "\\ud800"}', 400, ["surrogate"], None),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     400, ["`messages[0].content[0].text`", "surrogate"], None),
    ("json-mode-on-completions", COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_object"}}, 400,
     ["response_format", "structured output"], "response_format"),
    ("tools-on-completions", COMPLETIONS, {"prompt": "x", "tools": [{"type": "function"}]}, 400, ["tools"], "tools"),
    ("tool-choice-without-tools", CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     400, ["tool_choice", "needs tools"], "tool_choice"),
    ("assistant-tool-calls", CHAT, {"messages": [{"role": "user", "content": "x"},
                                                 {"role": "assistant", "content": None,
                                                  "tool_calls": [{"id": "1", "type": "function"}]}]},
     400, ["tool_calls", "not supported"], "messages.1.tool_calls"),
    ("template-kwargs-tokenize", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                        "chat_template_kwargs": {"tokenize": False}}, 400,
     ["chat_template_kwargs", "tokenize", "not a template variable"], "chat_template_kwargs"),
    ("template-kwargs-generation-prompt", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template_kwargs": {"add_generation_prompt": False}}, 400,
     ["add_generation_prompt", "request's own field"], "chat_template_kwargs"),
    ("text-part-without-text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     ["'text' field"], "messages"),
    ("content-wrong-type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     ["`messages[0].content` must be a string"], "messages.0.content"),
    ("tokenize-nothing", "/tokenize", {}, 400, ["prompt", "messages"], None),
]

BIG = b'"' + b"a" * (2 * 1024 * 1024) + b'"'
# The endpoints beside completions and chat: wrong JSON types, missing fields, unknown models,
# bodies over the limit.
SIDE_CASES = [
    ("tokenize-bad-json", "/tokenize", b'{"prompt": ', 400, ["not valid JSON"], None),
    ("tokenize-not-an-object", "/tokenize", b"[1, 2]", 400, ["valid dictionary"], None),
    ("tokenize-prompt-wrong-type", "/tokenize", {"prompt": 5}, 400, ["`prompt`", "string"], "prompt"),
    ("tokenize-messages-wrong-type", "/tokenize", {"messages": "hi"}, 400, ["`messages`", "list"], "messages"),
    ("tokenize-flag-wrong-type", "/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400,
     ["`add_special_tokens`", "boolean"], "add_special_tokens"),
    ("tokenize-prompt-and-messages", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
     400, ["exactly one of `prompt` or `messages`"], "prompt"),
    ("tokenize-empty-messages", "/tokenize", {"messages": []}, 400, ["`messages` is empty"], "messages"),
    ("tokenize-bad-role", "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, ["role"],
     "messages.0.role"),
    ("tokenize-unknown-model", "/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, ["gpt-4o", "does not exist"],
     "model"),
    ("tokenize-body-too-large", "/tokenize", b'{"prompt": ' + BIG + b"}", 413, ["limit", "1048576"], None),
    ("detokenize-bad-json", "/detokenize", b'{"tokens": [1,', 400, ["not valid JSON"], None),
    ("detokenize-missing-tokens", "/detokenize", {}, 400, ["`tokens`", "required"], "tokens"),
    ("detokenize-tokens-wrong-type", "/detokenize", {"tokens": "abc"}, 400, ["`tokens`", "list"], "tokens"),
    ("detokenize-float-token", "/detokenize", {"tokens": [1.5]}, 400, ["`tokens.0`", "integer"], "tokens.0"),
    ("detokenize-negative-token", "/detokenize", {"tokens": [-1]}, 400, ["[0, 49152)", "[-1]"], "tokens"),
    ("detokenize-unknown-model", "/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404,
     ["gpt-4o", "does not exist"], "model"),
    ("detokenize-body-too-large", "/detokenize", b'{"tokens": [' + b"1, " * (400 * 1024) + b"1]}", 413,
     ["limit", "1048576"], None),
    ("reset-prefix-cache-body-too-large", "/reset_prefix_cache", b'{"x": ' + BIG + b"}", 413,
     ["limit", "1048576"], None),
]


@pytest.mark.parametrize("path, body, status, words, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server, path, body, status, words, param):
    r = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])
    if param is not None:
        assert err["param"] == param
    assert err["type"]


@pytest.mark.parametrize("path, body, status, words, param", [c[1:] for c in SIDE_CASES],
                         ids=[c[0] for c in SIDE_CASES])
def test_bad_input_on_the_other_endpoints(server, path, body, status, words, param):
    test_bad_input(server, path, body, status, words, param)


@pytest.mark.parametrize("method, path", [("GET", "/tokenize"), ("PUT", "/tokenize"), ("GET", "/detokenize"),
                                          ("GET", "/reset_prefix_cache"), ("POST", "/v1/models"),
                                          ("DELETE", "/v1/models"), ("GET", CHAT), ("POST", "/health")])
def test_wrong_method_names_it(server, method, path):
    r = httpx.request(method, server.url + path, timeout=60)
    assert r.status_code == 405, r.text
    err = r.json()["error"]
    assert err["message"] == "Method Not Allowed" and err["type"] and err["code"] == 405


def test_tokenize_counts_a_prompt_longer_than_the_context(server):
    """As vLLM's /tokenize: a prompt over max_model_len is counted, not refused (a client counts
    tokens to know whether to cut); max_model_len comes with the count."""
    r = post(server, "/tokenize", {"prompt": "hello " * 3000})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 3001 > r.json()["max_model_len"] == 1024


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_json_body_with_another_content_type_is_served(server, content_type):
    """`curl -d '{...}'` sends its JSON as x-www-form-urlencoded: served as the JSON it is."""
    r = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1}, headers={"content-type": content_type})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


def test_server_survives_bad_input_on_every_endpoint(server):
    for _, path, body, *_ in SIDE_CASES:
        post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    for method, path in (("GET", "/tokenize"), ("POST", "/v1/models")):
        httpx.request(method, server.url + path, timeout=60)
    assert httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    ids = post(server, "/tokenize", {"prompt": "Hello"}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "Hello"
    r = post(server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "Traceback" not in server.log()


def test_off_values_and_unknown_fields_are_accepted(server):
    """A vLLM parameter at its off value, or a field nobody knows, does not fail the request (vLLM
    logs and ignores unknown fields)."""
    r = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 1, "use_beam_search": False, "guided_json": None,
                                   "length_penalty": 1.0, "bad_words": [], "spaces_between_special_tokens": False,
                                   "some_new_field": 1})
    assert r.status_code == 200, r.text
    # what OpenAI SDK wrappers send with every chat request, at the values that change nothing here
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                            "parallel_tool_calls": True, "modalities": ["text"], "reasoning_effort": "low",
                            "top_logprobs": 0, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    # the off values of the fields refused above: plain text, no tool choice, no tool calls; a
    # surrogate *pair* (what json.dumps writes for an emoji) is Unicode and passes
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "x \U0001F600"},
                                         {"role": "assistant", "content": "y", "tool_calls": []},
                                         {"role": "user", "content": "z"}], "max_tokens": 1,
                            "tool_choice": "none", "response_format": {"type": "text"}, "seed": -(2**63),
                            "temperature": 1.0})
    assert r.status_code == 200, r.text
    r = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 1, "response_format": {"type": "text"},
                                   "tool_choice": None, "seed": 2**63 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text


def test_unknown_route_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.url}{COMPLETIONS}")
    assert r.status_code == 405 and "error" in r.json()


def test_server_survives_bad_input_and_serves_others(server):
    for _, path, body, *_ in CASES[:6]:
        post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    r = post(server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "Traceback" not in server.log()


def test_a_refused_seed_does_not_fail_other_requests(server):
    """A seed out of int64 used to reach the sampler and fail the engine step, ending every request in
    flight; now it is refused at the door and the stream beside it finishes normally."""
    with httpx.stream("POST", server.url + COMPLETIONS, timeout=120,
                      json={"prompt": "Count: 1, 2, 3,", "max_tokens": 40, "ignore_eos": True, "stream": True,
                            "temperature": 1.0, "seed": 1}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "error" not in first
        for seed, n in ((2**64, 1), (-(2**63) - 1, 1), (2**63 - 1, 3)):
            r = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "seed": seed, "n": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert sum(json.loads(line[6:])["choices"][0]["finish_reason"] == "length" for line in rest[:-1]) == 1


def _idle(server):
    return server.metric("kvserve:kv_blocks_used") == 0 and server.metric("vllm:num_requests_running") == 0


def _finished(server, reason: str) -> float:
    return server.metric("vllm:request_success_total", finished_reason=reason)


def test_stream_disconnect_aborts_and_frees_blocks(server):
    wait_until(lambda: _idle(server), 30, what="idle server")
    aborted_before, length_before = _finished(server, "abort"), _finished(server, "length")
    generated_before = server.metric("vllm:generation_tokens_total")
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 800, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: closing this iterator closes the connection
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
            assert server.metric("kvserve:kv_blocks_used") > 0  # it is running and holds blocks
    wait_until(lambda: _idle(server), 60, what="blocks freed after disconnect")
    # Ended by the abort, not by reaching its 800 tokens.
    assert _finished(server, "abort") == aborted_before + 1
    assert _finished(server, "length") == length_before
    assert server.metric("vllm:generation_tokens_total") - generated_before < 800
    log = server.log()  # vLLM's two lines: the abort, and uvicorn's access log
    assert "Aborted request cmpl-" in log and '"POST /v1/completions HTTP/1.1" 200' in log


def test_non_stream_disconnect_aborts(server):
    wait_until(lambda: _idle(server), 30, what="idle server")
    aborted_before, length_before = _finished(server, "abort"), _finished(server, "length")
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 800, "ignore_eos": True}
    with open_request(server.url, COMPLETIONS, body):
        wait_until(lambda: server.metric("vllm:num_requests_running") == 1, 60, what="the request running")
    wait_until(lambda: _idle(server), 60, what="blocks freed after a non-streaming client left")
    assert _finished(server, "abort") == aborted_before + 1 and _finished(server, "length") == length_before
    assert "client disconnected before the response; request aborted" in server.log()


def test_reset_prefix_cache_refuses_while_blocks_in_use(server):
    wait_until(lambda: _idle(server), 30, what="idle server")
    body = {"prompt": "Tell me a story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + COMPLETIONS, json=body) as r:
            lines = r.iter_lines()  # held: closing this iterator closes the connection
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(f"{server.url}/reset_prefix_cache")
    assert busy.status_code == 409
    assert "blocks" in busy.json()["error"]["message"] and "in use" in busy.json()["error"]["message"]
    wait_until(lambda: _idle(server), 10, what="idle server")
    ok = httpx.post(f"{server.url}/reset_prefix_cache")
    assert ok.status_code == 200
    assert server.metric("kvserve:kv_blocks_cached") == 0


def test_no_tracebacks_after_all_of_the_above(server):
    """Disconnects and bad input are normal events: nothing in this module may log a traceback."""
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_request_with_cache_retention_is_served(server):
    body = {"prompt": "A shared system prompt. " * 8, "max_tokens": 2, "cache_retention": {"priority": 90, "ttl_s": 60}}
    assert post(server, COMPLETIONS, body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "cache_retention": {"priority": 5}}
    assert post(server, CHAT, chat).status_code == 200


def test_compressed_request_reports_attended_tokens(server):
    body = {"prompt": "The history of the city " * 20, "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "kv_compression": {"method": "streaming", "sink_tokens": 4, "window": 64}}
    r = post(server, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["kv_attended_tokens"] <= 16 + 64 + 16 < usage["total_tokens"], usage
    plain = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2}).json()["usage"]
    assert "kv_attended_tokens" not in plain
    # snapkv: the prompt's last queries vote, in the compiled layer loop of the bf16 server
    body["kv_compression"] = {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 32, "window": 32}
    r = post(server, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["kv_attended_tokens"] <= 16 + 32 + 32 + 2 * 16 < usage["total_tokens"], usage
