"""The engine core in a process of its own: outputs rebuilt from its deltas equal an in-process
engine's, field for field; the server's forward runs in the child; a dead core turns /health and
every request into a 503 that says so; a dead front end takes the core with it."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from helpers import wait_until
from server_util import SMALL, start_server, wait_gone

from kvserve.config import EngineArgs
from kvserve.core.sampling_params import RequestOutputKind, SamplingParams
from kvserve.engine.async_engine import AsyncLLM
from kvserve.engine.engine import LLMEngine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ARGS = dict(max_model_len=256, num_gpu_blocks_override=64, dtype="float32")

CASES = [  # (prompt, params): every output field the front end rebuilds
    ("The sky is", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)),
    ("Count: one, two,", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=2)),
    ("Once upon a time", SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2, ignore_eos=True)),
    ("A list of fruits:", SamplingParams(max_tokens=30, temperature=0.0, stop=[","], include_stop_str_in_output=True)),
    ("Hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)),
    ("Hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY)),
]


def comparable(out) -> tuple:
    return (out.prompt, list(out.prompt_token_ids), out.finished, out.prompt_logprobs,
            [(o.index, o.text, list(o.token_ids), o.cumulative_logprob, o.logprobs, o.finish_reason, o.stop_reason,
              o.delta_text, list(o.delta_token_ids), o.delta_logprobs) for o in out.outputs])


def in_process(prompt, params, rid: str) -> list[tuple]:
    engine = LLMEngine(EngineArgs(**ARGS))
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(comparable(o) for o in engine.step())
    return outs


def test_outputs_from_the_core_process_equal_an_in_process_engines():
    llm = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=True)
    llm.start()
    try:
        assert llm.engine is None and llm.is_running

        async def run(prompt, params, rid):
            return [comparable(o) async for o in llm.generate(prompt, params, rid)]

        for i, (prompt, params) in enumerate(CASES):
            got = asyncio.run(run(prompt, params, f"r{i}"))
            assert got == in_process(prompt, params, f"r{i}"), (prompt, params)
    finally:
        llm.shutdown()
    assert not llm.is_running


def test_refusals_and_aborts_cross_the_process_boundary():
    events = []
    llm = AsyncLLM.from_engine_args(EngineArgs(**ARGS), step_listeners=[events.append], multiprocess=True)
    llm.start()
    try:
        async def main():
            from kvserve.engine.outputs import RequestError
            with pytest.raises(RequestError, match="maximum context length is 256"):
                await llm.add_request(list(range(300)), SamplingParams(max_tokens=1), "too-long")
            stream = await llm.add_request("Tell me a story", SamplingParams(max_tokens=100, ignore_eos=True), "gone")
            async for _ in stream:
                break  # leaving the stream aborts the request in the core
            await asyncio.wait_for(_until(lambda: any(o.request_id == "gone" for e in events for o, _ in e.ended)), 30)
            with pytest.raises(TypeError, match="named engine methods"):
                llm.call(lambda: None)
            assert await llm.reset_prefix_cache() is True
            stats = await llm.get_stats()
            assert stats.num_blocks_used == 0 and stats.num_running == 0
        asyncio.run(main())
        ended = [(o.request_id, why, len(o.outputs[0].token_ids), len(o.prompt_token_ids))
                 for e in events for o, why in e.ended]
        assert [(rid, why) for rid, why, *_ in ended] == [("gone", "client")]
        assert ended[0][2] >= 1 and ended[0][3] > 0  # the request log's counts, rebuilt
    finally:
        llm.shutdown()


async def _until(predicate, interval: float = 0.02) -> None:
    while not predicate():
        await asyncio.sleep(interval)


def core_pid(server) -> int:
    def find():
        for pid in server.children():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"kvserve.engine.core_proc" in f.read():
                    return pid
        return None
    return wait_until(find, 10, what="the engine core child process")


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_the_server_runs_the_forward_in_its_core_process_and_fails_clearly_when_it_dies():
    server = start_server(*SMALL, "--disable-log-stats")
    try:
        pid = core_pid(server)
        before = cpu_ticks(pid)
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The ocean is", "max_tokens": 32, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
        assert cpu_ticks(pid) > before  # the model ran in the child

        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 15,
                   what="/health to report the dead engine core")
        r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and "engine core process exited" in r.json()["error"]["message"], r.text
        assert server.proc.poll() is None  # the front end keeps answering
    finally:
        server.stop()


def test_the_core_process_ends_with_its_front_end():
    server = start_server(*SMALL, "--disable-log-stats")
    try:
        pid = core_pid(server)
        server.proc.kill()  # no drain, no SHUTDOWN message: the core notices its parent is gone
        server.proc.wait(10)
        assert wait_gone(pid, 15), "the engine core outlived its front end"
    finally:
        server.stop()
