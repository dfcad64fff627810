"""Pinned prefixes through a real server: the admin routes, their refusals, tenant isolation, a
flood that overflows the pool, the gauges, a tenant's default retention on its blocks, and a
restart on the same disk tier."""
from __future__ import annotations

import json
import random
import signal

import httpx
import pytest
from server_util import start_server

pytestmark = pytest.mark.slow

# 34 blocks of 16 tokens (SmolLM2-135M, float32: 720 KiB a block): a few prompts overflow it.
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "24MiB", "--disable-log-stats"]
KEYS = [{"key": "k-admin", "tenant": "premium", "admin": True},
        {"key": "k-user", "tenant": "premium"},
        {"key": "k-other", "tenant": "other", "admin": True},
        {"key": "k-free", "tenant": "free", "cache_retention": {"priority": 10}}]


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


SYSTEM = ids(1, 100)  # 6 full blocks


def call(server, method: str, path: str, key: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {key}"})


def complete(server, key: str, prompt: list[int]) -> dict:
    r = call(server, "POST", "/v1/completions", key, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached(server, key: str, prompt: list[int]) -> int:
    return complete(server, key, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


def test_pins_admin_routes_isolation_cap_pressure_and_a_tenants_default_retention(keys_file):
    server = start_server(*ARGS, "--api-keys-file", keys_file)
    try:
        r = call(server, "POST", "/v1/cache/pins", "k-user", {"prompt_token_ids": SYSTEM})
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"], r.text
        for body, param in (({"prompt": ""}, "prompt"), ({"prompt_token_ids": []}, "prompt_token_ids"),
                            ({}, "prompt"), ({"prompt_token_ids": [1, 2, 3]}, "prompt")):
            r = call(server, "POST", "/v1/cache/pins", "k-admin", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = call(server, "POST", "/v1/cache/pins", "k-admin", {"prompt_token_ids": SYSTEM})
        assert r.status_code == 200, r.text
        pin = r.json()
        assert pin["status"] == "pinned" and pin["num_blocks"] == 6 and pin["num_tokens"] == 100
        assert server.metric("kvserve:kv_cache_pinned_blocks") == 6
        assert server.metric("kvserve:kv_cache_pinned_bytes") == pin["bytes"]
        # The cap (half the pool by default): 6 blocks held, 12 more do not fit.
        r = call(server, "POST", "/v1/cache/pins", "k-admin", {"prompt_token_ids": ids(2, 200)})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_pinned_kv_bytes", r.text
        assert f"but {pin['bytes']} bytes are already pinned and --max-pinned-kv-bytes is" in err["message"]
        # Tenants: another admin sees none of it; the premium tenant's user key is no admin.
        assert call(server, "GET", "/v1/cache/pins", "k-other").json()["data"] == []
        assert call(server, "GET", f"/v1/cache/pins/{pin['id']}", "k-other").status_code == 404
        assert call(server, "DELETE", f"/v1/cache/pins/{pin['id']}", "k-other").status_code == 404
        assert call(server, "GET", "/v1/cache/pins", "k-user").status_code == 403
        assert [p["id"] for p in call(server, "GET", "/v1/cache/pins", "k-admin").json()["data"]] == [pin["id"]]
        assert call(server, "DELETE", "/v1/cache/pins/pin-nope", "k-admin").status_code == 404
        # A flood of unique prompts (the free tenant, its default retention priority 10) overflows
        # the pool; the pinned prefix stays, for the premium tenant only.
        for i in range(8):
            complete(server, "k-free", ids(100 + i, 200))
        assert server.metric("kvserve:kv_cache_evictions_total", retention_class="low") > 0
        assert cached(server, "k-user", SYSTEM + [7, 8, 9]) >= 96
        assert cached(server, "k-other", SYSTEM + [7, 8, 9]) == 0
        r = call(server, "DELETE", f"/v1/cache/pins/{pin['id']}", "k-admin")
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert server.metric("kvserve:kv_cache_pinned_blocks") == 0
    finally:
        server.stop()


def test_a_pin_survives_a_restart_on_the_same_disk_tier(keys_file, tmp_path):
    disk = str(tmp_path / "kv")
    args = [*ARGS, "--api-keys-file", keys_file, "--kv-disk-path", disk]
    first = start_server(*args)
    try:
        pin = call(first, "POST", "/v1/cache/pins", "k-admin", {"prompt_token_ids": SYSTEM}).json()
        assert pin["status"] == "pinned", pin
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        first.stop()
    second = start_server(*args)
    try:
        [again] = call(second, "GET", "/v1/cache/pins", "k-admin").json()["data"]
        assert again["id"] == pin["id"] and again["status"] == "pinned" and again["num_blocks"] == 6
        assert second.metric("kvserve:prefix_cache_hits_by_tier_total", tier="disk") == 96  # read back
        assert cached(second, "k-user", SYSTEM + [7, 8, 9]) >= 96  # the first request hits it
    finally:
        second.stop()
