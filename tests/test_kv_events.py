"""KV cache events in vLLM's schema: the event stream mirrors the cache's index exactly (a
subscriber that replays it holds the same set of block hashes as the pool after every step),
parents chain, tenant salts never appear, bad configurations fail at start-up naming the key, and
a plain msgpack + ZMQ subscriber (written against vLLM's documented schema, not our code) reads a
running server's events and replays missed ones."""
from __future__ import annotations

import json

import httpx
import msgpack
import pytest
import zmq
from helpers import free_port, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import SMALL, start_server
from test_scheduler_accounting import VOCAB, step

from kvserve.config import ConfigError, EngineArgs, SchedulerConfig, parse_kv_events_config
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.kv_events import encode_batch, offset_endpoint
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSink
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner


class Index:
    """What a KV-aware router keeps: the block hashes a server holds, from its events alone."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, BlockStored] = {}
        self.ever: set[bytes] = set()

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    assert h not in self.blocks, "a block stored twice without a removal between"
                    # A parent may be gone by now (a running request computed its own copy of an
                    # indexed block, which was evicted since), but it was announced once.
                    assert e.parent_block_hash is None or e.parent_block_hash in self.ever, "parent never stored"
                    self.blocks[h] = e
                    self.ever.add(h)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.blocks, "a block removed that was never stored"
                    del self.blocks[h]
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()


def make(num_blocks, block_size, events):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True, events=events)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=num_blocks * block_size)
    return Scheduler(cfg, kv), CostModelRunner(vocab_size=VOCAB)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), st.integers(1, 8),
                                  st.sampled_from([None, "tenant-a", "tenant-b"])), min_size=1, max_size=12),
       num_blocks=st.integers(11, 24), block_size=st.sampled_from([2, 4]), reset_at=st.integers(0, 40))
def test_the_event_stream_mirrors_the_pool_index(prompts, num_blocks, block_size, reset_at):
    sink = KVEventSink()
    sched, runner = make(num_blocks, block_size, sink)
    index = Index()
    for i, (prompt, max_tokens, salt) in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  cache_salt=salt))
    for n in range(2000):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
        index.apply(sink.drain())
        assert set(index.blocks) == set(sched.kv.pool.cached), "events and the pool's index disagree"
        for h, e in index.blocks.items():  # what a subscriber learned is what the block holds
            assert e.token_ids == sched.kv.pool.cached[h].token_ids and e.medium == "GPU"
            assert e.block_size == block_size
    if n >= reset_at and sched.kv.reset_prefix_cache():
        index.apply(sink.drain())
        assert not index.blocks and not sched.kv.pool.cached


def test_first_blocks_have_no_parent_and_salts_never_appear():
    sink = KVEventSink()
    sched, runner = make(32, 4, sink)
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    for rid, salt in (("plain", None), ("salted", "SECRET-SALT-of-tenant-a")):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt))
    while sched.has_unfinished_requests():
        step(sched, runner)
    stored = [e for e in sink.drain() if isinstance(e, BlockStored)]
    firsts = [e for e in stored if e.parent_block_hash is None]
    assert len(firsts) == 2 and firsts[0].block_hashes != firsts[1].block_hashes  # salted: its own chain
    assert all(len(h) == 32 for e in stored for h in e.block_hashes)
    wire = encode_batch(stored, 0)
    assert b"SECRET-SALT" not in wire and b"tenant" not in wire


@pytest.mark.parametrize("value, match", [
    ("{not json", "not valid JSON"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "unknown key endpont"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka'"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "not a ZMQ endpoint"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_kv_events_configs_name_the_key(value, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(kv_events_config=value).validate()


def test_kv_events_config_defaults_are_vllms():
    c = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, "")
    assert not parse_kv_events_config("{}").publishing
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("ipc:///tmp/e", 1) == "ipc:///tmp/e_dp1"


@pytest.mark.slow
def test_a_plain_msgpack_subscriber_reads_and_replays_a_servers_events(tmp_path):
    replay_port = free_port()
    # An ipc:// endpoint binds (vLLM's rule for local endpoints) and reaches no network.
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    server = start_server(*SMALL, "--disable-log-stats", "--block-size", "16", "--kv-events-config", json.dumps(config))
    try:
        def complete(prompt: str) -> list[int]:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={"prompt": prompt, "max_tokens": 2,
                                                                              "temperature": 0})
            assert r.status_code == 200, r.text
            return httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]

        # A PUB socket applies a new subscription when it next sends, so a subscriber may miss
        # the first batch: it sees the gap in the sequence numbers and asks the replay socket,
        # as vLLM's example subscriber does.
        first = complete("The subscriber learns which blocks this server holds. " * 6)
        second = complete("A second prompt, whose batches arrive live on the subscription. " * 5)
        live = []

        def second_prompt_seen():
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv" and len(seq) == 8
                live.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
            return any(e["type"] == "BlockStored" and e["token_ids"] == second[:16] for _, b in live for e in b[1])
        wait_until(second_prompt_seen, 30, what="the second prompt's first block on the subscription")

        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(10_000), "no replay answer within 10 s"
            _, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
        replay.close(0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))  # every batch from sequence 0
        assert all(b in replayed for b in live)  # the live ones among them, byte for byte

        ts, events, rank = replayed[0][1]
        assert isinstance(ts, float) and rank == 0
        stored = [e for _, b in replayed for e in b[1] if e["type"] == "BlockStored"]
        head = next(e for e in stored if e["token_ids"] == first[:16])
        assert set(head) >= {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
        assert head["parent_block_hash"] is None and head["medium"] == "GPU" and head["block_size"] == 16
        assert len(head["block_hashes"][0]) == 32
        chain = [head]
        for k in range(1, len(first) // 16):  # the prompt's full blocks, chained by parent hash
            nxt = next(e for e in stored if e["parent_block_hash"] == chain[-1]["block_hashes"][0])
            assert nxt["token_ids"] == first[16 * k:16 * (k + 1)]
            chain.append(nxt)
    finally:
        server.stop()
        sub.close(0)
        ctx.term()


def test_host_and_disk_tiers_announce_stores_and_evictions(tmp_path):
    """Blocks written to a tier and dropped from it (LRU eviction, delete), under its medium;
    a swap entry (one request's own, not a chain hash) is never announced."""
    from test_tiers import FP

    from kvserve.kv.tiers.disk import DiskTier
    from kvserve.kv.tiers.host import HostTier
    payload = bytes(1000)
    for tier, medium in ((HostTier(FP, 2500), "CPU"), (DiskTier(FP, tmp_path / "kv", 2500), "STORAGE")):
        sink = KVEventSink()
        tier.events, tier.block_size = sink, 16
        keys = [bytes([i]) * 32 for i in range(3)]
        for i, k in enumerate(keys):
            assert tier.put(k, payload, list(range(i, i + 16)))
        assert tier.put(b"swap:r1:0:0", payload)  # not a block hash: stored, not announced
        assert tier.delete(keys[2])
        events = sink.drain()
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert [e.block_hashes[0] for e in stored] == keys and {e.medium for e in stored} == {medium}
        assert stored[1].token_ids == list(range(1, 17)) and stored[0].parent_block_hash is None
        assert keys[0] in removed and keys[1] in removed and keys[2] in removed  # evicted, evicted, deleted
        assert all(len(h) == 32 for h in removed)
        tier.close()
