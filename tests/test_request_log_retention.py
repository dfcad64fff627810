"""The request log carries each request's effective cache_retention (a tenant's default applied) and
the prompt tokens it wrote to the cache; `kvserve simulate` replays a log with the logged retention."""
from __future__ import annotations

import json
import random

import httpx
import pytest
from helpers import wait_until
from server_util import SMALL, start_server

from kvserve.core.request_log import REQUEST_LOG_KEYS, format_request_log_record
from kvserve.tools import simulate as sim
from kvserve.tools.workload import trace_from_request_log


def test_record_carries_retention_and_writes_and_checks_them():
    line = json.loads(format_request_log_record(
        request_id="r", prompt_tokens=40, output_tokens=2, cached_tokens=0, ttft=0.1, e2e=0.2,
        finish_reason="length", cache_write_tokens=32, cache_retention={"priority": 90}))
    assert line["cache_write_tokens"] == 32 and line["cache_retention"] == {"priority": 90, "ttl_s": None}
    assert set(line) <= set(REQUEST_LOG_KEYS)
    for bad, needle in (({"cache_write_tokens": -1}, "cache_write_tokens"),
                        ({"cache_retention": {"priority": 500}}, "cache_retention.priority")):
        with pytest.raises(ValueError, match=needle):
            format_request_log_record(request_id="r", prompt_tokens=40, output_tokens=2, cached_tokens=0, ttft=0.1,
                                      e2e=0.2, finish_reason="length", **bad)


def two_tenant_log(path, retained: bool) -> None:
    """The trace of test_retention's simulate test, as a request log: a 160-token premium prompt
    at priority 90 between bursts of four unique 120-token free prompts at 10, 1 s apart."""
    rng = random.Random(0)
    system = [rng.randrange(100, 1000) for _ in range(160)]
    with open(path, "w") as f:
        for i in range(12):
            rows = [(f"p{i}", system + [1000 + i], {"priority": 90, "ttl_s": 600}, 1000.0 + i)]
            rows += [(f"f{i}-{j}", [rng.randrange(100, 1000) for _ in range(120)], {"priority": 10},
                      1000.0 + i + 0.1 + 0.01 * j) for j in range(4)]
            for rid, ids, ret, start in rows:
                f.write(format_request_log_record(
                    request_id=rid, prompt_tokens=len(ids), output_tokens=2, cached_tokens=0, ttft=0.01, e2e=0.02,
                    finish_reason="length", prompt_token_ids=ids, time=start + 0.02,
                    cache_retention=ret if retained else {"priority": 50}) + "\n")


def test_simulate_replays_the_logged_retention(tmp_path):
    rates = {}
    for retained in (True, False):
        log = tmp_path / f"requests-{retained}.jsonl"
        two_tenant_log(log, retained)
        trace = trace_from_request_log(str(log))
        by_id = {c.conversation_id.split("@")[0]: c.cache_retention for c in trace.conversations}
        if retained:
            assert by_id["p3"] == {"priority": 90, "ttl_s": 600.0} and by_id["f3-1"] == {"priority": 10, "ttl_s": None}
        else:
            assert set(by_id.values()) == {None}  # the default: replayed as LRU
        res = sim.simulate(trace, sim.SimConfig(block_size=16, num_blocks=40), 256, check_integrity=True)
        assert res.error is None and res.num_requests == 60
        rates[retained] = res.prefix_hit_rate
    every_premium_hit = 11 * 160 / (12 * 161 + 48 * 120)
    assert rates[True] >= every_premium_hit > 1.1 * rates[False]


def test_a_malformed_logged_retention_replays_as_the_default_with_a_note(tmp_path):
    log = tmp_path / "requests.jsonl"
    good = json.loads(format_request_log_record(request_id="r", prompt_tokens=3, output_tokens=2, cached_tokens=0,
                                                ttft=0.1, e2e=0.2, finish_reason="length", prompt_token_ids=[1, 2, 3]))
    log.write_text(json.dumps({**good, "cache_retention": {"priority": "high"}}) + "\n")
    trace = trace_from_request_log(str(log))
    assert trace.conversations[0].cache_retention is None
    assert any("malformed cache_retention" in n for n in trace.notes)


@pytest.mark.slow
def test_server_logs_the_effective_retention_and_writes_and_simulate_replays_them(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": "k-premium", "tenant": "premium", "cache_retention": {"priority": 90}},
                                {"key": "k-free", "tenant": "free"}]))
    log = tmp_path / "requests.jsonl"
    srv = start_server(*SMALL, "--request-log", str(log), "--api-keys-file", str(keys))
    try:
        def complete(key: str, prompt: str, **extra) -> dict:
            r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                           json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        text = "Gears, brakes, tyres, chains and saddles. " * 6
        usages = [complete("k-premium", text),  # the tenant's default
                  complete("k-premium", text + "Why?", cache_retention={"priority": 20, "ttl_s": 30}),  # its own
                  complete("k-free", "Hello there, " * 10)]  # no default: priority 50
        lines = wait_until(lambda: len(lines := log.read_text().splitlines()) == 3 and lines, 30,
                           what="3 request-log lines")
    finally:
        srv.stop()
    records = [json.loads(line) for line in lines]
    assert [r["cache_retention"] for r in records] == [
        {"priority": 90, "ttl_s": None}, {"priority": 20, "ttl_s": 30.0}, {"priority": 50, "ttl_s": None}]
    assert [r["cache_write_tokens"] for r in records] == \
        [u["prompt_tokens_details"]["cache_write_tokens"] for u in usages]
    assert records[0]["cache_write_tokens"] > 0
    trace = trace_from_request_log(str(log))
    assert [c.cache_retention for c in trace.conversations] == [
        {"priority": 90, "ttl_s": None}, {"priority": 20, "ttl_s": 30.0}, None]
