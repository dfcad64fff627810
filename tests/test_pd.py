"""Disaggregated prefill/decode: --kv-transfer-config parsed as vLLM's KVTransferConfig (start-up
errors naming the bad key or connector), and vLLM's kv_transfer_params handshake as vllm-router's
--vllm-pd-disaggregation drives it, between a kvserve prefill server and a kvserve decode server
sharing a real Redis: the same greedy tokens as one server, the KV read rather than computed, and a
decode server that cannot use the KV (another engine's fingerprint, entries gone) computing the
prompt itself, counted, with the same tokens."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import httpx
import pytest
from helpers import free_port, terminate, wait_until
from server_util import SMALL, start_server

from kvserve.config import ConfigError, EngineArgs, parse_kv_transfer_config


@pytest.mark.parametrize("value, match", [
    ('{"kv_connector": "RedisConnector"', "not valid JSON"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "kv_connector 'NixlConnector' is not available"),
    ('{"kv_role": "kv_both"}', "kv_connector None is not available"),
    ('{"kv_connector": "RedisConnector", "kv_role": "kv_decoder"}', "kv_role must be one of"),
    ('{"kv_connector": "RedisConnector", "kv_role": "kv_both", "kv_rol": 1}', "unknown key kv_rol"),
    ('{"kv_connector": "RedisConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}',
     "kv_load_failure_policy 'fail'"),
    ('{"kv_connector": "RedisConnector", "kv_role": "kv_both", "kv_connector_extra_config": []}',
     "kv_connector_extra_config must be a JSON object"),
])
def test_bad_kv_transfer_configs_name_the_key(value, match):
    with pytest.raises(ConfigError, match=match):
        parse_kv_transfer_config(value)


def test_kv_transfer_config_takes_vllms_keys_and_needs_the_redis_tier():
    config = parse_kv_transfer_config({"kv_connector": "RedisConnector", "kv_role": "kv_producer", "kv_rank": 0,
                                       "kv_parallel_size": 2, "kv_buffer_device": "cpu", "engine_id": "p0"})
    assert config.is_producer and not config.is_consumer and config.engine_id == "p0"
    assert parse_kv_transfer_config('{"kv_connector": "RedisConnector", "kv_role": "kv_both"}').is_consumer
    with pytest.raises(ConfigError, match="add --kv-redis-url"):
        EngineArgs(kv_transfer_config='{"kv_connector": "RedisConnector", "kv_role": "kv_both"}').validate()


ARGS = [*SMALL, "--disable-log-stats", "--block-size", "16"]
PROMPTS = [" ".join(f"{word}{i}" for i in range(120)) for word in ("alpha", "omega", "delta", "sigma")]


def role(name: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "RedisConnector", "kv_role": name})]


@pytest.fixture(scope="module")
def pd(tiny):
    from redis_server import RedisServer
    with RedisServer() as redis:
        tier = ["--kv-redis-url", redis.url]
        started = []
        try:
            started.append(start_server(tiny, *ARGS, *tier, *role("kv_producer")))
            started.append(start_server(tiny, *ARGS, *tier, *role("kv_consumer")))
            yield redis, started[0], started[1]
        finally:
            for s in started:
                s.stop()


def complete(url: str, prompt: str, n: int = 12, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                     "ignore_eos": True, **extra}, timeout=60)


def prefill(producer, prompt: str) -> dict:
    """The router's first call: one token on the prefill server, the KV left in Redis."""
    r = complete(producer.url, prompt, 1, min_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


@pytest.mark.slow
def test_vllm_router_pd_mode_gives_one_servers_tokens_and_the_decode_reads_the_kv(pd):
    redis, producer, consumer = pd
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-router-pd-", suffix=".log", delete=False)
    router = subprocess.Popen(
        [shutil.which("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
         "--prefill", producer.url, "--decode", consumer.url, "--policy", "round_robin",
         "--prometheus-port", str(free_port()), "--worker-startup-timeout-secs", "60",
         "--worker-startup-check-interval", "1", "--request-timeout-secs", "60"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            assert router.poll() is None, open(log.name).read()[-3000:]
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, 60, 0.2, "vllm-router in PD mode")
        prompt = PROMPTS[0]
        expected = complete(producer.url, prompt).json()["choices"][0]["text"]  # one server, no handshake
        through = complete(url, prompt)
        assert through.status_code == 200, through.text
        assert through.json()["choices"][0]["text"] == expected
        chat = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        alone = httpx.post(f"{producer.url}/v1/chat/completions", json=chat, timeout=60).json()
        routed = httpx.post(f"{url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in routed.text.splitlines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert text == alone["choices"][0]["message"]["content"]
        # the decode server read both prompts' KV rather than computing it
        assert consumer.metric("kvserve:kv_transfer_requests_total", role="consumer", outcome="loaded") == 2, [
            (k, v) for k, v in consumer.metrics().items() if "kv_transfer" in k or "by_tier" in k]
        assert producer.metric("kvserve:kv_transfer_requests_total", role="producer", outcome="sent") == 2
        assert consumer.metric("kvserve:prefix_cache_hits_by_tier_total", tier="redis") >= 2 * 16 * 16
        assert consumer.metric("kvserve:kv_transfer_recomputed_tokens_total") == 0
        for s in (producer, consumer):  # no blocks leaked on either side
            wait_until(lambda: s.metric("kvserve:kv_blocks_used") == 0, 30, 0.2, "blocks to be free")
    finally:
        terminate(router)
        os.unlink(log.name)


@pytest.mark.slow
def test_a_decode_server_refuses_another_models_kv_and_recomputes(pd, tmp_path_factory):
    from tiny_models import make_tiny_model
    redis, producer, consumer = pd
    other_model = make_tiny_model(tmp_path_factory.mktemp("other"), kind="llama_gqa", seed=1)
    other = start_server(str(other_model), *ARGS, "--kv-redis-url", redis.url, *role("kv_producer"))
    try:
        params = prefill(other, PROMPTS[2])  # its KV, in the same Redis, under its own fingerprint
    finally:
        other.stop()
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] > 0
    r = complete(consumer.url, PROMPTS[2], kv_transfer_params=params)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == complete(producer.url, PROMPTS[2]).json()["choices"][0]["text"]
    assert consumer.metric("kvserve:kv_transfer_requests_total", role="consumer", outcome="refused") == 1
    assert consumer.metric("kvserve:kv_transfer_recomputed_tokens_total") >= params["remote_num_tokens"] - 16
    assert "is not this engine's" in consumer.log()


@pytest.mark.slow
def test_a_decode_server_that_finds_no_kv_recomputes_the_prompt(pd):
    redis, producer, consumer = pd
    params = prefill(producer, PROMPTS[3])
    import redis as redis_client
    redis_client.Redis.from_url(redis.url).flushall()  # evicted (or the producer's Redis gone) before the decode
    before = consumer.metric("kvserve:kv_transfer_recomputed_tokens_total")
    r = complete(consumer.url, PROMPTS[3], kv_transfer_params=params)  # the router's second call
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == complete(producer.url, PROMPTS[3]).json()["choices"][0]["text"]
    assert consumer.metric("kvserve:kv_transfer_requests_total", role="consumer", outcome="recomputed") == 1
    assert consumer.metric("kvserve:kv_transfer_recomputed_tokens_total") - before >= params["remote_num_tokens"] - 16


@pytest.mark.slow
def test_handshake_errors_name_the_field(pd):
    _, producer, consumer = pd
    wrong_role = complete(consumer.url, "hi", kv_transfer_params={"do_remote_decode": True})
    assert wrong_role.status_code == 400 and "kv_role is kv_consumer" in wrong_role.json()["error"]["message"]
    bad = complete(consumer.url, "hi", kv_transfer_params={"do_remote_prefill": True, "remote_num_tokens": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params.remote_num_tokens"
    streamed = complete(producer.url, "hi", stream=True, kv_transfer_params={"do_remote_decode": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def _both(tiny: str, redis_url: str, tp: int, kv_cache_dtype: str = "auto"):
    from kvserve import LLM
    return LLM(tiny, dtype="float32", block_size=16, max_model_len=512, kv_redis_url=redis_url,
               tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype,
               kv_transfer_config={"kv_connector": "RedisConnector", "kv_role": "kv_both"}).llm_engine


def _run(engine, rid: str, prompt, **transfer):
    from helpers import greedy
    engine.add_request(rid, prompt, greedy(6, kv_transfer_params=transfer or None))
    outs = []
    for _ in range(300):
        outs += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            return outs[-1]
    raise AssertionError("did not finish")


@pytest.mark.slow
def test_the_decode_side_reads_remote_kv_off_the_step_and_aborts_cleanly(tiny, redis_server):
    import threading

    from helpers import greedy, rand_prompts

    engine = _both(tiny, redis_server.url, 1)
    prompt = rand_prompts(3, [200], 1000)[0]
    alone = _run(engine, "plain", prompt)
    assert engine.reset_prefix_cache()
    _run(engine, "prefill", prompt, do_remote_decode=True)  # the prompt's blocks written to Redis
    assert engine.reset_prefix_cache()  # the device copy gone: the decode must read Redis
    readers = []
    fetch = engine.kv_tiers.fetch
    engine.kv_tiers.fetch = lambda *a, **k: readers.append(threading.current_thread().name) or fetch(*a, **k)
    decoded = _run(engine, "decode", prompt, do_remote_prefill=True)
    assert decoded.outputs[0].token_ids == alone.outputs[0].token_ids
    assert decoded.num_cached_tokens == 192  # 12 blocks; the 13th holds the last prompt token
    assert readers and all(name.startswith("kvserve-kv-load") for name in readers), readers
    # aborted while its read is in flight: nothing is left behind, the read's result is dropped
    assert engine.reset_prefix_cache()
    engine.add_request("gone", prompt, greedy(6, kv_transfer_params={"do_remote_prefill": True}))
    assert "gone" in engine._loading
    engine.abort_request("gone")
    assert not engine.has_unfinished_requests() and not engine._loading
    for _ in range(3):
        engine.step()
    engine.kv.check_integrity()
    assert not engine.scheduler.has_unfinished_requests()


# -- with tensor parallelism: an entry holds every rank's heads, the fingerprint names the rank count --

@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tp2_prefill_and_decode_move_every_ranks_heads_and_tp1_never_reads_them(tiny, redis_server, kv_cache_dtype):
    """At TP=2 the export reads each prompt block from both ranks (one entry, both ranks' heads,
    codes and scales with quantized KV); the decode side's threaded read restores every byte of it
    to the rank it came from, and the tokens are TP=1's in fp32. A TP=1 engine (another
    fingerprint) on the same Redis finds none of those entries and computes the prompt."""
    import threading

    import torch
    from helpers import rand_prompts
    prompt = rand_prompts(3, [200], 1000)[0]
    tp1 = _both(tiny, redis_server.url, 1, kv_cache_dtype)
    tp2 = _both(tiny, redis_server.url, 2, kv_cache_dtype)
    try:
        alone = _run(tp1, "plain", prompt)
        offloader, written = tp2.kv_offloader, {}
        persist = offloader.persist

        def snapshot(blocks, **kw):  # what the export reads: every rank's fields of each block
            data = offloader.kv_cache.read_blocks(torch.tensor([b.block_id for b in blocks]))
            written.update({b.key: [t[j].clone() for t in data] for j, b in enumerate(blocks)})
            return persist(blocks, **kw)
        offloader.persist = snapshot
        _run(tp2, "prefill", prompt, do_remote_prefill=False, do_remote_decode=True)
        assert len(written) == 12, len(written)  # the 13th block holds the last prompt token
        own = len(tp2.runner._runner.kv_cache.read_blocks(torch.tensor([0])))
        assert len(next(iter(written.values()))) == 2 * own  # rank 0's fields, then rank 1's
        assert tp2.reset_prefix_cache()  # the pool's copy gone: the decode must read Redis

        restored, readers, apply, fetch = {}, [], offloader.apply, tp2.kv_tiers.fetch

        def check(out):
            apply(out)
            if out.kv_restores:
                data = offloader.kv_cache.read_blocks(torch.tensor([r.block_id for r in out.kv_restores]))
                restored.update({r.stored_key: [t[j].clone() for t in data] for j, r in enumerate(out.kv_restores)})
        offloader.apply = check
        tp2.kv_tiers.fetch = lambda *a, **k: readers.append(threading.current_thread().name) or fetch(*a, **k)
        decoded = _run(tp2, "decode", prompt, do_remote_prefill=True)
        assert decoded.outputs[0].token_ids == alone.outputs[0].token_ids
        assert decoded.num_cached_tokens == 192
        assert readers and all(name.startswith("kvserve-kv-load") for name in readers), readers
        assert restored.keys() == written.keys()
        for key, fields in written.items():  # both ranks' pools hold the producer's bytes again
            assert all(torch.equal(a, b) for a, b in zip(restored[key], fields, strict=True))
        tp2.kv.check_integrity()

        assert tp1.reset_prefix_cache()
        other = _run(tp1, "decode-tp1", prompt, do_remote_prefill=True)
        assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == alone.outputs[0].token_ids
        assert tp1.get_stats().tier_hits.get("redis", 0) == 0
    finally:
        tp2.close()
        tp1.close()


@pytest.mark.slow
def test_vllm_router_drives_tp2_servers_and_a_tp1_decode_server_refuses_their_kv(tiny):
    """A TP=2 prefill server and a TP=2 decode server behind vllm-router: the decode server loads
    every block the prefill server wrote and the tokens are a TP=1 server's (fp32). The same
    prefill's KV handed to a TP=1 decode server is refused by its fingerprint, counted, computed:
    the same tokens."""
    from redis_server import RedisServer
    with RedisServer() as redis:
        tier = ["--kv-redis-url", redis.url]
        started, router, log = [], None, None
        try:
            producer = start_server(tiny, *ARGS, *tier, *role("kv_producer"), "-tp", "2")
            started.append(producer)
            consumer = start_server(tiny, *ARGS, *tier, *role("kv_consumer"), "-tp", "2")
            started.append(consumer)
            tp1 = start_server(tiny, *ARGS, *tier, *role("kv_consumer"))
            started.append(tp1)
            port = free_port()
            log = tempfile.NamedTemporaryFile(prefix="vllm-router-pd-tp-", suffix=".log", delete=False)
            router = subprocess.Popen(
                [shutil.which("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                 "--prefill", producer.url, "--decode", consumer.url, "--policy", "round_robin",
                 "--prometheus-port", str(free_port()), "--worker-startup-timeout-secs", "60",
                 "--worker-startup-check-interval", "1", "--request-timeout-secs", "60"],
                stdout=log, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"

            def ready():
                assert router.poll() is None, open(log.name).read()[-3000:]
                try:
                    return httpx.get(f"{url}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False
            wait_until(ready, 60, 0.2, "vllm-router in PD mode")
            expected = complete(tp1.url, PROMPTS[0]).json()["choices"][0]["text"]  # TP=1, no handshake
            through = complete(url, PROMPTS[0])
            assert through.status_code == 200, through.text
            assert through.json()["choices"][0]["text"] == expected
            assert consumer.metric("kvserve:kv_transfer_requests_total", role="consumer", outcome="loaded") == 1
            assert consumer.metric("kvserve:kv_transfer_recomputed_tokens_total") == 0
            assert consumer.metric("kvserve:prefix_cache_hits_by_tier_total", tier="redis") > 0

            params = prefill(producer, PROMPTS[1])
            assert params["tp_size"] == 2 and params["remote_num_tokens"] > 0
            refused = complete(tp1.url, PROMPTS[1], kv_transfer_params=params)
            assert refused.status_code == 200, refused.text
            assert refused.json()["choices"][0]["text"] == complete(consumer.url, PROMPTS[1]).json()["choices"][0]["text"]
            assert tp1.metric("kvserve:kv_transfer_requests_total", role="consumer", outcome="refused") == 1
            assert tp1.metric("kvserve:kv_transfer_recomputed_tokens_total") >= params["remote_num_tokens"] - 16
            assert tp1.metric("kvserve:prefix_cache_hits_by_tier_total", tier="redis") == 0
            assert "--tensor-parallel-size 2, this one 1" in tp1.log()
        finally:
            if router is not None:
                terminate(router)
            if log is not None:
                os.unlink(log.name)
            for s in started:
                s.stop()
