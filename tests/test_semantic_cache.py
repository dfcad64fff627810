"""The semantic response cache: what a hit must match, expiry, persistence, bad input, and one
server end to end with the openai client."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from server_util import shared_server, start_server, wait_until

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


# ----- the shared Redis store -----

def test_two_caches_on_one_redis_share_entries_never_across_tenants(embed, redis_server):
    """Two servers' caches on one Redis: an answer stored through one is a hit through the other."""
    a, b = SemanticCache(redis_server.url, 384), SemanticCache(redis_server.url, 384)
    a.insert(key(salt="alice-salt"), "alice", Q, embed(Q), {"content": "Paris."})
    hit = b.lookup(key(salt="alice-salt"), embed(PARAPHRASE))
    assert hit is not None and hit.response == {"content": "Paris."} and hit.query == Q
    assert b.lookup(key(salt="bob-salt"), embed(Q)) is None and b.lookup(key(), embed(Q)) is None
    assert b.lookup(key(salt="alice-salt"), embed(UNRELATED)) is None
    a.insert(key(salt="alice-salt"), "alice", UNRELATED, embed(UNRELATED), {"content": "Flour."})
    assert b.lookup(key(salt="alice-salt"), embed(UNRELATED)).response == {"content": "Flour."}  # added since
    b.insert(key(salt="bob-salt"), "bob", Q, embed(Q), {"content": "Paris, bob."})
    assert a.size("alice") == b.size("alice") and a.size("bob")["entries"] == 1 and a.totals()[0] == 3
    assert a.clear("alice") == 2  # through A; B sees it gone and keeps bob's
    assert b.lookup(key(salt="alice-salt"), embed(Q)) is None
    assert b.lookup(key(salt="bob-salt"), embed(Q)).response["content"] == "Paris, bob."
    assert b.size("alice") == {"entries": 0, "bytes": 0}
    a.close(), b.close()


def test_redis_expiry_and_size_cap(embed, redis_server):
    import time
    cache = SemanticCache(redis_server.url, 384, ttl=60, max_entries=2)
    cache.insert(key(), None, Q, embed(Q), {"content": "Paris."})
    other = SemanticCache(redis_server.url, 384)
    assert other.lookup(key(), embed(Q), now=time.time() + 59) is not None
    assert other.lookup(key(), embed(Q), now=time.time() + 61) is None  # checked on read
    assert cache.store.expire(time.time() + 61) == 1 and cache.totals() == (0, 0)
    for i, q in enumerate([Q, UNRELATED, "Who wrote Hamlet?"]):
        cache.insert(key(), None, q, embed(q), {"content": str(i)})
    assert cache.totals()[0] == 2 and other.lookup(key(), embed(Q)) is None  # the least recently used went
    cache.close(), other.close()


def test_keys_redis_evicted_itself_are_misses_and_stop_the_size_cap(embed, redis_server):
    """A Redis with maxmemory and an allkeys policy may evict any of the store's keys: a miss, and
    the size cap does not loop on counts left too high."""
    import redis
    cache = SemanticCache(redis_server.url, 384, max_entries=1)
    cache.insert(key(), None, Q, embed(Q), {"content": "Paris."})
    raw = redis.Redis.from_url(redis_server.url)
    raw.delete(*raw.keys("kvserve-semantic:e:*"), "kvserve-semantic:used")
    assert cache.lookup(key(), embed(Q)) is None
    raw.delete("kvserve-semantic:used")
    raw.hset("kvserve-semantic:totals", "n", 5)  # counts high, nothing listed to evict: the insert returns
    cache.insert(key(), None, UNRELATED, embed(UNRELATED), {"content": "Flour."})
    assert cache.lookup(key(), embed(Q)) is None
    cache.close()


def test_redis_down_at_start_warns_and_recovers(embed, caplog):
    """Redis not there at start-up: the cache starts (every lookup a miss) and finds it when it comes."""
    from redis_server import RedisServer

    from kvserve.semantic_cache.base import StoreUnavailable
    server = RedisServer()
    try:
        cache = SemanticCache(server.url, 384)
        assert "unavailable" in caplog.text
        with pytest.raises(StoreUnavailable):
            cache.lookup(key(), embed(Q))
        server.start()
        cache.store._retry_at = 0.0  # rather than wait out the backoff
        cache.insert(key(), None, Q, embed(Q), {"content": "Paris."})
        assert cache.lookup(key(), embed(Q)) is not None
        server.kill()  # lost mid-run: the lookup fails fast, the front makes it a miss
        with pytest.raises(StoreUnavailable):
            cache.lookup(key(), embed(Q))
        cache.close()
    finally:
        server.close()


def test_a_lost_redis_is_a_miss_not_an_error(embedder, redis_server):
    import asyncio
    front = SemanticFront(SemanticCacheConfig(redis_server.url), CollectorRegistry(), embedder)
    try:
        redis_server.kill()
        plan = front.plan(chat(), None, None, "m", SamplingParams(temperature=0.0))
        assert asyncio.run(front.lookup(plan)) is None
        assert front.misses._value.get() == 1 and front.errors._value.get() == 1
        with pytest.raises(APIError) as e:
            front.size(None)
        assert e.value.status == 503
    finally:
        front.close()


def test_bad_redis_urls_are_config_errors(redis_server):
    from kvserve.errors import ConfigError
    from kvserve.semantic_cache.base import check_location
    check_location(redis_server.url), check_location("/var/lib/cache.db")
    for url in ("redis://127.0.0.1:notaport/0", "redis://127.0.0.1:6379/notadb"):
        with pytest.raises(ConfigError, match="redis://host:port/db"):
            check_location(url)
        with pytest.raises(ConfigError, match="redis://host:port/db"):
            SemanticCache(url, 384)
    with pytest.raises(ConfigError, match="database index"):  # Redis answers and refuses
        SemanticCache(redis_server.url.replace("/0", "/99"), 384)


# ----- servers: sharing one Redis, restarting on one file -----

SERVER_ARGS = ("--max-model-len", "512", "--kv-cache-memory", "64MiB", "--disable-log-stats")


def entries(server, key: str = "none") -> int | None:
    """The caller's tenant's entries, None while the store is unreachable (503)."""
    r = httpx.get(f"{server.url}/v1/semantic_cache", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return r.json()["entries"] if r.status_code == 200 else None


def outcome(response) -> str:
    return response.headers["x-kvserve-semantic-cache"].split(";")[0]


@pytest.mark.slow
def test_two_servers_share_one_redis(redis_server, tmp_path):
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    args = (*SERVER_ARGS, "--api-keys-file", str(tmp_path / "keys.json"), "--semantic-cache", redis_server.url)
    a = start_server(*args)
    try:
        redis_server.kill()  # B starts while Redis is down: a warning, and it serves
        b = start_server(*args)
        try:
            assert "unavailable" in b.log()
            assert outcome(ask(b, "key-alice", Q)) == "miss"
            redis_server.start()
            wait_until(lambda: entries(b, "key-alice") == 0, 60, interval=0.5, what="B finding Redis")
            wait_until(lambda: entries(a, "key-alice") == 0, 60, interval=0.5, what="A finding Redis again")
            first = ask(a, "key-alice", Q)
            assert outcome(first) == "miss"
            answer = first.parse().choices[0].message.content
            wait_until(lambda: entries(b, "key-alice") == 1, 30, what="A's entry seen through B")
            hit = ask(b, "key-alice", PARAPHRASE)  # stored through A, served by B
            assert outcome(hit) == "hit" and hit.parse().choices[0].message.content == answer
            assert outcome(ask(b, "key-bob", Q)) == "miss"  # tenants stay apart across servers
            redis_server.kill()  # lost mid-run: requests are generated, never a 500
            lost = ask(a, "key-alice", PARAPHRASE)
            assert outcome(lost) == "miss" and lost.status_code == 200 and lost.parse().choices[0].message.content
            assert httpx.get(f"{a.url}/v1/semantic_cache", headers={"Authorization": "Bearer key-alice"},
                             timeout=10).status_code == 503
            redis_server.start()  # back, empty: both servers find it again
            wait_until(lambda: entries(a, "key-alice") == 0, 60, interval=0.5, what="A reconnecting")
            assert outcome(ask(a, "key-alice", Q)) == "miss"
            wait_until(lambda: entries(b, "key-alice") == 1, 60, interval=0.5, what="B reconnecting")
            assert outcome(ask(b, "key-alice", PARAPHRASE)) == "hit"
            assert a.metric("kvserve:semantic_cache_errors_total") >= 1
        finally:
            b.stop()
    finally:
        a.stop()


def sigterm(server) -> None:
    """Stop a server as an operator does: SIGTERM to its PID, a bounded wait."""
    import signal
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(60)
    server.stop()  # its engine process, should it outlive it


@pytest.mark.slow
def test_a_corrupt_store_starts_empty_and_a_restarted_server_hits(tmp_path):
    path = tmp_path / "cache.db"
    path.write_bytes(b"not a database" * 1000)
    args = (*SERVER_ARGS, "--semantic-cache", str(path))
    server = start_server(*args)
    try:
        assert "unreadable" in server.log() and "starting empty" in server.log()
        first = ask(server, "none", Q)  # served, generated, stored in the fresh store
        assert outcome(first) == "miss" and first.status_code == 200
        wait_until(lambda: entries(server) == 1, 30, what="the entry stored")
    finally:
        sigterm(server)
    server = start_server(*args)
    try:
        hit = ask(server, "none", PARAPHRASE)
        assert outcome(hit) == "hit"
        assert hit.parse().choices[0].message.content == first.parse().choices[0].message.content
    finally:
        sigterm(server)


def test_redis_stores_stay_in_step_under_interleaved_adds_and_deletes(redis_server):
    """Two servers' stores adding, evicting, clearing and looking up in turn: each lookup finds the
    nearest live entry, as a scan of the live entries does."""
    import random

    import numpy as np

    from kvserve.semantic_cache.redis_store import RedisStore
    rng, gen = random.Random(0), np.random.default_rng(0)
    stores = [RedisStore(redis_server.url, 8), RedisStore(redis_server.url, 8)]
    live: dict[int, tuple[str, str, np.ndarray]] = {}  # id -> (key, tenant, vector)
    for step in range(300):
        store, op = rng.choice(stores), rng.random()
        key, tenant = rng.choice(["k1", "k2"]), rng.choice(["t1", "t2"])
        if op < 0.5:
            v = gen.standard_normal(8).astype(np.float32)
            v /= np.linalg.norm(v)
            live[store.add(key, tenant, "q", "r", v, 3600, 0.0)] = (key, tenant, v)
        elif op < 0.6 and live:
            n = rng.randint(1, 3)
            assert store.evict_oldest(n) == min(n, len(live))
            for i in sorted(live)[:n]:  # never touched here: the oldest used are the oldest added
                del live[i]
        elif op < 0.65:
            assert store.clear(tenant) == sum(t == tenant for _, t, _ in live.values())
            live = {i: e for i, e in live.items() if e[1] != tenant}
        else:
            q = gen.standard_normal(8).astype(np.float32)
            mine = {i: v for i, (k, _, v) in live.items() if k == key}
            found = store.nearest(key, q, time.time())
            if not mine:
                assert found is None, step
            else:
                assert found is not None and found[0].id == max(mine, key=lambda i: float(mine[i] @ q)), step
        assert store.totals() == (len(live), sum(store_bytes(v) for *_, v in live.values()))
    for s in stores:
        s.close()


def store_bytes(v) -> int:
    return len(b"q") + len(b"r") + v.nbytes
