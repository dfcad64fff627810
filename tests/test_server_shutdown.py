"""SIGTERM with requests in flight (vLLM's --shutdown-timeout): no client sees a cut connection.

Default (0 s): the requests in flight end at once with an error the client can read - a streamed
one gets an SSE error event and [DONE], a non-streamed one a 503 - and the process exits.
With a drain time, a request that finishes within it completes normally.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from server_util import SMALL, start_server, wait_until

LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _collect_stream(url: str, out: dict) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            out["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]
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


def test_sigterm_ends_requests_in_flight_with_an_error_response():
    server = start_server(*SMALL, "--disable-log-stats")
    try:
        streamed, plain = {}, {}
        threads = [threading.Thread(target=_collect_stream, args=(server.url, streamed)),
                   threading.Thread(target=_post, args=(server.url, LONG, plain))]
        for t in threads:
            t.start()
        wait_until(lambda: _running(server) == 2, 60, what="both requests running")
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert "error" not in streamed and "error" not in plain, (streamed, plain)
        assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]"
        err = json.loads(streamed["lines"][-2][6:])["error"]
        assert err["code"] == 503 and "shutting down" in err["message"]
        assert plain["status"] == 503 and "shutting down" in plain["body"]["error"]["message"]
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
        log = server.log()
        assert "ending 2 requests in flight" in log and "Traceback" not in log
    finally:
        server.stop()


def test_a_drain_time_lets_requests_in_flight_finish():
    server = start_server(*SMALL, "--disable-log-stats", "--shutdown-timeout", "120")
    try:
        done = {}
        body = {**LONG, "max_tokens": 40}
        t = threading.Thread(target=_post, args=(server.url, body, done))
        t.start()
        wait_until(lambda: _running(server) == 1, 60, what="the request running")
        server.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert done.get("status") == 200, done
        assert done["body"]["usage"]["completion_tokens"] == 40
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
        assert "waiting up to 120 s for 1 requests in flight" in server.log()
    finally:
        server.stop()
