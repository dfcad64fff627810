"""`kvserve serve --data-parallel-size 2` end to end: two engine core processes on a CPU each
behind one API server, requests routed by cached prefix and load, one /metrics with vLLM's
`engine` label, and a replica's death failing only its own requests."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import httpx
import pytest
from server_util import MAIN_ARGS, SMALL, SRC, shared_server, start_server, wait_until

pytestmark = [pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
PREFIX_A = "You are a careful assistant for a bakery. Answer in one short sentence. " * 6
PREFIX_B = "You are a terse librarian who only recommends poetry books to readers. " * 6


@pytest.fixture(scope="module")
def dp_server(request):
    server = start_server(*SMALL, "--disable-log-stats", "--data-parallel-size", "2", "--block-size", "16")
    request.addfinalizer(server.stop)
    return server


@pytest.fixture(scope="module")
def one_server(request):
    return shared_server(request, *MAIN_ARGS)


def complete(server, prompt: str, max_tokens: int = 8) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def per_engine(server, name: str, **labels) -> list[float]:
    return [server.metric(name, engine=str(e), **labels) for e in (0, 1)]


def finished(server) -> list[float]:
    return [sum(server.metric("vllm:request_success_total", engine=str(e), finished_reason=r) for r in ("stop", "length"))
            for e in (0, 1)]


def test_each_replica_is_a_process_on_its_own_cpu(dp_server):
    cores = dp_server.children()
    assert len(cores) == 2
    allowed = []
    for pid in cores:
        with open(f"/proc/{pid}/status") as f:
            allowed.append(next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list")))
    assert len(set(allowed)) == 2, allowed


def test_a_prefix_stays_on_the_replica_that_caches_it(dp_server, one_server):
    before = finished(dp_server)
    questions = [f"Question {i}: what goes well with rye bread?" for i in range(4)]
    a = [complete(dp_server, PREFIX_A + q) for q in questions]
    after_a = finished(dp_server)
    b = [complete(dp_server, PREFIX_B + q) for q in questions]
    after_b = finished(dp_server)
    got_a = [x - y for x, y in zip(after_a, before)]
    got_b = [x - y for x, y in zip(after_b, after_a)]
    # One at a time, so load never tips the balance: each prefix's requests all go to one replica,
    # and the second prefix, held by nobody, to the replica holding fewer blocks: the other one.
    assert sorted(got_a) == [0, 4] and sorted(got_b) == [0, 4] and got_a != got_b, (got_a, got_b)
    assert sum(per_engine(dp_server, "vllm:prefix_cache_hits_total")) > 0
    # Greedy tokens are the same as one server's (float32: cache hits do not change them).
    assert a + b == [complete(one_server, PREFIX_A + q) for q in questions] + \
        [complete(one_server, PREFIX_B + q) for q in questions]


def test_a_hot_prefix_spreads_over_both_replicas_and_no_block_leaks(dp_server):
    before = finished(dp_server)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: complete(dp_server, PREFIX_A + f"Order {i}: two loaves.", 24), range(16)))
    got = [x - y for x, y in zip(finished(dp_server), before)]
    assert sum(got) == 16 and min(got) >= 2, got  # the balance rule took some off the prefix's replica
    wait_until(lambda: per_engine(dp_server, "kvserve:kv_blocks_used") == [0, 0], 10, what="blocks released")
    assert per_engine(dp_server, "vllm:num_requests_running") == [0, 0]


def test_kill_one_replica_its_requests_fail_the_other_keeps_serving(dp_server):
    cores = dp_server.children()

    def stream(i):
        try:
            with httpx.stream("POST", f"{dp_server.url}/v1/completions", timeout=120,
                              json={"model": MODEL, "prompt": f"Poem {i} of a fresh series:", "max_tokens": 200,
                                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                body = "".join(r.iter_text())
            return r.status_code, body
        except httpx.HTTPError as e:
            return None, repr(e)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        wait_until(lambda: sum(per_engine(dp_server, "vllm:num_requests_running")) >= 4, 60, what="requests running")
        os.kill(cores[0], signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    ok = [body for status, body in results if status == 200 and "[DONE]" in body and '"error"' not in body]
    failed = [body for status, body in results if body not in ok]
    assert ok and failed, results  # prefixes nobody holds: spread over both replicas by load
    assert all("data-parallel replica" in body for body in failed), (failed, dp_server.log()[-6000:])
    assert httpx.get(f"{dp_server.url}/health", timeout=10).status_code == 200
    assert complete(dp_server, PREFIX_A + "After the crash: one loaf?")  # routed to the survivor


def test_more_replicas_than_cpus_is_a_startup_error():
    env = dict(os.environ, PYTHONPATH=SRC)
    n = len(os.sched_getaffinity(0)) + 1
    proc = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--data-parallel-size", str(n)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"--data-parallel-size {n} needs at least one CPU per replica" in proc.stderr, proc.stderr[-2000:]
