"""`kvserve bench serve` against a real `kvserve serve` on 127.0.0.1.

The server's own Prometheus counters are the reference: the tokens and requests the bench reports
must be the ones the server counted, and multi-turn prompts must hit the server's prefix cache.
"""
from __future__ import annotations

import json
import sys

import pytest
from helpers import closed_port
from server_util import SMALL, shared_server, wait_until

from kvserve.cli import main
from kvserve.config import ConfigError
from kvserve.tools.bench_report import latency
from kvserve.tools.workload import LengthDist, WorkloadSpec, is_shared, synthetic_trace

BLOCK = 16


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *SMALL, "--disable-log-stats")


def counters(server) -> dict[str, float]:
    return {name: server.metric(name) for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                                   "vllm:prefix_cache_hits_total")}


def bench(*args: str) -> int:
    return main(["bench", "serve", "--no-progress", *args])


@pytest.mark.slow
def test_closed_loop_multi_turn_matches_server_counters(server, tmp_path, capsys):
    before = counters(server)
    out = tmp_path / "bench.json"
    rc = bench("--url", server.url, "--concurrency", "3", "--num-requests", "8", "--prompt-len", "40:90",
               "--output-len", "8", "--shared-prefix-fraction", "0.5", "--prefix-len", "32", "--multi-turn", "2",
               "--seed", "7", "--json", str(out))
    assert rc == 0
    text = capsys.readouterr().out
    assert "completed requests           8" in text and "TTFT" in text
    doc = json.loads(out.read_text())
    after = counters(server)
    assert doc["completed"] == 8 and doc["errors"] == 0
    assert doc["output_tokens"] == 8 * 8  # ignore_eos: every request generates max_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == doc["output_tokens"]
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == doc["input_tokens"]
    reqs = doc["requests"]
    # --num-requests caps requests, turns included: a conversation started near the cap may lose its
    # second turn, but each conversation's turns are sent in order from turn 0.
    turns = {}
    for r in reqs:
        turns.setdefault(r["conversation_id"], []).append(r["turn"])
    assert all(sorted(t) == list(range(len(t))) for t in turns.values())
    for r in reqs:
        assert r["error"] is None and r["output_tokens"] == 8
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) == 7  # kvserve streams one token per chunk
    # Every second turn starts with its whole first turn, whose full blocks are in the cache.
    first = {r["conversation_id"]: r["prompt_len"] for r in reqs if r["turn"] == 0}
    second = {r["conversation_id"]: r["prompt_len"] for r in reqs if r["turn"] == 1}
    assert len(second) >= 2 and all(second[c] > first[c] + 8 for c in second)
    expected_hits = sum(first[c] // BLOCK * BLOCK for c in second)
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= expected_hits
    # First-turn prompt lengths are the workload's (the bench sends token ids: lengths are exact).
    trace = synthetic_trace(WorkloadSpec(num_conversations=len(first), prompt_len=LengthDist.parse("40:90", "p"),
                                         output_len=LengthDist.parse("8", "o"), shared_prefix_fraction=0.5,
                                         prefix_len=32, num_turns=2, seed=7))
    assert first == {c.conversation_id: len(c.first_prompt) for c in trace.conversations}
    assert doc["ttft_ms"]["count"] == 8 and doc["itl_ms"]["count"] == 8 * 7
    assert doc["ttft_ms"]["p50"] <= doc["ttft_ms"]["p99"] <= doc["ttft_ms"]["max"]


@pytest.mark.slow
def test_open_loop_duration_stops_by_itself(server, tmp_path, capsys):
    before = counters(server)
    out = tmp_path / "bench.json"
    rc = bench("--url", server.url, "--request-rate", "4", "--duration", "2", "--prompt-len", "32",
               "--output-len", "4", "--json", str(out))
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["errors"] == 0 and doc["completed"] >= 2
    assert "open loop, Poisson 4" in doc["load"]
    # It stopped by itself: nothing was scheduled after 2 s (a send may start a little later on 2
    # busy cores; without the rule they would go on to the hard timeout, --duration + 60 s), what
    # started finished (4 tokens each, as the server counted them), and the hard timeout never cut it.
    assert max(r["start"] for r in doc["requests"]) < 4.0
    assert all(r["error"] is None and r["output_tokens"] == 4 for r in doc["requests"])
    assert not any("hard timeout" in n for n in doc["notes"])
    after = counters(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4 * doc["completed"]


def _finished(server, reason: str) -> float:
    return server.metric("vllm:request_success_total", finished_reason=reason)


@pytest.mark.slow
def test_hard_timeout_cancels_and_reports(server, tmp_path, capsys):
    aborted, lengths = _finished(server, "abort"), _finished(server, "length")
    out = tmp_path / "bench.json"
    rc = bench("--url", server.url, "--concurrency", "2", "--num-requests", "50", "--prompt-len", "16",
               "--output-len", "600", "--hard-timeout", "3", "--json", str(out))
    doc = json.loads(out.read_text())
    assert any("hard timeout" in n for n in doc["notes"])
    assert doc["completed"] < 50
    assert rc in (0, 1)  # 1 when not one request finished before the cut
    assert "hard timeout" in capsys.readouterr().out
    # The cut cancelled the requests in flight, and the server aborted them: it goes idle with one
    # abort per request the bench had in flight (its 2 lanes), not 50 requests' worth of tokens.
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:num_requests_waiting")
               == 0, 60, interval=0.1, what="the server idle after the hard timeout")
    cut = _finished(server, "abort") - aborted
    assert 1 <= cut <= 2
    assert doc["completed"] <= _finished(server, "length") - lengths <= doc["completed"] + 2 - cut
    assert all(r["output_tokens"] == 600 for r in doc["requests"] if r["error"] is None)


@pytest.mark.slow
def test_server_errors_are_counted_with_their_message(server, capsys):
    rc = bench("--url", server.url, "--model", "no-such-model", "--concurrency", "2", "--num-requests", "3",
               "--prompt-len", "8", "--output-len", "2")
    text = capsys.readouterr().out
    assert rc == 1
    assert "failed requests              3" in text and "3 x HTTP 404" in text and "no-such-model" in text


def test_user_errors_name_the_flag(capsys):
    with closed_port() as port:
        assert bench("--url", f"http://127.0.0.1:{port}", "--num-requests", "1") == 2
        assert "cannot reach the server" in capsys.readouterr().err
    with closed_port() as port:
        assert bench("--url", f"127.0.0.1:{port}") == 2  # no scheme
    assert "--url" in capsys.readouterr().err
    assert bench("--url", "http://x", "--concurrency", "2", "--request-rate", "1") == 2
    assert "not both" in capsys.readouterr().err
    assert bench("--url", "http://x", "--output-len", "normal:5") == 2
    assert "--output-len" in capsys.readouterr().err
    # An unwritable --json fails before the run, not after it (the results were lost).
    with closed_port() as port:
        assert bench("--url", f"http://127.0.0.1:{port}", "--num-requests", "1", "--json",
                     "/nonexistent-dir/r.json") == 2
    assert "/nonexistent-dir does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_vllm_bench_serve_flags_run_the_same_bench(server, tmp_path, capsys):
    """A `vllm bench serve` command line, its program name changed, runs here."""
    rc = bench("--backend", "vllm", "--base-url", server.url, "--endpoint", "/v1/completions",
               "--dataset-name", "random", "--num-prompts", "3", "--max-concurrency", "2", "--request-rate", "inf",
               "--random-input-len", "8", "--random-output-len", "2", "--ignore-eos", "--tokenizer", "x",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert rc == 0, capsys.readouterr()
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["completed"] == 3 and "concurrency 2" in doc["load"]
    assert all(r["prompt_len"] == 8 and r["output_tokens"] == 2 for r in doc["requests"])


def test_vllm_bench_serve_flags_map_onto_this_tools():
    from kvserve.cli import build_parser
    from kvserve.tools.bench_serve import config_from_args

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["bench", "serve", "--base-url", "http://h:1", *argv]))

    c = cfg("--num-prompts", "40", "--random-input-len", "100", "--random-output-len", "10",
            "--random-range-ratio", "0.5", "--random-prefix-len", "32")
    w = c.workload
    assert c.concurrency == 8 and c.num_requests == 40
    assert (w.prompt_len.kind, w.prompt_len.a, w.prompt_len.b) == ("uniform", 50, 150)
    assert (w.output_len.a, w.output_len.b) == (5, 15)
    assert (w.prefix_len, w.shared_prefix_fraction) == (32, 1.0)
    c = cfg("--num-prompts", "12", "--request-rate", "inf")  # vLLM's default: all at once
    assert c.concurrency == 12 and c.request_rate is None
    for argv, needle in ((["--backend", "openai-chat"], "--backend"), (["--dataset-name", "sharegpt"], "sharegpt"),
                         (["--endpoint", "/v1/chat/completions"], "--endpoint"),
                         (["--random-range-ratio", "0.2", "--random-input-len", "10:20"], "plain --prompt-len")):
        with pytest.raises(ConfigError, match=needle):
            cfg(*argv)


@pytest.mark.slow
def test_plot_beside_the_json_or_says_matplotlib_is_missing(server, tmp_path, capsys, monkeypatch):
    args = ["--url", server.url, "--concurrency", "2", "--num-requests", "2", "--prompt-len", "16", "--output-len", "4"]
    assert bench(*args, "--json", str(tmp_path / "run.json")) == 0
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {tmp_path / 'run.png'}" in capsys.readouterr().out
    assert bench(*args, "--json", str(tmp_path / "quiet.json"), "--no-plot") == 0
    assert (tmp_path / "quiet.json").exists() and not (tmp_path / "quiet.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without it
    assert bench(*args, "--plot", str(tmp_path / "named.png")) == 1  # asked for by name: a failure
    assert "pip install matplotlib" in capsys.readouterr().err
    assert bench(*args, "--json", str(tmp_path / "implied.json")) == 0  # the implied plot only warns
    assert (tmp_path / "implied.json").exists()
    assert "the plot needs matplotlib, which is not installed: pip install matplotlib" in capsys.readouterr().err


def test_plot_flags_contradicting_are_refused(tmp_path, capsys):
    assert bench("--url", "http://127.0.0.1:1", "--plot", str(tmp_path / "a.png"), "--no-plot") == 2
    assert "--plot and --no-plot" in capsys.readouterr().err


@pytest.mark.slow
def test_rate_sweep_runs_each_rate_and_plots_per_rate_curves(server, tmp_path, capsys):
    before = counters(server)
    out = tmp_path / "sweep.json"
    rc = bench("--url", server.url, "--request-rate", "2,8", "--num-requests", "3", "--prompt-len", "16",
               "--output-len", "4", "--json", str(out))
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())["sweep"]
    assert rc == 0 and [d["request_rate"] for d in doc] == [2, 8]
    assert [d["completed"] for d in doc] == [3, 3] and all(d["errors"] == 0 for d in doc)
    assert ["open loop, Poisson 2 conversations/s", "open loop, Poisson 8 conversations/s"] == [d["load"] for d in doc]
    after = counters(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 2 * 3 * 4
    assert text.count("kvserve bench serve: ") == 2 and "Sweep over --request-rate" in text
    sweep = text[text.index("Sweep over"):].splitlines()
    assert sweep[2].split()[:2] == ["2", f"{doc[0]['request_throughput']:.2f}"]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_plot_draws_each_runs_figures(tmp_path):
    from kvserve.tools.bench_report import BenchReport, Latency, format_sweep, plot_sweep

    def report(rate, tps, ttft50, ttft99):
        lat = Latency(4, ttft50, ttft50, ttft99, ttft99, ttft99)
        return BenchReport(url="u", model="m", workload="w", load="l", duration_s=1, completed=4, errors=0,
                           error_examples=[], input_tokens=1, output_tokens=1, request_throughput=rate / 2,
                           output_throughput=tps, total_token_throughput=tps, ttft_ms=lat, tpot_ms=None,
                           itl_ms=lat, e2e_ms=lat, request_rate=rate)

    reports = [report(1, 10.0, 50, 90), report(2, 19.0, 60, 120), report(4, 30.0, 200, 900)]
    drawn = {label: (xs, ys) for label, xs, ys in plot_sweep(reports, str(tmp_path / "s.png"))}
    assert drawn["output tok/s"] == ([1, 2, 4], [10.0, 19.0, 30.0])
    assert drawn["TTFT p50"][1] == [50, 60, 200] and drawn["TTFT p99"][1] == [90, 120, 900]
    assert "TPOT p50" not in drawn and (tmp_path / "s.png").exists()
    assert format_sweep(reports).splitlines()[4].split() == ["4", "2.00", "30.0", "200.0", "900.0", "200.0",
                                                             "900.0", "900.0", "0"]


def test_rate_sweep_errors_name_the_flag(capsys):
    for rates, needle in (("1,inf", "cannot be one step of a sweep"), ("2,0", "must be > 0"), ("1,x", "e.g. 1,2,4")):
        with pytest.raises(SystemExit):
            bench("--url", "http://x", "--request-rate", rates)
        err = capsys.readouterr().err
        assert "--request-rate" in err and needle in err


def test_latency_percentiles_and_shared_prefix_spread():
    s = latency([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (s.count, s.p50, s.max) == (100, 50.5, 100.0)
    assert s.p99 == pytest.approx(99.01)
    for fraction in (0.0, 0.25, 0.5, 1 / 3, 1.0):
        assert sum(is_shared(i, fraction) for i in range(300)) == round(300 * fraction)


def test_client_lanes_one_client_per_request_in_flight():
    """bench serve's clients: concurrent lanes get distinct clients (one connection each, so
    httpx's pool never re-scans many), a finished lane's client is reused, aclose closes all."""
    import asyncio

    from kvserve.tools.bench_serve import ClientLanes

    async def run(port):
        lanes = ClientLanes(base_url=f"http://127.0.0.1:{port}")  # never connected: lanes are made, not used
        async with lanes.lane() as a, lanes.lane() as b:
            assert a is not b
        async with lanes.lane() as c:
            assert c in (a, b)
        await lanes.aclose()
        return a, b

    with closed_port() as port:
        a, b = asyncio.run(run(port))
    assert a.is_closed and b.is_closed
