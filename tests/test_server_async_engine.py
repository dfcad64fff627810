"""AsyncLLM over the real engine: streaming, concurrency without stalling the event loop, aborts on
early exit and cancellation, add errors raised to the caller, and a failing step that fails only the
in-flight requests while the loop keeps serving."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvserve.config import EngineArgs
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.async_engine import AsyncLLM, EngineStepError, StepEvent
from kvserve.engine.outputs import RequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    events: list[StepEvent] = []
    engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=256, num_gpu_blocks_override=64),
                                       step_listeners=[events.append], multiprocess=False)
    engine.events = events
    engine.start()
    yield engine
    engine.shutdown()
    assert not engine.is_running


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def until(predicate, timeout: float, what: str):
    """Await `predicate()` (a coroutine function) until it returns something truthy; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last value {value!r})")
        await asyncio.sleep(0.02)


async def idle(llm: AsyncLLM, timeout: float = 30.0) -> None:
    async def is_idle():
        s = await llm.get_stats()
        return s.num_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 and s
    await until(is_idle, timeout, "an idle engine (no requests, no blocks in use)")


def tokens_given(llm: AsyncLLM, request_id: str) -> int:
    """Output tokens the engine has given `request_id` so far, from the step events."""
    return max((p.num_tokens for e in list(llm.events) for p in e.progress if p.request_id == request_id), default=0)


def hold_engine(llm: AsyncLLM) -> threading.Event:
    """Park the engine thread between two steps until the returned event is set (bounded: 30 s)."""
    held, release = threading.Event(), threading.Event()
    llm.call(lambda: (held.set(), release.wait(30)))
    assert held.wait(30), "the engine thread never ran the holding command"
    return release


def test_generate_streams_until_finished(llm):
    async def main():
        outs = [o async for o in llm.generate("The sky is", greedy(6), "g1")]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert len(outs[-1].outputs[0].token_ids) == 6
        assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
        await idle(llm)
    asyncio.run(main())


def test_concurrent_requests_do_not_stall_the_event_loop(llm, monkeypatch):
    """A step runs on the engine thread: while one computes, the event loop keeps running its other
    tasks, and a coroutine waiting on the engine (get_stats) waits without blocking the loop.

    A step in the middle of the generation is held until the event loop has ticked three times
    with a get_stats call pending: that can only happen if the loop runs while the step does."""
    runner = llm.engine.runner
    real_execute = runner.execute
    in_step, loop_ran = threading.Event(), threading.Event()
    released_by_loop: list[bool] = []
    calls = [0]

    def held_step(sched):
        calls[0] += 1
        if calls[0] == 3:  # a decode step, with tokens already streamed
            in_step.set()
            released_by_loop.append(loop_ran.wait(20))  # False: the loop never ran during the step
        return real_execute(sched)

    monkeypatch.setattr(runner, "execute", held_step)

    async def main():
        async def one(i):
            return [o async for o in llm.generate(f"Request {i}: once upon a time", greedy(12), f"c{i}")][-1]

        finals = asyncio.gather(*(one(i) for i in range(3)))
        assert await asyncio.to_thread(in_step.wait, 60), "no step was held"
        stats = asyncio.ensure_future(llm.get_stats())  # queued behind the held step
        ticks = 0
        for _ in range(3):
            await asyncio.sleep(0)
            ticks += 1
        assert not stats.done(), "get_stats answered while the engine was inside a step"
        loop_ran.set()
        finals = await asyncio.wait_for(finals, 120)
        assert (await asyncio.wait_for(stats, 60)).num_blocks_total > 0
        return ticks, finals

    ticks, finals = asyncio.run(main())
    assert released_by_loop == [True], "the event loop did not run while the engine thread was inside a step"
    assert ticks == 3
    assert all(len(f.outputs[0].token_ids) == 12 and f.outputs[0].finish_reason == "length" for f in finals)


def test_leaving_early_aborts_and_frees_blocks(llm):
    async def main():
        stream = await llm.add_request("Count with me: one, two,", greedy(200), "early")
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await idle(llm)
        assert "early" in [rid for e in llm.events for rid in e.aborted]
    asyncio.run(main())


def test_cancelled_task_aborts(llm):
    """Cancelling the task that iterates a request aborts it in the engine: it leaves through the
    abort path (a client abort, no finished output), one step at most after the cancel, long
    before its 200 tokens, and its blocks are freed."""
    rid = "cancel-me"

    async def main():
        got_two = asyncio.Event()

        async def consume():
            n = 0
            async for _ in llm.generate("A long story begins", greedy(200), rid):
                n += 1
                if n == 2:
                    got_two.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_two.wait(), 60)
        release = await asyncio.to_thread(hold_engine, llm)  # the cancel lands between two known steps
        try:
            reached = tokens_given(llm, rid)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            release.set()

        async def gone_or_still_generating():  # the latter fails below at once, without waiting it out
            return tokens_given(llm, rid) > reached + 1 or not await llm.acall(llm.engine.has_unfinished_requests)
        await until(gone_or_still_generating, 60, "the cancelled request to leave the engine")
        if tokens_given(llm, rid) <= reached + 1:
            await idle(llm)  # its blocks are freed; a later command: the abort's step event is published
        return reached

    reached = asyncio.run(main())
    final = tokens_given(llm, rid)
    assert 2 <= reached < 200
    # After the cancel the engine ran the step it was about to run, then the abort.
    assert final <= reached + 1, f"the request kept generating after its cancel: {reached} -> {final} of 200 tokens"
    assert rid in [r for e in llm.events for r in e.aborted], "the engine's abort path did not run for it"
    assert not [o for e in llm.events for o in e.outputs if o.request_id == rid and o.finished]
    # It ended as an abort with its reason and what it had generated (the request log's line).
    ended = [(o, why) for e in llm.events for o, why in e.ended if o.request_id == rid]
    assert len(ended) == 1 and ended[0][1] == "client"
    out = ended[0][0]
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == final


def test_add_request_errors_reach_the_caller(llm):
    async def main():
        with pytest.raises(RequestError) as e:
            await llm.add_request(list(range(300)), greedy(4), "too-long")
        assert e.value.param == "prompt" and "256" in str(e.value)
        # The engine caps output at the context (vLLM's engine does too); the HTTP layer is what
        # refuses an explicit overflow with a 400 (test_server_errors).
        capped = [o async for o in llm.generate("hi", greedy(1000), "too-many")][-1]
        assert capped.outputs[0].finish_reason == "length"
        assert len(capped.prompt_token_ids) + len(capped.outputs[0].token_ids) == llm.max_model_len
        outs = [o async for o in llm.generate("still fine", greedy(2), "after-errors")]
        assert outs[-1].finished
    asyncio.run(main())


def test_failing_step_fails_in_flight_requests_and_keeps_serving(llm, monkeypatch):
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real_execute(sched)

    monkeypatch.setattr(runner, "execute", flaky)

    async def main():
        errors_before = llm.num_step_errors
        with pytest.raises(EngineStepError, match="injected device fault"):
            async for _ in llm.generate("This one hits the fault", greedy(20), "victim"):
                pass
        assert llm.num_step_errors == errors_before + 1 and llm.is_running
        await idle(llm)
        outs = [o async for o in llm.generate("This one is fine", greedy(4), "survivor")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    asyncio.run(main())


def test_engine_is_built_on_the_thread_that_steps_it(monkeypatch):
    """One OpenMP team only: the model's load and warm-up run on the loop thread, not the caller's
    (two teams on a small machine throttle libgomp's spin-wait; bench/NOTES.md, server mode)."""
    import threading

    from kvserve.engine.engine import LLMEngine
    built_on: list[int] = []
    real = LLMEngine.from_engine_args.__func__

    def recording(cls, args):
        built_on.append(threading.get_ident())
        return real(cls, args)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording))
    llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=128, num_gpu_blocks_override=16), multiprocess=False)
    try:
        assert llm.is_running
        assert built_on == [llm.client.thread.ident] and built_on[0] != threading.get_ident()
        out = asyncio.run(_collect(llm, "Hi", greedy(3)))
        assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert not llm.is_running


def test_engine_build_errors_reach_the_caller():
    import threading
    before = set(threading.enumerate())
    with pytest.raises(Exception, match="max_model_len|max-model-len"):
        AsyncLLM.from_engine_args(EngineArgs(max_model_len=10**9, num_gpu_blocks_override=16), multiprocess=False)
    assert not [t for t in set(threading.enumerate()) - before if t.name == "kvserve-engine"]


async def _collect(llm: AsyncLLM, prompt, params) -> list:
    return [out async for out in llm.generate(prompt, params, request_id="built-on-loop")]


def test_response_role_names_the_generated_message(llm):
    """vLLM's --response-role: the role of the message the server returns, streamed or not."""
    from kvserve.server import protocol as P
    from kvserve.server.serving import OpenAIServing, ServingConfig
    serving = OpenAIServing(llm, ServingConfig(["m"], response_role="bot"))
    body = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0.0)

    async def main():
        full = await serving.create_chat_completion(P.ChatCompletionRequest(**body), None)
        assert full["choices"][0]["message"]["role"] == "bot"
        chunks = [c async for c in await serving.create_chat_completion(
            P.ChatCompletionRequest(**body, stream=True), None)]
        assert '"role":"bot"' in chunks[0].replace(" ", "")
    asyncio.run(main())
