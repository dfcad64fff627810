"""AsyncLLM: the LLMEngine stepping in its own thread, with an asyncio front for the server.

Why a thread and not an asyncio task: a step is a blocking forward pass (tens to hundreds of
milliseconds). Run on the event loop it would stall every HTTP connection for that long; run in a
thread, torch releases the GIL inside its kernels and the event loop keeps accepting connections,
streaming tokens and answering /metrics while the model computes.

Everything that touches the engine (add, abort, reset, stats) runs on the engine thread, between
steps, as a queued command: the engine itself needs no locks. Outputs flow back per request through
an asyncio.Queue fed with loop.call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvserve.core.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineStepError(RuntimeError):
    """A step raised; the requests that were in flight were failed and aborted."""


@dataclass
class StepEvent:
    """What one loop iteration did, handed to the step listeners (metrics, logs) on the engine thread."""
    stats: Any  # EngineStats after the iteration
    outputs: list  # RequestOutputs produced by the step (empty when only commands ran)
    aborted: list[str]  # request ids aborted by their clients during this iteration
    now: float  # time.monotonic() when the iteration ended
    num_step_errors: int = 0  # steps that raised since start
    # Every request the step gave tokens to (RequestProgress), including those whose output is
    # held back until they finish (non-streaming requests): per-token metrics come from here.
    progress: list = field(default_factory=list)
    # Requests that ended without finishing, with why: (last RequestOutput, "client" | "shutdown"
    # | "error"): a client gone, the shutdown drain's end, a failed step.
    ended: list = field(default_factory=list)


StepListener = Callable[[StepEvent], None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # Only the finished output is delivered (a non-streaming API call reads nothing else): no
    # event-loop work per token, which on a small CPU competes with the engine's forward.
    final_only: bool = False


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _deliver(items: list[tuple[_Stream, Any]]) -> None:
    """Hand items to their streams with one wake-up per event loop (not one per item)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


class RequestStream:
    """One admitted request's outputs. Iterating past `finished` ends; leaving early aborts."""

    def __init__(self, llm: "AsyncLLM", request_id: str, loop: asyncio.AbstractEventLoop,
                 final_only: bool = False, mergeable: bool = True):
        self.llm = llm
        self.request_id = request_id
        self._sink = _Stream(loop, asyncio.Queue(), final_only)
        self.finished = False
        self._mergeable = mergeable  # cumulative outputs (the default): unread ones merge into one

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator:
        queue = self._sink.queue
        try:
            while not self.finished:
                item = await queue.get()
                # A reader that fell behind gets what piled up as one output (one SSE event),
                # not one per step: a slow client costs the server one event per read.
                while (self._mergeable and not isinstance(item, BaseException) and not item.finished
                       and not queue.empty()):
                    later = queue.get_nowait()
                    item = later if isinstance(later, BaseException) else later.merged_after(item)
                if isinstance(item, BaseException):
                    self.finished = True  # the loop already aborted it in the engine
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()


class AsyncLLM:
    def __init__(self, engine, step_listeners: list[StepListener] | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.max_logprobs: int = engine.max_logprobs
        self.sampling_defaults: dict = engine.sampling_defaults
        self.token_text = engine.token_text
        self.step_listeners: list[StepListener] = list(step_listeners or [])
        self._cv = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._streams: dict[str, _Stream] = {}  # touched only on the engine thread
        self._aborted: list[str] = []  # engine thread: client aborts since the last publish
        self._ended: list[tuple[Any, str]] = []  # engine thread: requests ended unfinished, with why
        self._stop = False
        self._closing = False  # shutting down: no new requests (begin_shutdown)
        self._adding = 0  # add_request calls waiting for the engine thread to take them
        self._thread: threading.Thread | None = None
        self.latest_stats = engine.get_stats()
        self.num_step_errors = 0

    @classmethod
    def from_engine_args(cls, args, step_listeners: list[StepListener] | None = None) -> "AsyncLLM":
        """Build the engine on the thread that will step it, and start that thread's loop.

        Why there: libgomp keeps one thread team per thread that ever ran a parallel region, and
        once more OpenMP threads exist than CPUs it cuts its spin-wait from ~300k iterations to 1k,
        so every barrier of every op sleeps and wakes through the kernel. Loading the model on the
        main thread and stepping it on another left two teams (4 threads on a 2-core machine) and
        made decode steps 1.3x slower than offline (bench/NOTES.md). Built here, the main thread
        (the event loop, which runs no torch ops) never creates a team.
        """
        from kvserve.engine.engine import LLMEngine
        built: dict[str, Any] = {}
        ready = threading.Event()

        def build_then_run() -> None:
            try:
                llm = built["llm"] = cls(LLMEngine.from_engine_args(args), step_listeners)
                llm._thread = threading.current_thread()
            except BaseException as e:  # re-raised on the caller's thread
                built["error"] = e
                return
            finally:
                ready.set()
            llm._run()

        thread = threading.Thread(target=build_then_run, name="kvserve-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            thread.join()
            raise built["error"]
        return built["llm"]

    # ----- lifecycle -----

    def start(self) -> None:
        """Start the loop thread (a no-op for from_engine_args, whose thread already runs)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        # Queued offload writes reach disk/Redis and the disk tier's directory lock is released.
        self.engine.close()

    def begin_shutdown(self, drain_seconds: float) -> None:
        """The server got SIGTERM / SIGINT (vLLM's --shutdown-timeout): refuse new requests from
        now on; those in flight may finish within `drain_seconds`, then the rest are aborted and
        their streams end with EngineDeadError("the server is shutting down"), which the server
        sends as an error response. Called on the event loop (not in a signal handler: it logs
        and starts a timer thread), so it cannot fall between add_request's check and its admit."""
        if self._closing:
            return
        self._closing = True

        def end_the_rest() -> None:
            ids = list(self._streams)
            if ids:
                logger.warning("shutdown: ending %d requests still in flight after %.0f s (--shutdown-timeout)",
                               len(ids), drain_seconds)
                self._aborted.extend(ids)
                self._fail_all(EngineDeadError("the server is shutting down"))
                self._ended.extend((out, "shutdown") for out in self.engine.abort_request(ids))

        def when_due() -> None:
            with self._cv:
                self._commands.append(end_the_rest)
                self._cv.notify()

        n = len(self._streams)
        if not n:
            logger.info("shutdown: no requests in flight")
        elif drain_seconds > 0:
            logger.info("shutdown: waiting up to %.0f s for %d requests in flight", drain_seconds, n)
        else:
            logger.info("shutdown: ending %d requests in flight", n)
        timer = threading.Timer(drain_seconds, when_due)
        timer.daemon = True
        timer.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ----- commands run on the engine thread -----

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn(engine-side) between two steps; the future carries its result or exception."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, never kills the loop
                fut.set_exception(e)

        with self._cv:
            self._commands.append(command)
            self._cv.notify()
        return fut

    async def acall(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def reset_prefix_cache(self) -> bool:
        return await self.acall(self.engine.reset_prefix_cache)

    async def get_stats(self):
        return await self.acall(self.engine.get_stats)

    def abort(self, request_id: str) -> None:
        """Fire-and-forget abort; safe from any thread, and a no-op for finished requests."""
        if not self.is_running:
            return

        def do_abort() -> None:
            if self._streams.pop(request_id, None) is not None:
                self._aborted.append(request_id)
                logger.info("Aborted request %s.", request_id)  # vLLM's line: a client left before the end
            self._ended.extend((out, "client") for out in self.engine.abort_request([request_id]))

        with self._cv:
            self._commands.append(do_abort)
            self._cv.notify()

    async def add_request(self, prompt: str | list[int], params, request_id: str, priority: int = 0,
                          cache_salt: str | None = None, final_only: bool = False,
                          lora_request=None) -> "RequestStream":
        """Admit a request; raises the engine's RequestError before anything is streamed.
        `final_only`: the stream yields only the finished (cumulative) output.

        The caller must iterate the returned stream to its end or call its abort().
        """
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), final_only,
                               mergeable=params.output_kind == RequestOutputKind.CUMULATIVE)

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                    lora_request=lora_request)
            self._streams[request_id] = stream._sink

        self._adding += 1
        try:
            await self.acall(add)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still run; this abort is queued after it
            raise
        finally:
            self._adding -= 1
        return stream

    def num_queued(self) -> int:
        """Requests waiting to be scheduled, and those on their way in (callable from any thread:
        a length read of the scheduler's queue, exact between steps)."""
        return len(self.engine.scheduler.waiting) + self._adding

    async def generate(self, prompt: str | list[int], params, request_id: str, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator:
        """Yield RequestOutputs for one request until it finishes.

        add_request errors (RequestError) are raised before the first output. Leaving the
        iteration early (client gone, task cancelled) aborts the request in the engine.
        """
        stream = await self.add_request(prompt, params, request_id, priority, cache_salt)
        async for out in stream:
            yield out

    # ----- the loop -----

    def _run(self) -> None:
        logger.info("engine loop started")
        while True:
            with self._cv:
                while not self._stop and not self._commands and not self.engine.has_unfinished_requests():
                    self._cv.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                command()
            outputs: list = []
            progress: list = []
            if self.engine.has_unfinished_requests():
                started = time.monotonic()
                outputs = self._step()
                progress = self.engine.last_step_progress
                if not outputs and time.monotonic() - started < 1e-3:
                    # Nothing could be scheduled (no forward ran): back off briefly instead of
                    # spinning, which would starve the event loop of the GIL.
                    with self._cv:
                        if not self._commands:
                            self._cv.wait(0.005)
            self._publish(outputs, progress)
        self._fail_all(EngineDeadError("the server is shutting down"))
        logger.info("engine loop stopped")

    def _step(self) -> list:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # The batch's state is unknown: fail and abort everything in flight, keep serving.
            self.num_step_errors += 1
            logger.exception("engine step failed; aborting %d in-flight requests", len(self._streams))
            ids = list(self._streams)
            self._aborted.extend(ids)
            self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            try:
                self._ended.extend((out, "error") for out in self.engine.abort_request(ids))
            except Exception:
                logger.exception("abort after a failed step also failed")
            return []
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client in the meantime
            if out.finished:
                del self._streams[out.request_id]
            elif stream.final_only:
                continue
            deliveries.append((stream, out))
        _deliver(deliveries)
        return outputs

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        _deliver([(stream, error) for stream in streams.values()])

    def _publish(self, outputs: list, progress: list) -> None:
        try:
            self.latest_stats = self.engine.get_stats()
        except Exception:
            logger.exception("get_stats failed")
            return
        event = StepEvent(self.latest_stats, outputs, self._aborted, time.monotonic(), self.num_step_errors,
                          progress, self._ended)
        self._aborted, self._ended = [], []
        for listener in self.step_listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("step listener %r failed", listener)
