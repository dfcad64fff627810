"""GET /dashboard and /dashboard/data: bad parameters are 400s naming the parameter; the data is
behind the API key and shows a tenant its own prefixes' text and only counts for the others; the
figures match /metrics; the page works under --root-path; --disable-dashboard removes it."""
from __future__ import annotations

import json

import httpx
import pytest
from server_util import start_server

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.snapshot import CACHED, FREE, PINNED, SHARED, STATES, USED, block_map, prefix_tree
from kvserve.server.dashboard import parse_params
from kvserve.server.protocol import APIError

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE_PROMPT = "Alice keeps a private system prompt about zebras in the cache. " * 3


@pytest.mark.parametrize("query, param", [({"cells": "0"}, "cells"), ({"cells": "lots"}, "cells"),
                                          ({"top": "99"}, "top"), ({"since": "nan"}, "since"),
                                          ({"since": "-1"}, "since"), ({"engine": "2"}, "engine"),
                                          ({"bogus": "1"}, "bogus")])
def test_bad_query_parameters_are_refused_naming_the_parameter(query, param):
    with pytest.raises(APIError) as e:
        parse_params(query)
    assert e.value.status == 400 and e.value.param == param and f"`{param}`" in str(e.value)


def test_block_map_aggregates_a_large_pool_into_few_cells():
    pool = BlockPool(100_000, 16)
    a, b = pool.allocate(), pool.allocate()
    pool.touch(b)  # b now has two users
    pool.record_tokens(a, b"root", [1] * 16)
    pool.free([a])  # a: cached, evictable
    m = block_map(pool, 1024)
    assert m["cells"] <= 1024 and len(m["counts"]) == STATES * m["cells"] and m["states"] == STATES
    totals = [sum(m["counts"][s::STATES]) for s in range(STATES)]
    assert totals[FREE] == 100_000 - 2 and totals[CACHED] == 1 and totals[USED] == 0 and totals[SHARED] == 1
    assert totals[PINNED] == 0


def test_block_map_shows_a_block_held_by_a_pin_alone_as_pinned():
    from kvserve.kv.pins import PinTable
    pool = BlockPool(8, 4)
    pins = PinTable(pool)
    a, b = pool.allocate(), pool.allocate()
    for i, blk in enumerate((a, b)):
        pool.record_tokens(blk, b"root", [i] * 4)
        pool.cache_full_block(blk, bytes([i]) * 32)
    pins.pin("p", None, [a, b])
    pool.free([a, b])  # the request ends: the pin alone holds both
    pool.touch(b)  # a new request reads b beside the pin

    def totals():
        m = block_map(pool, 8, pins.owners())
        return [sum(m["counts"][s::STATES]) for s in range(STATES)]
    assert totals()[PINNED] == 1 and totals()[USED] == 1 and totals()[FREE] == 6
    pool.free([b])
    assert totals()[PINNED] == 2 and totals()[USED] == 0
    pins.unpin("p")
    assert totals()[PINNED] == 0 and totals()[CACHED] == 2


def test_prefix_tree_shows_own_tokens_and_only_counts_of_others():
    pool = BlockPool(64, 4)
    parent = None
    for i, root in ((0, b"mine"), (1, b"mine"), (2, b"theirs")):
        blk = pool.allocate()
        if root == b"mine" and parent is not None:
            pool.record_tokens(blk, parent.block_hash, [10 + i] * 4)
        else:
            pool.record_tokens(blk, root, [10 + i] * 4)
        pool.cache_full_block(blk, bytes([i]) * 32)
        parent = blk
    tree = prefix_tree(pool, {b"mine"})
    assert len(tree["prefixes"]) == 1
    node = tree["prefixes"][0]
    assert node["blocks"] == 2 and node["tokens"] == 8 and node["token_ids"] == [10] * 4 + [11] * 4
    assert tree["others"] == {"tenants": 1, "prefixes": 1, "blocks": 1, "hits": 0}
    assert "12" not in json.dumps(tree["prefixes"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    handle = start_server("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                          "--api-keys-file", str(keys), "--root-path", "/kv", "--disable-log-stats")
    yield handle
    handle.stop()


def _data(server, key, **params):
    return httpx.get(f"{server.url}/dashboard/data", params=params, timeout=30,
                     headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.mark.slow
def test_dashboard_behind_the_key_tenant_safe_and_true_to_metrics(server):
    page = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert page.status_code == 200 and "<canvas" in page.text
    # no absolute URL and nothing from elsewhere: works under --root-path, needs no internet
    assert '"/dashboard' not in page.text and "http://" not in page.text and "https://" not in page.text
    assert _data(server, None).status_code == 401
    bad = _data(server, "key-alice", cells="many")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cells"
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer key-alice"}, timeout=120,
                   json={"prompt": ALICE_PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    alice = _data(server, "key-alice").json()
    bob = _data(server, "key-bob").json()
    metrics = server.metrics()
    for key, name in (("blocks_total", "kvserve:kv_blocks_total"), ("blocks_cached", "kvserve:kv_blocks_cached"),
                      ("blocks_used", "kvserve:kv_blocks_used")):
        assert alice["now"][key] == next(v for k, v in metrics.items() if k.startswith(name + "{")), key
    cells = alice["engine"]["block_map"]["counts"]
    assert sum(cells[CACHED::STATES]) == alice["now"]["blocks_cached"] > 0
    assert sum(cells[PINNED::STATES]) == alice["now"]["blocks_pinned"] == 0
    assert "zebras" in json.dumps(alice["engine"]["prefix_tree"]["prefixes"])
    assert "zebras" not in json.dumps(bob) and "token_ids" not in json.dumps(bob)
    assert bob["engine"]["prefix_tree"]["prefixes"] == []
    assert bob["engine"]["prefix_tree"]["others"]["tenants"] == 1
    assert bob["engine"]["prefix_tree"]["others"]["blocks"] >= alice["engine"]["prefix_tree"]["own_blocks"] > 0
    assert alice["series"]["t"], "no samples from the steps"
    # the JS polls with since=<last sample>: only newer samples come back
    later = _data(server, "key-alice", since=alice["series"]["t"][-1], engine=0).json()
    assert later["series"]["t"] == [] and later["engine"] is None


@pytest.mark.slow
def test_disable_dashboard_removes_it():
    handle = start_server("--max-model-len", "128", "--num-gpu-blocks-override", "16", "--disable-dashboard",
                          "--disable-log-stats")
    try:
        assert httpx.get(f"{handle.url}/dashboard", timeout=10).status_code == 404
        assert httpx.get(f"{handle.url}/dashboard/data", timeout=10).status_code == 404
    finally:
        handle.stop()
