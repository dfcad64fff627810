"""`kvserve simulate`: its block accounting equals the real engine's on the same trace.

The engine runs a tiny random Llama (real weights, real ModelRunner); the simulator runs the same
trace through the same Scheduler/KVCacheManager with the cost model. With ignore_eos and fixed
max_tokens the output lengths agree, so prefix-cache queries/hits, preemptions and the blocks in
use after every step must agree exactly.
"""
from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model

from kvserve.config import EngineArgs
from kvserve.core.request_log import format_request_log_record
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.tools import simulate as sim
from kvserve.tools.workload import LengthDist, WorkloadSpec, synthetic_trace, trace_from_request_log

BLOCK = 16
NUM_BLOCKS = 40
MAX_MODEL_LEN = 400
BATCH_TOKENS = 96


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), kind="llama_gqa")


def small_trace(seed: int = 1):
    # 8 two-turn conversations, 6 sharing a 40-token prefix (2.5 blocks: the partial-block path),
    # all arriving at once into a 40-block pool: chunked prefill, prefix hits and preemptions.
    return synthetic_trace(WorkloadSpec(
        num_conversations=8, prompt_len=LengthDist.parse("20:90", "p"), output_len=LengthDist.parse("10:40", "o"),
        shared_prefix_fraction=0.75, prefix_len=40, num_turns=2, seed=seed))


def run_engine(path, trace, max_num_seqs: int = 8):
    """Drive LLMEngine like the simulator: all first turns at once, a conversation's next turn
    (prompt + answer + new user tokens) right after its answer finishes."""
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu", block_size=BLOCK,
                                  num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=BATCH_TOKENS,
                                  check_integrity=True, disable_log_stats=True))
    used_per_step: list[int] = []
    update = engine.scheduler.update_from_output

    def recording(sched_out, result):  # the engine's own step, observed after each runner call
        touched = update(sched_out, result)
        used_per_step.append(engine.kv.pool.num_used_blocks)
        return touched

    engine.scheduler.update_from_output = recording
    convs = {c.conversation_id: c for c in trace.conversations}
    answers = {cid: [] for cid in convs}

    def add(cid, k, prompt):
        params = SamplingParams(max_tokens=convs[cid].turns[k].output_len, ignore_eos=True, temperature=0.0)
        engine.add_request(sim.turn_request_id(cid, k), prompt, params, priority=convs[cid].priority)

    for c in trace.conversations:
        add(c.conversation_id, 0, c.first_prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            cid, k = out.request_id.rsplit("/t", 1)
            k = int(k)
            answer = out.outputs[0].token_ids
            assert len(answer) == convs[cid].turns[k].output_len
            answers[cid].append(list(answer))
            if k + 1 < len(convs[cid].turns):
                add(cid, k + 1, list(out.prompt_token_ids) + list(answer) + convs[cid].turns[k + 1].user_token_ids)
    return engine.get_stats(), used_per_step, answers


def sim_config(max_num_seqs: int = 8) -> sim.SimConfig:
    return sim.SimConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=BATCH_TOKENS)


@pytest.mark.parametrize("max_num_seqs", [8, 3])
def test_simulator_block_accounting_equals_engine(engine_path, max_num_seqs):
    trace = small_trace()
    stats, engine_steps, answers = run_engine(engine_path, trace, max_num_seqs)
    assert stats.num_preemptions > 0 or max_num_seqs == 3, "the trace must exercise preemption"
    assert stats.prefix_cache_hits > 0

    # 1) the simulator's own tokens: only lengths and prompts are shared with the engine
    res = sim.simulate(trace, sim_config(max_num_seqs), MAX_MODEL_LEN, check_integrity=True)
    # 2) the engine's recorded answers replayed: the block contents are identical too
    for c in trace.conversations:
        c.output_token_ids = answers[c.conversation_id]
    replay = sim.simulate(trace, sim_config(max_num_seqs), MAX_MODEL_LEN, check_integrity=True)
    for r in (res, replay):
        assert r.error is None
        assert (r.prefix_cache_queries, r.prefix_cache_hits) == (stats.prefix_cache_queries, stats.prefix_cache_hits)
        assert (r.resume_prefix_cache_queries, r.resume_prefix_cache_hits) == \
            (stats.resume_prefix_cache_queries, stats.resume_prefix_cache_hits)
        assert r.num_preemptions == stats.num_preemptions
        assert r.blocks_used_per_step == engine_steps
        assert r.peak_blocks_used == max(engine_steps)
        assert r.output_tokens == stats.generation_tokens_total
        assert r.prompt_tokens == stats.prompt_tokens_total
    assert replay.num_cached_block_evictions == stats.num_cached_block_evictions


def test_halving_kv_memory_costs_hits_and_adds_preemptions():
    trace = synthetic_trace(WorkloadSpec(num_conversations=40, prompt_len=LengthDist.parse("64:256", "p"),
                                         output_len=LengthDist.parse("32", "o"), shared_prefix_fraction=1.0,
                                         prefix_len=128, num_turns=3, seed=3))
    big = sim.simulate(trace, sim.SimConfig(block_size=16, num_blocks=2000), 1024)
    small = sim.simulate(trace, sim.SimConfig(block_size=16, num_blocks=70), 1024)
    assert big.num_preemptions == 0 and big.num_cached_block_evictions == 0
    assert small.num_preemptions > 0 and small.num_cached_block_evictions > 0
    assert small.prefix_hit_rate < big.prefix_hit_rate
    assert small.peak_kv_usage == 1.0 and big.peak_kv_usage < 1.0
    assert small.mean_ttft_s > big.mean_ttft_s
    assert big.output_tokens == small.output_tokens == 40 * 3 * 32


def test_request_log_replay_hits_the_shared_prefix(tmp_path):
    # One request every 10 s (each finishes long before the next), each = a 64-token shared prefix
    # (4 whole blocks) + 50 unique tokens: every request after the first hits exactly 64 tokens.
    log = tmp_path / "requests.jsonl"
    prefix = list(range(5000, 5064))
    with open(log, "w") as f:
        for i in range(12):
            ids = prefix + [10000 + 100 * i + j for j in range(50)]
            f.write(format_request_log_record(request_id=f"r{i}", prompt_tokens=len(ids), output_tokens=20,
                                              cached_tokens=0, ttft=0.1, e2e=0.5, finish_reason="length",
                                              prompt_token_ids=ids, time=1000.0 + 10 * i + 0.5) + "\n")
    trace = trace_from_request_log(str(log))
    assert [c.arrival_time for c in trace.conversations] == [10.0 * i for i in range(12)]
    res = sim.simulate(trace, sim.SimConfig(block_size=16, num_blocks=500), 256)
    assert res.prefix_cache_queries == 12 * 114 and res.prefix_cache_hits == 11 * 64
    assert res.mean_ttft_s < 1.0 and res.sim_time_s > 110


def test_cli_sweep_table_and_json(tmp_path, capsys):
    from kvserve.cli import main

    out = tmp_path / "sim.json"
    rc = main(["simulate", "--num-requests", "30", "--prompt-len", "128:384", "--output-len", "32",
               "--shared-prefix-fraction", "0.5", "--prefix-len", "96", "--kv-cache-memory", "12MiB,1GiB",
               "--block-size", "16,32", "--max-num-seqs", "16", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "hit rate" in table and "12.00 MiB" in table and "1.00 GiB" in table
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == 4 and doc["num_requests"] == 30
    for r in doc["results"]:
        # SmolLM2-135M, auto (bf16) KV: 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes = 23,040 B/token
        assert r["config"]["num_blocks"] == r["config"]["kv_cache_memory"] // (23040 * r["config"]["block_size"])
        assert r["output_tokens"] == 30 * 32 and 0 < r["prefix_hit_rate"] < 1
    small, large = doc["results"][0], doc["results"][1]  # block size 16: 12 MiB, 1 GiB
    assert small["peak_kv_usage"] == 1.0 > large["peak_kv_usage"]
    assert small["mean_ttft_s"] > large["mean_ttft_s"]


def test_cli_errors_name_the_flag(tmp_path, capsys):
    from kvserve.cli import main

    assert main(["simulate", "--prompt-len", "0:5"]) == 2
    assert "--prompt-len" in capsys.readouterr().err
    assert main(["simulate", "--kv-cache-dtype", "fp4"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err
    for argv, message in ((["--num-requests", "-5"], "--num-requests must be >= 1"),
                          (["--block-size", "7"], "the engine takes block sizes"),
                          (["--step-overhead-ms", "-1"], "--step-overhead-ms must be >= 0"),
                          (["--json", str(tmp_path / "no" / "r.json")], "does not exist")):
        assert main(["simulate", *argv]) == 2
        assert message in capsys.readouterr().err
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main(["simulate", "--trace", str(binary)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    # a pool smaller than one request: every configuration fails with the reason
    assert main(["simulate", "--num-requests", "2", "--prompt-len", "600", "--num-blocks", "8"]) == 1
    assert "the pool holds 128 tokens" in capsys.readouterr().out


def test_progress_lines_say_how_far_a_sweep_is(capsys):
    """--progress: one stderr line per configuration, so a long sweep shows it is moving."""
    from kvserve.cli import main
    assert main(["simulate", "--num-requests", "8", "--prompt-len", "64:128", "--output-len", "8",
                 "--kv-cache-memory", "64MiB,128MiB", "--progress"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvserve simulate:")]
    assert [line.split(" done")[0] for line in err] == ["kvserve simulate: 1/2", "kvserve simulate: 2/2"]


def test_data_parallel_routing_keeps_prefixes_where_round_robin_scatters_them(tmp_path):
    """Eight long system prompts over two replicas whose pools each hold about half of them: the
    cache-aware router keeps each prompt on one replica, round-robin makes both thrash. The
    routers are the server's own (kvserve.routing), fed by the simulated pools' KV events."""
    import random
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(8)]
    log = tmp_path / "requests.jsonl"
    with open(log, "w") as f:
        for i in range(160):
            ids = prefixes[rng.randrange(8)] + [rng.randrange(100, 40000) for _ in range(8)]
            f.write(format_request_log_record(request_id=f"r{i}", prompt_tokens=len(ids), output_tokens=4,
                                              cached_tokens=0, ttft=0.01, e2e=0.02, finish_reason="length",
                                              prompt_token_ids=ids, time=0.25 * i + 0.02) + "\n")
    trace = trace_from_request_log(str(log))
    rates = {}
    for routing in ("round_robin", "least_loaded", "cache_aware"):
        cfg = sim.SimConfig(block_size=16, num_blocks=80, data_parallel_size=2, data_parallel_routing=routing)
        res = sim.simulate(trace, cfg, max_model_len=512, check_integrity=True)
        assert res.error is None and res.num_requests == 160
        rates[routing] = res.prefix_hit_rate
    one = sim.simulate(trace, sim.SimConfig(block_size=16, num_blocks=80), max_model_len=512)
    assert rates["cache_aware"] > rates["round_robin"] + 0.2, rates
    assert rates["cache_aware"] > one.prefix_hit_rate, (rates, one.prefix_hit_rate)  # twice the pool, used as such


def test_cli_pins_from_a_servers_pins_json(tmp_path, capsys):
    """--pins replays a server's pins.json: a 96-token prefix that floods of unique prompts evict
    under LRU is hit by every request once pinned; bad pin files are errors naming the flag."""
    from kvserve.cli import main

    prefix = list(range(5000, 5096))
    log = tmp_path / "requests.jsonl"
    with open(log, "w") as f:
        for i in range(10):
            for j, ids in enumerate([prefix + [9000 + i]] + [[20000 + 1000 * i + 100 * j + k for k in range(90)]
                                                           for j in range(3)]):
                f.write(format_request_log_record(request_id=f"r{i}-{j}", prompt_tokens=len(ids), output_tokens=4,
                                                  cached_tokens=0, ttft=0.1, e2e=0.2, finish_reason="length",
                                                  prompt_token_ids=ids, time=1000.0 + 5 * i + 0.1 * j) + "\n")
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"version": 1, "fingerprint": "ab", "pins": [
        {"id": "sys", "prompt_token_ids": prefix, "cache_salt": "tenant-a", "lora": None, "created": 1.0}]}))

    def hits(*extra) -> float:
        out = tmp_path / "sim.json"
        assert main(["simulate", "--trace", str(log), "--num-blocks", "24", "--block-size", "16",
                     "--json", str(out), *extra]) == 0
        capsys.readouterr()
        doc = json.loads(out.read_text())
        return doc["results"][0]["prefix_cache_hits"], doc["notes"]

    lru, _ = hits()
    pinned, notes = hits("--pins", str(pins))
    assert pinned == 10 * 96 > lru
    assert any("tenant (cache_salt)" in n for n in notes)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([prefix]))
    assert hits("--pins", str(plain))[0] == pinned
    bad = tmp_path / "bad.json"
    for content, message in (("{", "is not JSON"), ('{"pins": [{"id": "x"}]}', "pin 0 has no prompt_token_ids"),
                             ('{"pins": 3}', "expected a server's pins.json")):
        bad.write_text(content)
        assert main(["simulate", "--trace", str(log), "--pins", str(bad)]) == 2
        assert message in capsys.readouterr().err
    assert main(["simulate", "--trace", str(log), "--pins", str(tmp_path / "none.json")]) == 2
    assert "cannot open" in capsys.readouterr().err
    big = tmp_path / "big.json"
    big.write_text(json.dumps([prefix, list(range(100, 260))]))
    assert main(["simulate", "--trace", str(log), "--num-blocks", "16", "--block-size", "16",
                 "--max-model-len", "200", "--pins", str(big)]) == 1
    assert "leaving less than one max-model-len sequence unpinned" in capsys.readouterr().out
