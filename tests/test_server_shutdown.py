"""SIGTERM with requests in flight (vLLM's --shutdown-timeout): no client sees a cut connection.

Default (0 s): the requests in flight end at once with an error the client can read - a streamed
one gets an SSE error event and [DONE], a non-streamed one a 503 - and the process exits.
With a drain time, a request that finishes within it completes normally; one still running when
the drain time is up ends with that same error. New requests are refused from the signal on: the
listening socket closes (uvicorn), and one that reached the app first gets a 503. With a disk KV
tier the blocks in the pool are written down at exit, and a restarted server serves them.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading

import httpx
import pytest
from server_util import SMALL, start_server, wait_until

pytestmark = pytest.mark.slow
# Longer than any drain below on any machine: ~1000 decode steps.
LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
SHUTTING_DOWN = "the engine is not running: the server is shutting down"


def _collect_stream(url: str, out: dict) -> None:
    out["lines"] = []  # filled as the chunks arrive: the test watches it
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["lines"].append(line)
    except Exception as e:  # a cut connection: what the test must not see
        out["error"] = repr(e)


def _post(url: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        out["status"], out["body"] = r.status_code, r.json()
    except Exception as e:
        out["error"] = repr(e)


def _running(server) -> float:
    return server.metric("vllm:num_requests_running")


def _start_two_long_requests(server) -> tuple[dict, dict, list[threading.Thread]]:
    """A streamed and a non-streamed request, both running, the streamed one past its first token."""
    streamed, plain = {}, {}
    threads = [threading.Thread(target=_collect_stream, args=(server.url, streamed)),
               threading.Thread(target=_post, args=(server.url, LONG, plain))]
    for t in threads:
        t.start()
    wait_until(lambda: _running(server) == 2, 60, interval=0.1, what="both requests running")
    wait_until(lambda: len(streamed.get("lines", ())) >= 2, 60, what="the streamed request's first tokens")
    return streamed, plain, threads


def _assert_ended_with_the_shutdown_error(streamed: dict, plain: dict) -> None:
    assert "error" not in streamed and "error" not in plain, (streamed.get("error"), plain.get("error"))
    assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]"
    err = json.loads(streamed["lines"][-2][6:])["error"]
    assert err["code"] == 503 and err["message"] == SHUTTING_DOWN, err
    assert plain["status"] == 503 and plain["body"]["error"]["message"] == SHUTTING_DOWN, plain
    assert plain["body"]["error"]["type"] == "ServiceUnavailableError"


def test_sigterm_ends_requests_in_flight_with_an_error_response():
    server = start_server(*SMALL, "--disable-log-stats")
    try:
        streamed, plain, threads = _start_two_long_requests(server)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        _assert_ended_with_the_shutdown_error(streamed, plain)
        tokens = [line for line in streamed["lines"] if '"text"' in line]
        assert 2 <= len(tokens) < LONG["max_tokens"]
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
        log = server.log()
        assert "shutdown: ending 2 requests in flight" in log and "Traceback" not in log
    finally:
        server.stop()


def test_a_drain_time_lets_requests_in_flight_finish():
    server = start_server(*SMALL, "--disable-log-stats", "--shutdown-timeout", "120")
    try:
        done = {}
        body = {**LONG, "max_tokens": 40}
        t = threading.Thread(target=_post, args=(server.url, body, done))
        t.start()
        wait_until(lambda: _running(server) == 1, 60, interval=0.1, what="the request running")
        server.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert done.get("status") == 200, done
        assert done["body"]["usage"]["completion_tokens"] == 40
        assert done["body"]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
        assert "waiting up to 120 s for 1 requests in flight" in server.log()
    finally:
        server.stop()


def _try_new_request(url: str) -> str:
    """What a client that arrives during the drain gets."""
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):  # accepted by the kernel, then the listener closed
        return "reset"
    if r.status_code == 503 and r.json()["error"]["message"] == SHUTTING_DOWN:
        return "503"
    return f"{r.status_code} {r.text[:200]}"


def test_drain_time_up_ends_the_rest_with_an_error_and_refuses_new_requests():
    """--shutdown-timeout 2 with two requests that need far longer: they keep running through the
    drain, then end with the shutdown error; a client arriving meanwhile is refused."""
    server = start_server(*SMALL, "--disable-log-stats", "--shutdown-timeout", "2")
    try:
        streamed, plain, threads = _start_two_long_requests(server)
        server.proc.send_signal(signal.SIGTERM)
        outcomes = []
        wait_until(lambda: outcomes.append(_try_new_request(server.url)) or outcomes[-1] == "refused", 10,
                   interval=0.05, what="a new connection to be refused")
        assert threads[0].is_alive() and threads[1].is_alive(), "the drain did not wait for the requests"
        for t in threads:
            t.join(60)
        # Until uvicorn closes its listener (its next 0.1 s tick) a request may still reach the app,
        # which refuses it with the 503; after that the connection is refused. None is served.
        assert set(outcomes) <= {"refused", "503", "reset"}, outcomes
        _assert_ended_with_the_shutdown_error(streamed, plain)
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
        log = server.log()
        waiting = log.index("shutdown: waiting up to 2 s for 2 requests in flight")
        assert log.index("shutdown: ending 2 requests still in flight after 2 s (--shutdown-timeout)") > waiting
        assert "Traceback" not in log
    finally:
        server.stop()


def test_requests_reaching_the_app_during_a_drain_get_a_503():
    """After begin_shutdown (what SIGTERM calls) the routes refuse new requests with a readable
    503, streamed or not, while the request already in flight runs on to its end (the drain)."""
    from kvserve.config import EngineArgs
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.async_engine import AsyncLLM
    from kvserve.server.app import build_app
    from kvserve.server.auth import Authenticator
    from kvserve.server.metrics import ServerMetrics
    from kvserve.server.serving import ServingConfig

    args = EngineArgs(max_model_len=256, num_gpu_blocks_override=64)
    llm = AsyncLLM.from_engine_args(args)
    try:
        app = build_app(llm, ServingConfig(["m"]), ServerMetrics("m", llm.max_model_len, args), Authenticator([]))

        async def main():
            in_flight = await llm.add_request("Before the signal", SamplingParams(max_tokens=20, temperature=0.0,
                                                                                   ignore_eos=True), "in-flight")
            llm.begin_shutdown(60.0)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as client:
                refused = [await client.post(path, json=body) for path, body in (
                    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}))]
                tokenize = await client.post("/tokenize", json={"prompt": "Hi"})
            outs = [o async for o in in_flight]
            return refused, tokenize, outs[-1]

        refused, tokenize, last = asyncio.run(main())
        for r in refused:
            assert r.status_code == 503, r.text
            assert r.json()["error"] == {"message": SHUTTING_DOWN, "type": "ServiceUnavailableError", "param": None,
                                         "code": 503}
        assert tokenize.status_code == 200  # no engine work: still answered
        assert last.finished and len(last.outputs[0].token_ids) == 20 and last.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def _kv_files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".kvb"))


def test_sigterm_writes_the_pool_to_the_disk_tier_and_a_restart_serves_it(tmp_path):
    disk = tmp_path / "kv"
    prompt = "The disk tier keeps prefixes across restarts. " * 8 + "Which prefix survives?"
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    first = start_server(*SMALL, "--disable-log-stats", "--kv-disk-path", str(disk))
    try:
        r = httpx.post(f"{first.url}/v1/completions", json=body, timeout=120).json()
        n_prompt = r["usage"]["prompt_tokens"]
        assert n_prompt % 16 and n_prompt > 64, n_prompt  # full blocks, and a partial one that stays in memory
        assert _kv_files(disk) == []  # nothing evicted: blocks reach the disk only at shutdown
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        first.stop()
    written = re.findall(r"shutdown: (\d+) cached KV blocks written to the disk tier", first.log())
    assert written, first.log()[-3000:]
    n = int(written[0])
    assert n >= n_prompt // 16
    assert len(_kv_files(disk)) == n

    second = start_server(*SMALL, "--disable-log-stats", "--kv-disk-path", str(disk))
    try:
        again = httpx.post(f"{second.url}/v1/completions", json=body, timeout=120).json()
        assert again["choices"][0]["text"] == r["choices"][0]["text"]
        # Every full block of the prompt comes from the disk (a fresh process: its pool was empty).
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * (n_prompt // 16)
        assert second.metric("kvserve:prefix_cache_hits_by_tier_total", tier="disk") == 16 * (n_prompt // 16)
    finally:
        second.stop()
