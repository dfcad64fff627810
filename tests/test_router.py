"""kvserve servers behind the real vllm-router (`cache_aware`): the worker routes it calls answer
as vLLM / SGLang do, greedy outputs through it equal one server's, requests sharing a prefix land
on the server that holds it (prefix hits in the servers' own /metrics), and a server killed mid-run
leaves the other serving: its requests are retried by the router or fail cleanly, none hangs."""
from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import signal
import subprocess
import tempfile

import httpx
import pytest
from helpers import free_port, terminate, wait_until
from server_util import SMALL, start_server

pytestmark = pytest.mark.slow

ARGS = [*SMALL, "--disable-log-stats", "--block-size", "16"]
# Two system prompts of ~300 tokens each, many users: the shared-prefix traffic cache-aware routing is for
PREFIXES = [" ".join(f"{word}{i}" for i in range(150)) for word in ("alpha", "omega")]


def start_router(*workers: str, policy: str = "cache_aware", extra: tuple[str, ...] = ()):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)
    cmd = [shutil.which("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *workers, "--prometheus-port", str(free_port()), "--worker-startup-timeout-secs", "60",
           "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
           "--health-failure-threshold", "1", "--request-timeout-secs", "60", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}:\n{open(log.name).read()[-3000:]}")
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_until(ready, 60, 0.2, "vllm-router to answer /v1/models")
    except BaseException:
        terminate(proc)
        raise
    return url, proc, log.name


@pytest.fixture(scope="module")
def servers(tiny):
    a = start_server(tiny, *ARGS)
    try:
        b = start_server(tiny, *ARGS)
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def router(servers):
    url, proc, log = start_router(*(s.url for s in servers))
    yield url
    terminate(proc)
    os.unlink(log)


def complete(url: str, prompt: str, n: int = 8, timeout: float = 60) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                 "temperature": 0, "ignore_eos": True}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_worker_routes_answer_as_the_router_expects(servers):
    a, _ = servers
    body = {"prompt": PREFIXES[0], "max_tokens": 5, "temperature": 0, "no_stop_trim": False,
            "return_hidden_states": False}
    rendered = httpx.post(f"{a.url}/v1/completions/render", json=body, timeout=30).json()
    ids = httpx.post(f"{a.url}/tokenize", json={"prompt": PREFIXES[0]}, timeout=30).json()["tokens"]
    assert len(rendered) == 1 and rendered[0]["token_ids"] == ids
    assert rendered[0]["sampling_params"]["max_tokens"] == 5 and rendered[0]["sampling_params"]["temperature"] == 0
    chat = httpx.post(f"{a.url}/v1/chat/completions/render", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    assert chat["token_ids"] and chat["sampling_params"]["max_tokens"] == 3
    bad = httpx.post(f"{a.url}/v1/completions/render", json={"prompt": "x", "max_tokens": 10**6}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    info = httpx.get(f"{a.url}/get_model_info", timeout=10).json()
    assert info["is_generation"] is True and info["model_path"]
    server_info = httpx.get(f"{a.url}/get_server_info", timeout=10).json()
    assert server_info["max_model_len"] == 1024 and server_info["internal_states"][0]["num_running_reqs"] == 0
    flushed = httpx.post(f"{a.url}/flush_cache", timeout=30)
    assert flushed.status_code == 200 and "flushed" in flushed.text
    # the fields the router adds to every body are taken silently, not logged as ignored
    complete(a.url, "hello", 2)
    assert "no_stop_trim" not in a.log()


def test_cache_aware_routing_keeps_greedy_outputs_and_hits_prefixes(servers, router):
    a, b = servers
    for s in servers:
        assert httpx.post(f"{s.url}/flush_cache", timeout=30).status_code == 200
    users = [f"{prefix} user {u} asks question {u * 7}" for u in range(4) for prefix in PREFIXES]
    hits_before = sum(s.metric("vllm:prefix_cache_hits_total") for s in servers)
    through = [complete(router, p) for p in users]
    hits = sum(s.metric("vllm:prefix_cache_hits_total") for s in servers) - hits_before
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in through]
    # Every user after a prefix's first finds its blocks: the router sent it where the prefix is
    prefix_blocks = min(len(httpx.post(f"{a.url}/tokenize", json={"prompt": p}, timeout=30).json()["tokens"])
                        for p in PREFIXES) // 16 * 16
    assert cached[:2] == [0, 0] and all(c >= prefix_blocks for c in cached[2:]), cached
    assert hits == sum(cached)
    direct = [complete(a.url, p) for p in users]
    assert [r["choices"][0]["text"] for r in through] == [r["choices"][0]["text"] for r in direct]


def test_a_server_killed_mid_run_leaves_the_other_serving(servers, router):
    a, b = servers
    prompts = [f"{PREFIXES[i % 2]} late user {i}" for i in range(12)]
    expected = {p: complete(a.url, p, 16)["choices"][0]["text"] for p in prompts}
    # the victim is the server the router sends these prefixes to (it holds them): the worst case
    before = [s.metric("vllm:request_success_total") for s in servers]
    for p in PREFIXES:
        complete(router, p, 1)
    gained = [s.metric("vllm:request_success_total") - n for s, n in zip(servers, before)]
    victim, survivor = (a, b) if gained[0] >= gained[1] else (b, a)

    def ask(p: str):
        try:
            r = httpx.post(f"{router}/v1/completions", json={"prompt": p, "max_tokens": 16,
                                                            "temperature": 0, "ignore_eos": True}, timeout=90)
        except httpx.HTTPError as e:
            return p, None, repr(e)
        return p, r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        wait_until(lambda: victim.metric("vllm:num_requests_running") > 0 or any(f.done() for f in futures),
                   60, 0.05, "a request running on the server to be killed")
        for pid in [victim.proc.pid, *victim.children()]:
            os.kill(pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]  # none hangs
    ok = [(p, body) for p, status, body in results if status == 200]
    failed = [(p, status, body) for p, status, body in results if status != 200]
    for p, body in ok:  # retried or served: the right tokens
        assert body["choices"][0]["text"] == expected[p]
    for p, status, body in failed:  # a clean failure: an HTTP error status, never a hang or a 200 with garbage
        assert status is None or status >= 500, (status, body)
    assert len(ok) >= len(prompts) // 2, results
    assert survivor.proc.poll() is None
    # the router marks the dead server down and keeps serving through the other
    after = wait_until(lambda: _served(router, prompts[0]), 30, 0.5, "the router to serve through the survivor")
    assert after["choices"][0]["text"] == expected[prompts[0]]
    # the retried requests leaked no blocks on the survivor
    wait_until(lambda: survivor.metric("kvserve:kv_blocks_used") == 0, 30, 0.2, "the survivor's blocks to be free")


def _served(router: str, prompt: str):
    try:
        r = httpx.post(f"{router}/v1/completions", json={"prompt": prompt, "max_tokens": 16,
                                                        "temperature": 0, "ignore_eos": True}, timeout=30)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None
