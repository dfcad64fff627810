"""API keys, tenant-isolated prefix caches, and preemption under a tiny KV budget (one server)."""
from __future__ import annotations

import json
import threading
import uuid

import httpx
import openai
import pytest
from server_util import shared_server, start_server, wait_until

pytestmark = pytest.mark.slow
KEYS = {"key-alice": "alice", "key-bob": "bob"}
SHARED_KEY = "key-shared"
SECOND_KEY = "key-second"  # given after the same --api-key, as vLLM takes a list
NUM_BLOCKS = 40  # 640 token slots: enough for one 256-token request, too few for six at once


@pytest.fixture(scope="session")
def server(request, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    return shared_server(request, "--max-model-len", "256", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                         "--api-keys-file", str(keys_file), "--api-key", SHARED_KEY, SECOND_KEY,
                         "--disable-log-stats", "--disable-fastapi-docs")


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_pool_reported_before_the_first_request(server):
    """The gauges are set at start-up, not on the first step: a fresh server showed 0 blocks."""
    assert server.metric("kvserve:kv_blocks_total") == NUM_BLOCKS
    assert server.metric("kvserve:kv_blocks_free") == NUM_BLOCKS
    info = [k for k in server.metrics() if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and f'num_gpu_blocks="{NUM_BLOCKS}"' in info[0] and 'block_size="16"' in info[0], info


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/reset_prefix_cache", None),
])
def test_api_key_required(server, method, path, body):
    for headers in ({}, auth("wrong"), {"Authorization": "key-alice"}, {"Authorization": "Basic key-alice"}):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "--api-key" in r.json()["error"]["message"]
    for key in ("key-alice", SHARED_KEY):
        r = httpx.request(method, server.url + path, json=body, headers=auth(key), timeout=60)
        assert r.status_code in (200, 409), r.text  # 409: reset refused while blocks are in use


def test_health_and_metrics_stay_open(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "vllm:gpu_cache_usage_perc" in httpx.get(f"{server.url}/metrics").text


def test_openai_client_with_key(server):
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-bob", max_retries=0)
    assert good.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def cached_tokens(server, key, prompt, **extra) -> int:
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(key), timeout=60,
                   json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenant_b_never_hits_tenant_a_blocks(server):
    prompt = f"{uuid.uuid4()} " + "confidential: the merger closes on Friday at noon. " * 6
    assert cached_tokens(server, "key-alice", prompt) == 0
    assert cached_tokens(server, "key-alice", prompt) > 32  # alice hits her own cache
    assert cached_tokens(server, "key-bob", prompt) == 0  # same exact prompt, other tenant: no hit
    assert cached_tokens(server, "key-bob", prompt) > 32  # bob now hits his own copy
    # A client cache_salt is combined with the tenant's, never replaces it:
    assert cached_tokens(server, "key-alice", prompt, cache_salt="s1") == 0
    assert cached_tokens(server, "key-bob", prompt, cache_salt="s1") == 0
    assert cached_tokens(server, "key-alice", prompt, cache_salt="s1") > 32
    # Keys given with --api-key share the default (unsalted) tenant, apart from both.
    assert cached_tokens(server, SHARED_KEY, prompt) == 0


def test_preemptions_counted_under_tiny_kv_budget(server):
    wait_until(lambda: server.metric("kvserve:kv_blocks_used") == 0, 30, what="idle server")
    assert server.metric("kvserve:kv_blocks_total") == NUM_BLOCKS
    before = server.metric("vllm:num_preemptions_total")
    results = []

    def one(i):
        r = httpx.post(f"{server.url}/v1/completions", headers=auth("key-alice"), timeout=300, json={
            "prompt": f"{i} {uuid.uuid4()} " + "word " * 100, "max_tokens": 100, "ignore_eos": True,
            "temperature": 0})
        results.append(r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in results)  # preempted ones still finish
    assert server.metric("vllm:num_preemptions_total") > before
    wait_until(lambda: server.metric("kvserve:kv_blocks_used") == 0, 10, what="blocks freed")


def test_every_key_after_one_api_key_flag_is_accepted(server):
    body = {"prompt": "Hi", "max_tokens": 1}
    for key in (SHARED_KEY, SECOND_KEY):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(key), timeout=60)
        assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=auth("key-other"), timeout=60).status_code == 401


def test_disable_fastapi_docs_removes_the_schema_and_docs_pages(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", headers=auth(SHARED_KEY), timeout=30).status_code == 404, path
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_vllm_api_key_env_turns_auth_on():
    """vLLM reads VLLM_API_KEY when --api-key is absent; a launch script relying on it must not
    start an open server."""
    handle = start_server("--max-model-len", "128", "--disable-log-stats", env={"VLLM_API_KEY": "env-key"})
    try:
        body = {"prompt": "Hi", "max_tokens": 1}
        assert httpx.post(f"{handle.url}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{handle.url}/v1/completions", json=body, headers=auth("env-key"), timeout=60)
        assert r.status_code == 200, r.text
        assert "auth on" in handle.log()
    finally:
        handle.stop()
