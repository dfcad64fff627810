"""`kvserve stats` against a real HTTP server on 127.0.0.1 serving a real prometheus_client registry.

The server applies the next step of a script to its metrics on every scrape, so each poll sees
known values and the window's rates and verdicts are known exactly.
"""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from helpers import closed_port
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvserve import cli
from kvserve.tools import stats as stats_tool
from kvserve.tools.stats import counter_increase, metrics_url


class ScriptedMetricsServer:
    """Serves `registry` at /metrics; calls `step(n)` before the n-th scrape (n from 0)."""

    def __init__(self, registry: CollectorRegistry, step, body: bytes | None = None):
        owner = self
        self.scrapes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                step(owner.scrapes)
                owner.scrapes += 1
                payload = body if body is not None else generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


USAGE = [0.55, 0.6, 0.7, 0.82, 0.88, 0.9, 0.93, 0.95, 0.97, 0.99]


@pytest.fixture
def busy_server():
    """vLLM V1 names; two engines (label sets). KV usage climbs past 80 %, 30 % of prefix queries hit,
    a preemption every third scrape, the queue grows."""
    reg = CollectorRegistry()
    usage = Gauge("vllm:kv_cache_usage_perc", "KV blocks in use (0..1)", ["model_name", "engine"], registry=reg)
    queries = Counter("vllm:prefix_cache_queries", "prefix cache queries, tokens", ["model_name"], registry=reg)
    hits = Counter("vllm:prefix_cache_hits", "prefix cache hits, tokens", ["model_name"], registry=reg)
    pre = Counter("vllm:num_preemptions", "preemptions", ["model_name"], registry=reg)
    running = Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=reg)
    for counter in (queries, hits, pre):
        counter.labels("m")  # export 0 from the first scrape, as a server does

    def step(n):
        usage.labels("m", "0").set(USAGE[n % 10])
        usage.labels("m", "1").set(USAGE[n % 10] - 0.1)
        if n:
            queries.labels("m").inc(100)
            hits.labels("m").inc(30)
            if n % 3 == 0:
                pre.labels("m").inc()
        running.labels("m", "0").set(8)
        running.labels("m", "1").set(4)
        waiting.labels("m").set(n)

    server = ScriptedMetricsServer(reg, step)
    yield server
    server.close()


@pytest.fixture
def quiet_server():
    """Pre-V1 names: gpu_cache_usage_perc and the hit-rate gauge; preemptions from before the window."""
    reg = CollectorRegistry()
    usage = Gauge("vllm:gpu_cache_usage_perc", "usage", ["model_name"], registry=reg)
    rate = Gauge("vllm:gpu_prefix_cache_hit_rate", "hit rate", ["model_name"], registry=reg)
    Counter("vllm:num_preemptions", "preemptions", ["model_name"], registry=reg).labels("m").inc(5)
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=reg).labels("m").set(2)
    Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=reg).labels("m").set(0)

    def step(n):
        usage.labels("m").set(0.1 + 0.01 * n)
        rate.labels("m").set(0.7 + 0.02 * n)

    server = ScriptedMetricsServer(reg, step)
    yield server
    server.close()


def _run(capsys, *argv) -> tuple[int, dict | str]:
    rc = stats_tool.main(list(argv))
    out = capsys.readouterr()
    if "--json" in argv and rc != 2:
        return rc, json.loads(out.out)
    return rc, out.out + out.err


def test_busy_server_window_statistics(capsys, busy_server):
    rc, d = _run(capsys, "--url", busy_server.url, "--samples", "10", "--interval", "0.05", "--json")
    assert rc == 0 and d["samples"] == 10 and busy_server.scrapes == 10
    assert d["kv_usage_metric"] == "vllm:kv_cache_usage_perc"
    u = d["kv_usage"]
    means = [v - 0.05 for v in USAGE]  # the two engines' average
    assert u["mean"] == pytest.approx(sum(means) / 10)
    assert u["p95"] == pytest.approx(0.94) and u["max"] == pytest.approx(0.94) and u["last"] == pytest.approx(0.94)
    assert d["prefix_hit_rate"] == pytest.approx(0.3) and d["prefix_hit_rate_source"] == "window"
    assert d["prefix_queries_in_window"] == 900
    assert d["preemptions_in_window"] == 3  # scrapes 3, 6 and 9
    assert d["window_s"] >= 0.45 - 0.02
    assert d["preemptions_per_min"] == pytest.approx(3 * 60 / d["window_s"])
    assert d["running"]["mean"] == 12 and d["waiting"]["max"] == 9 and d["waiting"]["mean"] == 4.5


def test_busy_server_verdicts_and_strict_exit(capsys, busy_server):
    rc, d = _run(capsys, "--url", busy_server.url, "--samples", "10", "--interval", "0.02", "--json",
                 "--shared-prefix", "--strict")
    assert rc == 1
    warns = [v["message"] for v in d["verdicts"] if v["level"] == "warn"]
    assert len(warns) == 3
    assert "eviction pressure" in warns[0] and "P95 KV usage 94%" in warns[0]
    assert "preemptions rising" in warns[1] and "--max-num-seqs" in warns[1]
    assert "check prompt layout" in warns[2] and "30%" in warns[2]
    # Scrapes 10..13 (usage back to 50-77 %, one preemption at 12); without --shared-prefix the
    # low hit rate is advice, not a warning.
    rc, d = _run(capsys, "--url", busy_server.url, "--samples", "4", "--interval", "0", "--json")
    assert [v["level"] for v in d["verdicts"]] == ["ok", "warn", "info"]


def test_quiet_server_with_older_vllm_names(capsys, quiet_server):
    rc, d = _run(capsys, "--url", quiet_server.url + "/metrics", "--samples", "5", "--interval", "0",
                 "--json", "--strict", "--shared-prefix")
    assert rc == 0
    assert d["kv_usage_metric"] == "vllm:gpu_cache_usage_perc"
    assert d["kv_usage"]["max"] == pytest.approx(0.14) and d["kv_usage"]["mean"] == pytest.approx(0.12)
    assert d["prefix_hit_rate_source"] == "gauge" and d["prefix_hit_rate"] == pytest.approx(0.74)
    assert d["preemptions_in_window"] == 0
    assert [v["level"] for v in d["verdicts"]] == ["ok", "ok", "ok"]


def test_hit_rate_since_start_when_the_window_saw_no_queries(capsys):
    reg = CollectorRegistry()
    Counter("vllm:prefix_cache_queries", "q", registry=reg).inc(1000)
    Counter("vllm:prefix_cache_hits", "h", registry=reg).inc(800)
    Gauge("vllm:kv_cache_usage_perc", "u", registry=reg).set(0.0)
    server = ScriptedMetricsServer(reg, lambda n: None)
    try:
        rc, d = _run(capsys, "--url", server.url, "--samples", "3", "--interval", "0", "--json")
    finally:
        server.close()
    assert d["prefix_hit_rate"] == pytest.approx(0.8) and d["prefix_hit_rate_source"] == "since start"
    assert d["prefix_queries_in_window"] == 0


def test_text_report(capsys, busy_server):
    rc, out = _run(capsys, "--url", busy_server.url, "--samples", "3", "--interval", "0")
    assert rc == 0
    assert "KV usage          mean" in out and "[vllm:kv_cache_usage_perc]" in out
    assert "prefix hit rate   30.0% (window)" in out and "[warn] preemptions rising" not in out


def test_counter_increase_survives_a_reset():
    assert counter_increase([4, 5, 1, 2]) == 1 + 1 + 2 - 1
    assert counter_increase([7]) == 0
    assert counter_increase([0, 3, 3, 10]) == 10


def test_metrics_url_forms():
    assert metrics_url("127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://h:1/") == "http://h:1/metrics"
    assert metrics_url("https://h/metrics") == "https://h/metrics"


def test_unreachable_server_names_the_url(capsys):
    with closed_port() as port:
        rc, out = _run(capsys, "--url", f"http://127.0.0.1:{port}", "--samples", "2", "--interval", "0")
    assert rc == 2 and f"cannot reach http://127.0.0.1:{port}/metrics" in out


def test_wrong_path_and_non_prometheus_body(capsys, busy_server):
    rc, out = _run(capsys, "--url", busy_server.url + "/v2", "--samples", "1")
    assert rc == 2 and "HTTP 404" in out
    bad = ScriptedMetricsServer(CollectorRegistry(), lambda n: None, body=b"<html>\n<body>hi</body>\n</html>\n")
    try:
        rc, out = _run(capsys, "--url", bad.url, "--samples", "1")
    finally:
        bad.close()
    assert rc == 2 and "did not return Prometheus text" in out


def test_bad_arguments(capsys):
    with closed_port() as port:
        rc, out = _run(capsys, "--url", f"http://127.0.0.1:{port}", "--samples", "-1")
    assert rc == 2 and "--samples >= 0 (0: until Ctrl-C)" in out


def test_through_the_kvserve_cli(capsys, busy_server):
    rc = cli.main(["stats", "--url", busy_server.url, "--samples", "2", "--interval", "0", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["samples"] == 2


@pytest.mark.slow
def test_against_the_real_kvserve_server(request, tmp_path):
    """stats samples a live `kvserve serve` under a shared-system-prompt load; analyze reads the
    --request-log it wrote and agrees with the usage the API returned."""
    from server_util import SMALL, shared_server, wait_until

    from kvserve.tools.analyze import read_request_log, simulate_prefix_cache
    from kvserve.tools.stats import sample, summarize

    log_path = tmp_path / "requests.jsonl"
    server = shared_server(request, *SMALL, "--disable-log-stats", "--request-log", str(log_path))
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    system = "You are a careful assistant for a hardware store. " * 20
    url = metrics_url(server.url)
    # The window brackets the load whatever the machine's speed: a scrape before it, the sampler
    # running during it, a scrape after it.
    before, _ = sample(url, samples=1, interval=0, timeout=10)
    during = {}
    sampler = threading.Thread(target=lambda: during.update(
        zip(("scrapes", "failed"), sample(url, samples=8, interval=0.25, timeout=10))))
    sampler.start()
    usages = []
    for i in range(6):
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": model, "prompt": f"{system}\nQuestion {i}: what is a hammer for?", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    sampler.join(timeout=60)
    assert not sampler.is_alive()
    after, _ = sample(url, samples=1, interval=0, timeout=10)
    result = {"scrapes": before + during["scrapes"] + after, "failed": during["failed"]}

    report = summarize(server.url, result["scrapes"], result["failed"], shared_prefix=True)
    assert report.kv_usage_metric == "vllm:kv_cache_usage_perc" and 0 <= report.kv_usage.max <= 1
    assert report.prefix_queries_in_window > 0 and report.prefix_hit_rate > 0.5
    assert report.preemptions_in_window == 0 and report.running is not None
    # The live view's frame from the same scrapes: device usage is the report's last value.
    from kvserve.tools.stats_live import live_figures, render
    figures = live_figures(url, result["scrapes"])
    assert [t.name for t in figures.tiers] == ["device"] and figures.tiers[0].usage == report.kv_usage.last
    assert figures.generation_tps is not None and "KV device" in _frame_text(render(url, figures, 10, 0.25))

    wait_until(lambda: log_path.exists() and len(log_path.read_text().splitlines()) >= 6, 10,
               what="6 request-log lines")
    log = read_request_log(str(log_path))
    assert [r.prompt_len for r in log.records] == [u["prompt_tokens"] for u in usages]
    assert [r.output_len for r in log.records] == [u["completion_tokens"] for u in usages]
    served = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages]
    assert [r.cached_tokens for r in log.records] == served and sum(served) > 0
    # kvserve also serves partial blocks, so it hits at least what a block-aligned cache would.
    simulated = simulate_prefix_cache([r.prompt_token_ids for r in log.records], 16)
    assert 0 < simulated.hit_tokens <= sum(served)


def test_url_defaults_to_the_local_kvserve_server():
    from kvserve.cli import build_parser
    assert build_parser().parse_args(["stats"]).url == "http://127.0.0.1:8000"


# Two scrapes of a real `kvserve serve --kv-cache-memory 56MiB --swap-space 0.03 --kv-disk-path ...`
# one second apart under `kvserve bench serve` load (the lines the live view reads, as served).
RECORDED = ['''
vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"} 2.0
vllm:num_requests_waiting{model_name="SmolLM2-135M-Instruct"} 0.0
vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.6329113924050633
vllm:prefix_cache_queries_total{model_name="SmolLM2-135M-Instruct"} 3116.0
vllm:prefix_cache_hits_total{model_name="SmolLM2-135M-Instruct"} 1339.0
vllm:num_preemptions_total{model_name="SmolLM2-135M-Instruct"} 0.0
vllm:prompt_tokens_total{model_name="SmolLM2-135M-Instruct"} 3116.0
vllm:generation_tokens_total{model_name="SmolLM2-135M-Instruct"} 98.0
kvserve:kv_cached_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.3670886075949367
kvserve:kv_tier_usage_perc{model_name="SmolLM2-135M-Instruct",tier="host"} 0.1373767883489308
kvserve:kv_tier_usage_perc{model_name="SmolLM2-135M-Instruct",tier="disk"} 0.06594085693359375
kvserve:kv_tier_used_bytes{model_name="SmolLM2-135M-Instruct",tier="host"} 4.425216e+06
kvserve:kv_tier_used_bytes{model_name="SmolLM2-135M-Instruct",tier="disk"} 4.425216e+06
''', '''
vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"} 1.0
vllm:num_requests_waiting{model_name="SmolLM2-135M-Instruct"} 1.0
vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.25316455696202533
vllm:prefix_cache_queries_total{model_name="SmolLM2-135M-Instruct"} 3410.0
vllm:prefix_cache_hits_total{model_name="SmolLM2-135M-Instruct"} 1339.0
vllm:num_preemptions_total{model_name="SmolLM2-135M-Instruct"} 0.0
vllm:prompt_tokens_total{model_name="SmolLM2-135M-Instruct"} 3741.0
vllm:generation_tokens_total{model_name="SmolLM2-135M-Instruct"} 143.0
kvserve:kv_cached_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.7468354430379747
kvserve:kv_tier_usage_perc{model_name="SmolLM2-135M-Instruct",tier="host"} 0.9845336498340042
kvserve:kv_tier_usage_perc{model_name="SmolLM2-135M-Instruct",tier="disk"} 0.6374282836914062
kvserve:kv_tier_used_bytes{model_name="SmolLM2-135M-Instruct",tier="host"} 3.1714048e+07
kvserve:kv_tier_used_bytes{model_name="SmolLM2-135M-Instruct",tier="disk"} 4.2777088e+07
''']


def _frame_text(renderable, width=110) -> str:
    from rich.console import Console
    console = Console(record=True, width=width, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_live_frame_from_recorded_kvserve_metrics():
    from kvserve.tools.stats import Scrape, parse_scrape
    from kvserve.tools.stats_live import live_figures, render

    scrapes = [Scrape(t, *parse_scrape(text)) for t, text in zip((10.0, 11.0), RECORDED)]
    f = live_figures("u", scrapes)
    assert [(t.name, t.usage) for t in f.tiers] == [("device", 0.25316455696202533), ("host", 0.9845336498340042),
                                                    ("disk", 0.6374282836914062)]
    assert f.tiers[0].cached == 0.7468354430379747 and f.tiers[2].used_bytes == 42_777_088
    assert f.generation_tps == 45 and f.prompt_tps == 625  # per second over the last interval
    assert f.hit_rate == 0 and f.hit_rate_last == 0  # no new hits in the window: 294 tokens queried
    assert (f.running, f.waiting, f.preemptions, f.samples, f.window_s) == (1, 1, 0, 2, 1.0)
    text = _frame_text(render("http://h/metrics", f, samples_asked=6, interval=1))
    lines = {line.split()[2]: line for line in text.splitlines() if line.startswith("│ KV ")}
    assert list(lines) == ["device", "host", "disk"]
    assert "25.3%" in lines["device"] and "74.7% cached" in lines["device"]
    assert "98.5%" in lines["host"] and "30.2 MiB" in lines["host"] and "40.8 MiB" in lines["disk"]
    bar = lines["host"].split()[3]
    assert bar == "█" * 28  # 98.5 % of the 28-cell bar
    assert "45.0 output tok/s, 625.0 prompt tok/s" in text and "running/waiting  1 / 1" in text
    assert "sample 2/6 over 1.0 s" in text
    # Two data-parallel engines: a tier's usage is their mean, its bytes their sum.
    two = RECORDED[1] + "\n".join(line.replace('",tier=', '",engine="1",tier=').replace(" 0.98", " 0.48")
                                   for line in RECORDED[1].splitlines() if "tier=" in line)
    f = live_figures("u", [Scrape(0.0, *parse_scrape(two))])
    host = f.tiers[1]
    assert host.usage == pytest.approx((0.9845336498340042 + 0.4845336498340042) / 2)
    assert host.used_bytes == 2 * 31_714_048


def test_live_view_on_a_terminal_then_the_report(capsys, busy_server, monkeypatch):
    """On a TTY the frames are drawn while sampling and the plain report follows; --no-live and a
    pipe print the report alone."""
    import re
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "110")
    rc, out = _run(capsys, "--url", busy_server.url, "--samples", "4", "--interval", "0.05")
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert rc == 0 and busy_server.scrapes == 4
    assert out.count("KV device") >= 4  # a frame per scrape (and the final one)
    assert "sample 4/4" in out and "running/waiting  12 / 3" in out
    assert out.index("sample 4/4") < out.index("kvserve stats: " + busy_server.url + "/metrics: 4 samples")
    rc, plain = _run(capsys, "--url", busy_server.url, "--samples", "2", "--interval", "0", "--no-live")
    assert "KV device" not in plain and "KV usage          mean" in plain
    monkeypatch.undo()
    rc, piped = _run(capsys, "--url", busy_server.url, "--samples", "2", "--interval", "0")
    assert "KV device" not in piped and "\x1b[" not in piped and "KV usage          mean" in piped


def test_samples_zero_runs_until_interrupted(busy_server):
    from kvserve.tools.stats import sample

    def stop_after_three(scrapes, failed, i):
        if i == 2:
            raise KeyboardInterrupt

    scrapes, failed = sample(metrics_url(busy_server.url), 0, 0, 5, on_scrape=stop_after_three)
    assert len(scrapes) == 3 and failed == 0 and busy_server.scrapes == 3
