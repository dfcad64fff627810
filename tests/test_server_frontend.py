"""A front end no request can stall: huge prompts are refused (or tokenized) off the event loop
while /health and small requests keep answering; a bounded waiting queue answers 503 with
Retry-After when full. Latency figures belong to bench/serve_frontend.py; here, bounded waits."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from server_util import SMALL, start_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    handle = start_server(*SMALL, "--disable-log-stats")
    yield handle
    handle.stop()


def test_huge_prompts_do_not_stall_health_or_small_requests(server):
    text = ("The keepers of the light trimmed the wicks every evening. " * 200_000)[:10 * 2**20]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            huge = [asyncio.create_task(client.post("/v1/completions", json={
                "model": MODEL, "prompt": text, "max_tokens": 1})) for _ in range(3)]
            health = await client.get("/health")
            small = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
            return health, small, await asyncio.gather(*huge)

    health, small, huge = asyncio.run(main())
    assert health.status_code == 200
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1
    for r in huge:  # refused from the text's length, without tokenizing 10 MB
        assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_truncated_huge_prompt_is_tokenized_and_served(server):
    """truncate_prompt_tokens needs the whole prompt tokenized (its last tokens are kept): done on
    the tokenizing threads, and served."""
    text = "word " * 200_000  # 1 MB
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 64})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64, r.text


def test_a_full_queue_answers_503_with_retry_after():
    server = start_server(*SMALL, "--disable-log-stats", "--max-num-seqs", "1", "--max-queued-requests", "1")
    try:
        async def main():
            # float32 on 2 shared cores: 96 tokens keep one request running while the queue fills,
            # and the bound leaves room for a loaded machine.
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": True}

                async def gauge(name: str, at_least: float) -> None:
                    while True:
                        m = (await client.get("/metrics")).text
                        if next(float(line.split()[-1]) for line in m.splitlines()
                                if line.startswith(name + "{")) >= at_least:
                            return
                        await asyncio.sleep(0.05)

                running = asyncio.create_task(client.post("/v1/completions", json=long))
                await asyncio.wait_for(gauge("vllm:num_requests_running", 1), 60)
                queued = asyncio.create_task(client.post("/v1/completions", json=long))  # waits: 1 seq at a time
                await asyncio.wait_for(gauge("vllm:num_requests_waiting", 1), 60)
                refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
                return refused, await running, await queued

        refused, running, queued = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full" and "--max-queued-requests" in refused.text
        assert running.status_code == 200 and queued.status_code == 200  # the queue itself is served
    finally:
        server.stop()


def test_max_queued_requests_must_be_positive(capsys):
    from kvserve.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-queued-requests", "0"])
    assert "--max-queued-requests" in capsys.readouterr().err
