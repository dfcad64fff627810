"""What one streamed token costs the API server, stage by stage, without a model or a socket.

    python bench/stream_cost.py [--streams 64] [--steps 128]

A decode step of `--streams` streaming completions arrives from the engine core as one pickled
CoreBatch of deltas (built here as the core builds it). Each stage runs alone, best of 5, in
microseconds per streamed event:
  recv + unpickle   the batch through a ZMQ ipc:// PUSH/PULL pair, then pickle.loads
  rebuild           OutputRebuilder: the deltas -> cumulative outputs
  hand-off          AsyncLLM._on_batch (the step listeners left out) -> each request's queue ->
                    its RequestStream -> the serving generator, with one task per stream waiting
  chunk JSON        the pydantic chunk + model_dump + json.dumps (before) / ChunkTemplate (now)
  response          EventStreamResponse's writer loop up to the ASGI send (a no-op send here)
What is left of the API server's measured CPU per event (bench/serve_frontend.py --parts stream)
is the ASGI middleware chain, uvicorn's HTTP framing, the socket write and the event loop.
Prints a table; writes bench/results/stream_cost.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import platform
import sys
import tempfile
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvserve.core.sampling_params import RequestOutputKind  # noqa: E402
from kvserve.engine.async_engine import AsyncLLM, RequestStream  # noqa: E402
from kvserve.engine.core import CoreBatch  # noqa: E402
from kvserve.engine.core_client import OutputRebuilder  # noqa: E402
from kvserve.engine.outputs import (CompletionOutput, EngineStats, RequestMetrics, RequestOutput,  # noqa: E402
                                    RequestProgress)
from kvserve.server import protocol as P  # noqa: E402
from kvserve.server.sse import ChunkTemplate, EventStreamResponse, sse_event  # noqa: E402

WORDS = [" the", " light", "house", " keeper", ",", " and", " every", " evening"]


def core_batch(streams: int, step: int, finished: bool = False) -> CoreBatch:
    """A decode step's batch as the core process sends it: deltas only, with metrics and progress."""
    now = time.monotonic()
    outputs = [RequestOutput(f"cmpl-{i:032x}-0", None, None, [CompletionOutput(
        0, None, None, delta_text=WORDS[(i + step) % len(WORDS)], delta_token_ids=[1000 + step],
        finish_reason="length" if finished else None)], finished, 0,
        RequestMetrics(now - 5, now - 4.9, now - 4.5, now, now if finished else None, 0, 128)) for i in range(streams)]
    progress = [RequestProgress(o.request_id, step + 1, now - 5, now - 4.5, now) for o in outputs]
    return CoreBatch(outputs, progress, EngineStats(num_running=streams, num_steps=step), now)


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def recv_unpickle(payloads: list[bytes]) -> float:
    with tempfile.TemporaryDirectory() as d:
        ctx = zmq.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{d}/out")
        push.connect(f"ipc://{d}/out")

        def run():
            for data in payloads:
                push.send(data)
                pickle.loads(pull.recv())
        seconds = best(run)
        push.close(0)
        pull.close(0)
        ctx.term()
    return seconds


def rebuild(payloads: list[bytes], streams: int) -> float:
    batches = [[pickle.loads(p) for p in payloads] for _ in range(5)]
    times = []
    for copy in batches:
        r = OutputRebuilder()
        for i in range(streams):
            r.expect(f"cmpl-{i:032x}-0", list(range(384)), None, RequestOutputKind.CUMULATIVE)
        t = time.perf_counter()
        for b in copy:
            for out in b.outputs:
                r.rebuild(out)
        times.append(time.perf_counter() - t)
    return min(times)


class _Client:
    def send(self, msg) -> None:
        pass


def hand_off(payloads: list[bytes], streams: int, template: bool) -> float:
    """Batches through AsyncLLM._on_batch to `streams` consumers shaped as the serving generator."""
    async def main() -> float:
        llm = AsyncLLM.__new__(AsyncLLM)
        llm.__init__(None, [], client=_Client(), args=object(), info={
            "tokenizer": None, "model_config": None, "max_model_len": 4096, "max_logprobs": 20,
            "sampling_defaults": {}, "stats": None})
        llm.client.is_alive = True
        r = OutputRebuilder()
        loop = asyncio.get_running_loop()
        ids = [f"cmpl-{i:032x}-0" for i in range(streams)]
        for rid in ids:
            r.expect(rid, list(range(384)), None, RequestOutputKind.CUMULATIVE)
        batches = [pickle.loads(p) for p in payloads]
        for b in batches:
            b.outputs = [r.rebuild(o) for o in b.outputs]
        done = asyncio.Event()
        left = [streams]

        async def consume(rid: str) -> None:
            stream = RequestStream(llm, rid, loop)
            llm._streams[rid] = stream._sink
            tpl = ChunkTemplate(rid, 0, "SmolLM2-135M-Instruct", chat=False)
            async for out in stream:
                o = out.outputs[0]
                if template:
                    tpl.event(0, o.delta_text, o.finish_reason, o.stop_reason)
                else:
                    sse_event(P.CompletionChunk(id=rid, created=0, model="SmolLM2-135M-Instruct", choices=[
                        P.CompletionStreamChoice(index=0, text=o.delta_text, finish_reason=o.finish_reason,
                                                 stop_reason=o.stop_reason)]).model_dump())
            left[0] -= 1
            if not left[0]:
                done.set()

        tasks = [asyncio.create_task(consume(rid)) for rid in ids]
        await asyncio.sleep(0)
        t = time.perf_counter()
        for b in batches:
            llm._on_batch(b)
            await asyncio.sleep(0)  # every consumer takes its output before the next batch
            await asyncio.sleep(0)
        await done.wait()
        seconds = time.perf_counter() - t
        await asyncio.gather(*tasks)
        return seconds

    return min(asyncio.run(main()) for _ in range(5))


def chunk_json(n: int, template: bool) -> float:
    tpl = ChunkTemplate("cmpl-" + "a" * 32, 0, "SmolLM2-135M-Instruct", chat=False)

    def run():
        for i in range(n):
            if template:
                tpl.event(0, WORDS[i % 8], None, None)
            else:
                sse_event(P.CompletionChunk(id="cmpl-" + "a" * 32, created=0, model="SmolLM2-135M-Instruct", choices=[
                    P.CompletionStreamChoice(index=0, text=WORDS[i % 8], finish_reason=None,
                                             stop_reason=None)]).model_dump())
    return best(run)


def response(n: int) -> float:
    async def events():
        for i in range(n):
            yield WORDS[i % 8]

    async def send(message) -> None:
        pass

    async def main() -> float:
        t = time.perf_counter()
        await EventStreamResponse(events(), lambda e: None)._write(send)
        return time.perf_counter() - t
    return min(asyncio.run(main()) for _ in range(5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "stream_cost.json")
    args = ap.parse_args()
    s, k = args.streams, args.steps
    payloads = [pickle.dumps(core_batch(s, i, i == k - 1), protocol=pickle.HIGHEST_PROTOCOL) for i in range(k)]
    events = s * k
    rows = {
        "recv + unpickle": recv_unpickle(payloads) / events,
        "rebuild": rebuild(payloads, s) / events,
        "hand-off + chunk JSON (pydantic)": hand_off(payloads, s, template=False) / events,
        "hand-off + chunk JSON (template)": hand_off(payloads, s, template=True) / events,
        "chunk JSON (pydantic)": chunk_json(events, template=False) / events,
        "chunk JSON (template)": chunk_json(events, template=True) / events,
        "response writer loop": response(events) / events,
    }
    print(f"{platform.processor() or platform.machine()}; {s} streams x {k} steps, {len(payloads[k // 2])} bytes "
          "a batch\n\nstage                                 us / event")
    for name, seconds in rows.items():
        print(f"{name:36} {1e6 * seconds:11.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"streams": s, "steps": k, "us_per_event": {n: 1e6 * v for n, v in rows.items()}},
                                    indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
