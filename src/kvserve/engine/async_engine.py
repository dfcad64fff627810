"""AsyncLLM: the server's asyncio front to an engine core that runs elsewhere.

The core (engine/core.py) runs scheduling and the model in its own process by default
(engine/core_proc.py; VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps it on a thread of this one). Never
on the event loop: a step is a blocking forward of tens to hundreds of milliseconds.

Everything that touches the engine (add, abort, reset, stats) is a message the core handles
between two steps: the engine itself needs no locks. Each iteration's CoreBatch comes back on a
client thread; outputs go to their request's asyncio.Queue through loop.call_soon_threadsafe, and
the step listeners (metrics, logs) run there, off the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvserve.core.sampling_params import RequestOutputKind
from kvserve.engine.core import ABORT, ABORT_CLIENT, ABORT_SHUTDOWN, ADD, CALL, CoreBatch, engine_info
from kvserve.engine.detokenizer import token_text_cache
from kvserve.engine.outputs import RequestError

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
    rank: int = 0  # the data-parallel replica whose iteration this was (vLLM's `engine` label)


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
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, batch in by_loop.items():
        if loop is running:  # outputs received on the event loop itself (the server's case)
            _put_all(batch)
            continue
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
    def __init__(self, engine=None, step_listeners: list[StepListener] | None = None, *, client=None,
                 args=None, info: dict | None = None):
        """AsyncLLM(engine): the core on a thread of this process, over `engine`. The other form
        (client, args, info) is from_engine_args's."""
        from kvserve.engine.core_client import InprocClient
        self.engine = engine  # None when the core runs in its own process
        self.client = client or InprocClient(engine, self._on_batch, self._on_dead)
        self.args = args if args is not None else engine.args
        info = info or engine_info(engine)
        self.tokenizer = info["tokenizer"]
        self.model_config = info["model_config"]
        self.max_model_len: int = info["max_model_len"]
        self.max_logprobs: int = info["max_logprobs"]
        self.sampling_defaults: dict = info["sampling_defaults"]
        stats = info["stats"]  # a list, one per replica, from a data-parallel client
        self.stats_by_rank: list = list(stats) if isinstance(stats, list) else [stats]
        self.kv_fingerprint: str | None = info.get("kv_fingerprint")
        self.token_text = engine.token_text if engine is not None else token_text_cache(self.tokenizer)
        self.step_listeners: list[StepListener] = list(step_listeners or [])
        self._lock = threading.Lock()  # _streams and _calls: the event loop, the client thread, timers
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False  # shutting down: no new requests (begin_shutdown)
        self._dead: str | None = None  # why the core stopped for good
        self._adding = 0  # add_request calls waiting for the core's answer
        self.num_step_errors = 0

    @classmethod
    def from_engine_args(cls, args, step_listeners: list[StepListener] | None = None,
                         multiprocess: bool | None = None) -> "AsyncLLM":
        """The engine core in its own process (the default; vLLM's VLLM_ENABLE_V1_MULTIPROCESSING),
        or on a thread of this one; either way built where it will run, and warm when this returns.

        Why built there: libgomp keeps one thread team per thread that ever ran a parallel region,
        and once more OpenMP threads exist than CPUs it cuts its spin-wait from ~300k iterations
        to 1k, so every barrier of every op sleeps and wakes through the kernel. Loading the model
        on one thread and stepping it on another left two teams (4 threads on a 2-core machine)
        and made decode steps 1.3x slower than offline (bench/NOTES.md).
        """
        from kvserve import envs
        from kvserve.config import ConfigError
        if multiprocess is None:
            multiprocess = envs.VLLM_ENABLE_V1_MULTIPROCESSING
        if args.data_parallel_size > 1:
            if not multiprocess:
                raise ConfigError(f"--data-parallel-size {args.data_parallel_size} runs one engine core process per "
                                  "replica; unset VLLM_ENABLE_V1_MULTIPROCESSING=0")
            from kvserve.engine.dp_client import DPClient
            llm = cls.__new__(cls)
            client = DPClient(args, llm._on_batch, llm._on_dead)
            llm.__init__(None, step_listeners, client=client, args=args, info=client.info)
            return llm
        if multiprocess:
            from kvserve.engine.core_client import MPClient
            llm = cls.__new__(cls)
            client = MPClient(args, llm._on_batch, llm._on_dead)
            llm.__init__(None, step_listeners, client=client, args=args, info=client.info)
            return llm  # started by start(): on a thread, or on the server's event loop
        return cls._built_on_its_thread(args, step_listeners)

    @classmethod
    def _built_on_its_thread(cls, args, step_listeners) -> "AsyncLLM":
        from kvserve.engine.engine import LLMEngine
        built: dict[str, Any] = {}
        ready = threading.Event()

        def build_then_run() -> None:
            try:
                llm = built["llm"] = cls(LLMEngine.from_engine_args(args), step_listeners)
                llm.client.thread = threading.current_thread()
            except BaseException as e:  # re-raised on the caller's thread
                built["error"] = e
                return
            finally:
                ready.set()
            llm.client.run()

        thread = threading.Thread(target=build_then_run, name="kvserve-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            thread.join()
            raise built["error"]
        return built["llm"]

    # ----- lifecycle -----

    def start(self, on_loop: bool = False) -> None:
        """Start taking the core's outputs (a no-op when already started); `on_loop`: on the
        running event loop, when it is the only one that will use this AsyncLLM (the server)."""
        self.client.start(on_loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core; its tiers write their cached blocks down (disk / Redis) before it ends."""
        self.client.shutdown(timeout)

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
            with self._lock:
                streams, self._streams = self._streams, {}
            if streams:
                logger.warning("shutdown: ending %d requests still in flight after %.0f s (--shutdown-timeout)",
                               len(streams), drain_seconds)
                _deliver([(s, EngineDeadError("the server is shutting down")) for s in streams.values()])
                self.client.send((ABORT, list(streams), ABORT_SHUTDOWN))

        n = len(self._streams)
        if not n:
            logger.info("shutdown: no requests in flight")
        elif drain_seconds > 0:
            logger.info("shutdown: waiting up to %.0f s for %d requests in flight", drain_seconds, n)
        else:
            logger.info("shutdown: ending %d requests in flight", n)
        timer = threading.Timer(drain_seconds, end_the_rest)
        timer.daemon = True
        timer.start()

    @property
    def is_running(self) -> bool:
        return self._dead is None and self.client.is_alive

    def _why_not_running(self) -> str:
        return self._dead or getattr(self.client, "exit_reason", None) or "the engine loop is not running"

    # ----- messages to the core -----

    def call(self, fn: str | Callable[[], Any], *args) -> concurrent.futures.Future:
        """Run an engine method by name (or, with the core on a thread here, any callable) between
        two steps; the future carries its result or exception."""
        self.client.start()  # a no-op once started (the server starts it on its event loop)
        if not self.is_running:
            raise EngineDeadError(self._why_not_running())
        if callable(fn) and self.engine is None:
            raise TypeError("only named engine methods reach an engine core in another process")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = fut
        self.client.send((CALL, call_id, fn, args))
        return fut

    async def acall(self, fn: str | Callable[[], Any], *args) -> Any:
        return await asyncio.wrap_future(self.call(fn, *args))

    async def reset_prefix_cache(self) -> bool:
        return await self.acall("reset_prefix_cache")

    async def get_stats(self):
        return await self.acall("get_stats")

    def abort(self, request_id: str) -> None:
        """Fire-and-forget abort; safe from any thread, and a no-op for finished requests."""
        with self._lock:
            live = self._streams.pop(request_id, None) is not None
        if live and self.is_running:
            self.client.send((ABORT, [request_id], ABORT_CLIENT))

    async def add_request(self, prompt: str | list[int], params, request_id: str, priority: int = 0,
                          cache_salt: str | None = None, final_only: bool = False,
                          lora_request=None) -> "RequestStream":
        """Admit a request; raises the engine's RequestError before anything is streamed.
        `final_only`: the stream yields only the finished (cumulative) output.

        The caller must iterate the returned stream to its end or call its abort().
        """
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        self.client.start()  # a no-op once started (the server starts it on its event loop)
        if not self.is_running:
            raise EngineDeadError(self._why_not_running())
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), final_only,
                               mergeable=params.output_kind == RequestOutputKind.CUMULATIVE)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            self._streams[request_id] = stream._sink  # before the core can answer: no output is missed
            self._calls[call_id] = fut
        self._adding += 1
        try:
            self.client.send((ADD, call_id, request_id, prompt, params, priority, cache_salt, lora_request))
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still run; this abort is queued after it
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        finally:
            self._adding -= 1
        return stream

    @property
    def latest_stats(self):
        """The engine's stats as of its last iteration (every replica's, summed)."""
        from kvserve.engine.outputs import sum_stats
        stats = [s for s in self.stats_by_rank if s is not None]
        return sum_stats(stats) if stats else None

    def num_queued(self) -> int:
        """Requests waiting to be scheduled, as of the core's last iteration, and those on their
        way in (callable from any thread)."""
        return sum(s.num_waiting for s in self.stats_by_rank if s is not None) + self._adding

    async def generate(self, prompt: str | list[int], params, request_id: str, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator:
        """Yield RequestOutputs for one request until it finishes.

        add_request errors (RequestError) are raised before the first output. Leaving the
        iteration early (client gone, task cancelled) aborts the request in the engine.
        """
        stream = await self.add_request(prompt, params, request_id, priority, cache_salt)
        async for out in stream:
            yield out

    # ----- what the core sends back (on the client's thread) -----

    def _on_batch(self, batch: CoreBatch) -> None:
        if batch.stats is not None:  # first: whoever an output wakes sees the state that produced it
            self.stats_by_rank[batch.rank] = batch.stats
        self.num_step_errors = batch.num_step_errors
        with self._lock:
            replies = [(self._calls.pop(call_id, None), ok, value) for call_id, ok, value in batch.replies]
            failed = []
            if batch.failed:
                failed = [s for s in (self._streams.pop(rid, None) for rid in batch.failed[0]) if s is not None]
            deliveries = []
            for out in batch.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted by its client in the meantime
                if out.finished:
                    del self._streams[out.request_id]
                elif stream.final_only:
                    continue
                deliveries.append((stream, out))
        for fut, ok, value in replies:
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_result(value) if ok else fut.set_exception(value)
        if failed:
            error = EngineStepError(batch.failed[1])
            deliveries.extend((s, error) for s in failed)
        _deliver(deliveries)
        event = StepEvent(self.stats_by_rank[batch.rank], batch.outputs, batch.aborted, batch.now,
                          batch.num_step_errors, batch.progress, batch.ended, batch.rank)
        for listener in self.step_listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("step listener %r failed", listener)

    def _on_dead(self, reason: str) -> None:
        self._dead = reason
        with self._lock:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        error = EngineDeadError(reason)
        _deliver([(s, error) for s in streams.values()])
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
