"""The semantic response cache: what a hit must match, expiry, persistence, bad input, and one
server end to end with the openai client."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from server_util import shared_server

from kvserve.core.sampling_params import SamplingParams
from kvserve.semantic_cache import CacheKey, SemanticCache
from kvserve.server import protocol as P
from kvserve.server.protocol import APIError
from kvserve.server.semantic_cache import SemanticCacheConfig, SemanticFront, check_request

Q = "What is the capital of France?"
PARAPHRASE = "Which city is France's capital?"
UNRELATED = "How do I bake sourdough bread at home?"


@pytest.fixture(scope="module")
def embed():
    from kvserve.semantic_cache.embedder import MiniLMEmbedder
    model = MiniLMEmbedder()
    return lambda text: model([text])[0]


@pytest.fixture(scope="module")
def embedder():
    from kvserve.semantic_cache.embedder import MiniLMEmbedder
    return MiniLMEmbedder()


def key(model="m", salt=None, history=(), temperature=0.0):
    return CacheKey(model, salt, list(history), {"temperature": temperature})


def filled(embed, path=None, k=None, **kw):
    cache = SemanticCache(path, 384, **kw)
    cache.insert(k or key(), None, Q, embed(Q), {"content": "Paris."})
    return cache


def test_paraphrase_hits_unrelated_misses(embed):
    cache = filled(embed)
    hit = cache.lookup(key(), embed(PARAPHRASE))
    assert hit is not None and hit.response["content"] == "Paris." and hit.similarity >= 0.9, hit
    assert cache.lookup(key(), embed(UNRELATED)) is None
    assert cache.lookup(key(), embed(PARAPHRASE), threshold=0.999) is None  # a per-request threshold


def test_a_hit_never_crosses_tenants_models_or_settings(embed):
    cache = filled(embed, k=key(salt="tenant-a-salt"))
    assert cache.lookup(key(salt="tenant-a-salt"), embed(Q)) is not None
    assert cache.lookup(key(salt="tenant-b-salt"), embed(Q)) is None
    assert cache.lookup(key(salt=None), embed(Q)) is None
    assert cache.lookup(key(model="adapter", salt="tenant-a-salt"), embed(Q)) is None
    assert cache.lookup(key(salt="tenant-a-salt", temperature=0.5), embed(Q)) is None


def test_a_different_earlier_conversation_misses(embed):
    talk_a = [{"role": "user", "content": "Let's talk about Texas."}, {"role": "assistant", "content": "Sure."}]
    talk_b = [{"role": "user", "content": "Let's talk about Europe."}, {"role": "assistant", "content": "Sure."}]
    cache = filled(embed, k=key(history=talk_a))
    assert cache.lookup(key(history=talk_a), embed(Q)) is not None
    assert cache.lookup(key(history=talk_b), embed(Q)) is None
    assert cache.lookup(key(), embed(Q)) is None


def test_an_expired_entry_is_not_served(embed):
    import time
    cache = filled(embed, ttl=60)
    assert cache.lookup(key(), embed(Q), now=time.time() + 59) is not None
    assert cache.lookup(key(), embed(Q), now=time.time() + 61) is None


def test_entries_survive_a_restart_and_clear_per_tenant(embed, tmp_path):
    path = str(tmp_path / "cache.db")
    cache = filled(embed, path)
    cache.insert(key(salt="b"), "bob", Q, embed(Q), {"content": "Paris, bob."})
    cache.close()
    cache = SemanticCache(path, 384)
    assert cache.lookup(key(), embed(PARAPHRASE)).response["content"] == "Paris."
    assert cache.size(None)["entries"] == 1 and cache.size("bob")["entries"] == 1
    assert cache.clear("bob") == 1
    assert cache.lookup(key(salt="b"), embed(Q)) is None and cache.lookup(key(), embed(Q)) is not None
    cache.close()


def test_a_stale_or_corrupt_store_starts_empty_or_rebuilt(embed, tmp_path, caplog):
    path = tmp_path / "cache.db"
    cache = filled(embed, str(path))
    cache.close()
    (tmp_path / "cache.db.hnsw").write_bytes(b"not an index")
    cache = SemanticCache(str(path), 384)  # the index is rebuilt from the rows
    assert cache.lookup(key(), embed(Q)).response["content"] == "Paris."
    cache.close()
    path.write_bytes(b"garbage" * 1000)
    cache = SemanticCache(str(path), 384)
    assert cache.size(None)["entries"] == 0 and cache.lookup(key(), embed(Q)) is None
    assert "unreadable" in caplog.text
    cache.close()


def test_size_cap_evicts_least_recently_used(embed):
    cache = SemanticCache(None, 384, max_entries=2)
    for i, q in enumerate([Q, UNRELATED, "Who wrote Hamlet?"]):
        cache.insert(key(), None, q, embed(q), {"content": str(i)})
    assert cache.size(None)["entries"] == 2
    assert cache.lookup(key(), embed(Q)) is None  # the oldest went


def chat(**kw):
    return P.ChatCompletionRequest(messages=[{"role": "user", "content": Q}], **kw)


def test_sampling_and_opt_out_bypass_by_default(embedder):
    front = SemanticFront(SemanticCacheConfig(None), CollectorRegistry(), embedder)
    try:
        assert front.plan(chat(), None, None, "m", SamplingParams(temperature=0.0)) is not None
        assert front.plan(chat(), None, None, "m", SamplingParams(temperature=0.7)) is None
        assert front.plan(chat(semantic_cache=True), None, None, "m", SamplingParams(temperature=0.7)) is not None
        assert front.plan(chat(semantic_cache=False), None, None, "m", SamplingParams(temperature=0.0)) is None
        assert front.plan(chat(), None, None, "m", SamplingParams(temperature=0.0, n=2)) is None
        assert front.bypasses._value.get() == 3
        a = front.plan(chat(), None, None, "m", SamplingParams(temperature=0.0, max_tokens=5))
        b = front.plan(chat(), None, None, "m", SamplingParams(temperature=0.0, max_tokens=6))
        assert a.key.digest != b.key.digest  # settings that change the answer are part of the key
    finally:
        front.close()


@pytest.mark.parametrize("fields, param", [
    ({"semantic_cache_threshold": 0.0}, "semantic_cache_threshold"),
    ({"semantic_cache_threshold": 1.5}, "semantic_cache_threshold"),
    ({"semantic_cache_ttl": -1.0}, "semantic_cache_ttl"),
])
def test_bad_settings_are_refused_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        check_request(chat(**fields), enabled=True)
    assert e.value.param == param and param in str(e.value)


def test_asking_a_server_without_the_cache_is_refused():
    check_request(chat(), enabled=False)
    check_request(chat(semantic_cache=False), enabled=False)
    with pytest.raises(APIError) as e:
        check_request(chat(semantic_cache=True), enabled=False)
    assert e.value.param == "semantic_cache" and "--semantic-cache" in str(e.value)


# ----- one server end to end -----

KEYS = {"key-alice": "alice", "key-bob": "bob"}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("semantic")
    (d / "keys.json").write_text(json.dumps(KEYS))
    return shared_server(request, "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--disable-log-stats",
                         "--api-keys-file", str(d / "keys.json"), "--semantic-cache", str(d / "cache.db"))


def ask(server, key, question, **kw):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=120)
    return client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=12, **kw)


@pytest.mark.slow
def test_server_end_to_end(server):
    first = ask(server, "key-alice", Q)
    assert first.headers["x-kvserve-semantic-cache"] == "miss"
    answer = first.parse().choices[0].message.content
    hit = ask(server, "key-alice", PARAPHRASE)
    assert hit.headers["x-kvserve-semantic-cache"].startswith("hit; similarity=")
    body = hit.parse()
    assert body.choices[0].message.content == answer and body.usage.completion_tokens == 0
    # streamed, as a generated answer streams
    stream = ask(server, "key-alice", PARAPHRASE, stream=True)
    assert stream.headers["x-kvserve-semantic-cache"].startswith("hit")
    assert "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices) == answer
    # another tenant asking the same gets its own answer computed
    assert ask(server, "key-bob", Q).headers["x-kvserve-semantic-cache"] == "miss"
    bypass = ask(server, "key-alice", Q, extra_body={"semantic_cache": False})
    assert "x-kvserve-semantic-cache" not in bypass.headers
    bad = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer key-alice"},
                     json={"messages": [{"role": "user", "content": Q}], "semantic_cache_threshold": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "semantic_cache_threshold"
    auth = {"Authorization": "Bearer key-alice"}
    refused = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=30,
                         json={"prompt": Q, "max_tokens": 1, "semantic_cache": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "semantic_cache"
    assert httpx.get(f"{server.url}/v1/semantic_cache", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/semantic_cache", headers=auth, timeout=10).json()["entries"] == 1
    assert httpx.delete(f"{server.url}/v1/semantic_cache", headers=auth, timeout=10).json()["deleted"] == 1
    assert ask(server, "key-alice", PARAPHRASE).headers["x-kvserve-semantic-cache"] == "miss"
    assert server.metric("kvserve:semantic_cache_hits_total") == 2
    assert server.metric("kvserve:semantic_cache_bypasses_total") == 1


def test_concurrent_identical_misses_store_whole_entries(embed):
    """Two requests that both missed store their answers at once: two good entries, none torn."""
    from concurrent.futures import ThreadPoolExecutor
    cache = SemanticCache(None, 384)
    v = embed(Q)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: cache.insert(key(), None, Q, v, {"content": "Paris."}), range(16)))
    assert cache.size(None)["entries"] == 16
    with ThreadPoolExecutor(8) as pool:
        hits = list(pool.map(lambda i: cache.lookup(key(), v), range(16)))
    assert all(h.response == {"content": "Paris."} for h in hits)


def test_completions_refuse_the_semantic_cache_fields():
    req = P.CompletionRequest(prompt="x", semantic_cache=True)
    assert "semantic_cache" in P.COMPLETION_REFUSED and req.model_extra["semantic_cache"] is True
