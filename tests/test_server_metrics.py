"""/metrics as monitoring scripts and dashboards read it: usage rises under load and returns to 0,
prefix hit rate rises on shared prefixes, latency histograms fill, the request log is written."""
from __future__ import annotations

import json
import subprocess
import threading
import uuid

import httpx
import pytest
from server_util import MAIN_ARGS, SMALL, shared_server, start_server, wait_until

pytestmark = pytest.mark.slow

# The usual monitoring snippet, verbatim in spirit: curl | grep | awk.
GREP_SCRIPT = "curl -s {url}/metrics | grep 'vllm:gpu_cache_usage_perc' | grep -v '^#' | awk '{{print $2}}'"


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *MAIN_ARGS)


def grep_usage(url: str) -> float:
    out = subprocess.run(GREP_SCRIPT.format(url=url), shell=True, capture_output=True, text=True, timeout=10)
    return float(out.stdout.strip())


def fire(url: str, n: int, body: dict) -> list[threading.Thread]:
    def one():
        httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_grep_script_sees_usage_rise_under_load_and_return_to_zero(server):
    wait_until(lambda: grep_usage(server.url) == 0.0, 30, what="idle usage 0")
    body = {"prompt": f"{uuid.uuid4()} " + "lorem ipsum dolor sit amet " * 40, "max_tokens": 40,
            "ignore_eos": True}
    threads = fire(server.url, 4, body)
    peak = wait_until(lambda: grep_usage(server.url), 60, interval=0.1, what="usage > 0 under load")
    for t in threads:
        t.join()
    assert 0 < peak <= 1
    wait_until(lambda: grep_usage(server.url) == 0.0, 10, what="usage back to 0 when idle")
    # Finished requests' blocks stay as reusable cache: counted apart from usage, not as usage.
    assert server.metric("kvserve:kv_blocks_cached") > 0
    assert server.metric("kvserve:kv_blocks_used") == 0


def test_prefix_hit_rate_rises_on_shared_prefix_load(server):
    before = server.metric("vllm:gpu_prefix_cache_hit_rate")
    hits0 = server.metric("vllm:prefix_cache_hits_total")
    queries0 = server.metric("vllm:prefix_cache_queries_total")
    names = ("vllm:prompt_tokens_cached_total", "vllm:request_prefill_kv_computed_tokens_sum",
             "vllm:request_prefill_kv_computed_tokens_count")
    sources = ("local_cache_hit", "local_compute")
    counts0 = [server.metric(n) for n in names] + [server.metric("vllm:prompt_tokens_by_source_total", source=x)
                                                   for x in sources]
    prefix = f"{uuid.uuid4()} " + "The quick brown fox jumps over the lazy dog. " * 30
    prompt_tokens = cached_tokens = 0
    for i in range(5):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prefix + f" Q{i}:", "max_tokens": 1},
                       timeout=120)
        assert r.status_code == 200
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
        cached_tokens += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # vLLM's newer prompt-token counters agree with what the responses reported
    counts = [server.metric(n) for n in names] + [server.metric("vllm:prompt_tokens_by_source_total", source=x)
                                                  for x in sources]
    cached, computed_sum, computed_count, by_hit, by_compute = (a - b for a, b in zip(counts, counts0))
    assert cached_tokens >= 4 * 288 and cached == cached_tokens == by_hit
    assert computed_sum == by_compute == prompt_tokens - cached_tokens and computed_count == 5
    after = server.metric("vllm:gpu_prefix_cache_hit_rate")
    hits = server.metric("vllm:prefix_cache_hits_total") - hits0
    queries = server.metric("vllm:prefix_cache_queries_total") - queries0
    assert after > before
    assert queries >= 5 * 300 and hits >= 4 * 288  # 4 of 5 requests reuse the ~300-token prefix
    assert server.metric("kvserve:prefix_cache_hits_by_tier_total", tier="device") >= hits


def test_latency_histograms_and_counters_fill(server):
    m0 = server.metrics()
    label = '{engine="0",model_name="SmolLM2-135M-Instruct"}'
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200
    m1 = server.metrics()

    def delta(name):
        return m1[name + label] - m0.get(name + label, 0)

    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4  # 5 tokens, 4 gaps
    assert delta("vllm:time_per_output_token_seconds_count") == 4
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_generation_tokens_sum") == 5
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5
    assert delta("vllm:request_params_n_sum") == 1
    assert delta("vllm:request_params_max_tokens_sum") == 5
    # One prefill step and four decode steps (nothing else ran: this test's server is idle otherwise).
    assert delta("vllm:iteration_tokens_total_count") == 5
    assert delta("vllm:iteration_tokens_total_sum") == r.json()["usage"]["prompt_tokens"] + 4
    assert delta("vllm:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
    key = '{engine="0",finished_reason="length",model_name="SmolLM2-135M-Instruct"}'
    assert m1["vllm:request_success_total" + key] - m0["vllm:request_success_total" + key] == 1
    assert m1["vllm:e2e_request_latency_seconds_sum" + label] > m0["vllm:e2e_request_latency_seconds_sum" + label]


def test_every_issue_metric_is_exported_with_model_label(server):
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
             "vllm:kv_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:gpu_prefix_cache_hit_rate",
             "vllm:cpu_prefix_cache_hit_rate", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
             "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
             "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
             "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
             "kvserve:kv_blocks_total", "kvserve:kv_blocks_free", "kvserve:kv_blocks_used",
             "kvserve:kv_blocks_cached", "kvserve:kv_cached_usage_perc", "kvserve:kv_token_occupancy_perc",
             "kvserve:cached_block_evictions_total", "kvserve:prefix_cache_hits_by_tier_total",
             "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_by_source_total",
             "vllm:request_prefill_kv_computed_tokens_bucket", "vllm:num_requests_waiting_by_reason"]
    keys = server.metrics()
    for name in names:
        series = [k for k in keys if k.partition("{")[0] == name]
        assert series, name
        assert all('model_name="SmolLM2-135M-Instruct"' in k for k in series), name
    # the process and runtime series vLLM's /metrics carries (generic memory / restart panels)
    for name in ("process_resident_memory_bytes", "process_start_time_seconds", "python_info",
                 "python_gc_collections_total"):
        assert any(k.partition("{")[0] == name for k in keys), name
    total = server.metric("kvserve:kv_blocks_total")
    assert total == server.metric("kvserve:kv_blocks_free") + server.metric("kvserve:kv_blocks_used") + \
        server.metric("kvserve:kv_blocks_cached")


def test_request_log_and_stats_log(tmp_path):
    log = tmp_path / "requests.jsonl"
    srv = start_server(*SMALL, "--request-log", str(log), "--served-model-name", "smol",
                       env={"KVSERVE_LOG_STATS_INTERVAL": "0.5"})
    try:
        def complete(prompt: str) -> dict:
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "model": "smol"},
                           timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        served = [complete("one two three"), complete("four five")]

        # The stats line is written from an engine step at least 0.5 s after the last one: keep
        # serving (one request per poll) until a step falls after the interval.
        def stats_line_logged() -> bool:
            served.append(complete("six"))
            return "Avg prompt throughput" in srv.log()

        wait_until(stats_line_logged, 60, interval=0.2, what="the periodic stats line")
        assert "KV cache usage" in srv.log() and "Running: " in srv.log()
        # one line per finished request, written by the engine thread as it finishes
        lines = wait_until(lambda: len(lines := log.read_text().splitlines()) == len(served) and lines, 30,
                           what=f"{len(served)} request-log lines")
        records = [json.loads(line) for line in lines]
        assert [r["prompt_tokens"] for r in records] == [s["usage"]["prompt_tokens"] for s in served]
        assert [r["output_tokens"] for r in records] == [s["usage"]["completion_tokens"] for s in served]
        assert records[0]["prompt_tokens"] == len(records[0]["prompt_token_ids"]) == 3
        assert all(r["output_tokens"] <= 3 and r["e2e"] > 0 for r in records)
        assert 'model_name="smol"' in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()
