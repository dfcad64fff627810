"""A client that goes away aborts its request, whatever the request: chat, n > 1, streamed or not,
running or still queued. Its sequences leave the engine (running and waiting back to 0, blocks
freed), the abort is counted (vllm:request_success_total{finished_reason="abort"}, once per
request), and the server keeps serving. Completions disconnects: test_server_errors.py."""
from __future__ import annotations

import httpx
import pytest
from server_util import MAIN_ARGS, metric_value, open_request, shared_server, start_server, wait_until

pytestmark = pytest.mark.slow
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LONG_CHAT = {"messages": [{"role": "user", "content": "Count from one to a thousand."}], "max_tokens": 800,
             "ignore_eos": True}


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *MAIN_ARGS)


@pytest.fixture(scope="module")
def one_seq_server():
    """One sequence at a time (--max-num-seqs 1): a second request waits in the queue."""
    handle = start_server(*MAIN_ARGS, "--max-num-seqs", "1")
    yield handle
    handle.stop()


def counts(server) -> dict[str, float]:
    m = server.metrics()  # one scrape
    return {"running": metric_value(m, "vllm:num_requests_running"),
            "waiting": metric_value(m, "vllm:num_requests_waiting"),
            "blocks": metric_value(m, "kvserve:kv_blocks_used"),
            "abort": metric_value(m, "vllm:request_success_total", finished_reason="abort"),
            "length": metric_value(m, "vllm:request_success_total", finished_reason="length")}


def idle(server) -> dict[str, float]:
    c = counts(server)
    return c if c["running"] == c["waiting"] == c["blocks"] == 0 else {}


def first_data_lines(lines, n: int) -> None:
    for _ in range(n):
        line = next(line for line in lines if line.startswith("data: "))
        assert '"error"' not in line, line


def still_serves(server) -> None:
    r = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                            "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_streamed_chat_disconnect_aborts(server):
    before = wait_until(lambda: idle(server), 60, interval=0.1, what="an idle server")
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + CHAT, json={**LONG_CHAT, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: closing this iterator closes the connection
            first_data_lines(lines, 3)  # the role chunk and two tokens
            assert counts(server)["running"] == 1
    after = wait_until(lambda: idle(server), 60, interval=0.1, what="the chat request to leave the engine")
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"]
    assert "Aborted request chatcmpl-" in server.log()
    still_serves(server)


def test_non_streamed_chat_disconnect_aborts(server):
    before = wait_until(lambda: idle(server), 60, interval=0.1, what="an idle server")
    with open_request(server.url, CHAT, LONG_CHAT):
        wait_until(lambda: counts(server)["running"] == 1, 60, interval=0.1, what="the chat request running")
    after = wait_until(lambda: idle(server), 60, interval=0.1, what="the chat request to leave the engine")
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"]
    still_serves(server)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_n2_disconnect_aborts_both_sequences(server, stream):
    before = wait_until(lambda: idle(server), 60, interval=0.1, what="an idle server")
    body = {"prompt": "Once upon a time", "max_tokens": 800, "n": 2, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    if stream:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # held: closing this iterator closes the connection
                first_data_lines(lines, 4)
                assert counts(server)["running"] == 2  # both sequences run
    else:
        with open_request(server.url, COMPLETIONS, body):
            wait_until(lambda: counts(server)["running"] == 2, 60, interval=0.1, what="both sequences running")
    after = wait_until(lambda: idle(server), 60, interval=0.1, what="both sequences to leave the engine")
    # One request (vLLM counts requests, not sequences), ended by the abort, not by its tokens.
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"]
    still_serves(server)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_queued_request_disconnect_aborts_it(one_seq_server, stream):
    """A request still waiting (behind a running one, --max-num-seqs 1) that its client leaves is
    taken out of the queue at once: it never runs, and the running request is not disturbed."""
    server = one_seq_server
    before = wait_until(lambda: idle(server), 60, interval=0.1, what="an idle server")
    running = {"prompt": "Count: 1, 2, 3,", "max_tokens": 800, "ignore_eos": True, "stream": True}
    queued = {"prompt": "I wait in the queue", "max_tokens": 5, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + COMPLETIONS, json=running) as r:
            lines = r.iter_lines()
            first_data_lines(lines, 2)
            def queued_up():
                return counts(server)["waiting"] == 1

            if stream:
                with c.stream("POST", server.url + COMPLETIONS, json={**queued, "stream": True}) as q:
                    assert q.status_code == 200  # admitted: the headers come before its first token
                    wait_until(queued_up, 60, interval=0.1, what="the second request queued")
            else:
                with open_request(server.url, COMPLETIONS, queued):
                    wait_until(queued_up, 60, interval=0.1, what="the second request queued")
            left = wait_until(lambda: (now := counts(server))["waiting"] == 0 and now, 60, interval=0.1,
                              what="the queued request to leave the queue")
            assert left["running"] == 1 and left["abort"] == before["abort"] + 1
            assert left["length"] == before["length"]  # it never ran to its 5 tokens
            first_data_lines(lines, 2)  # the running request goes on streaming
    after = wait_until(lambda: idle(server), 60, interval=0.1, what="an idle server after both")
    assert after["abort"] == before["abort"] + 2 and after["length"] == before["length"]
    still_serves(server)
