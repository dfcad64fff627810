"""EngineCore: the loop that runs scheduling and the model, and nothing else.

Messages in (add, abort, a named engine call), one CoreBatch out per iteration. The same object
runs on the engine thread of an in-process AsyncLLM and as the main loop of the engine core
process (engine/core_proc.py); the front end (engine/async_engine.py) turns batches into streams,
metrics and logs. Messages are plain tuples so they pickle cheaply across the process boundary.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import TensorParallelError

logger = logging.getLogger(__name__)

# Front end -> core messages: (ADD, call_id, request_id, prompt, params, priority, cache_salt,
# lora_request),
# (ABORT, request_ids, reason), (CALL, call_id, engine method name, args), (SHUTDOWN,).
ADD, ABORT, CALL, SHUTDOWN = "add", "abort", "call", "shutdown"
# Why a request ended unfinished (the request log's abort_reason).
ABORT_CLIENT, ABORT_SHUTDOWN, ABORT_ERROR = "client", "shutdown", "error"


@dataclass
class CoreBatch:
    """What one loop iteration did: the outputs it produced and everything the front end reports."""
    outputs: list  # RequestOutputs due this step (a final-only request's only when it finishes)
    progress: list  # RequestProgress of every request the step gave tokens to
    stats: Any  # EngineStats after the iteration
    now: float  # time.monotonic() when the iteration ended (one clock for every process)
    num_step_errors: int = 0
    replies: list = field(default_factory=list)  # (call_id, ok, value or exception) for ADD / CALL
    aborted: list = field(default_factory=list)  # request ids their clients aborted
    ended: list = field(default_factory=list)  # (last RequestOutput, reason) of requests ended unfinished
    # A failed step: (request ids it failed, message); those requests are already aborted.
    failed: tuple[list[str], str] | None = None
    fatal: str | None = None  # why the engine cannot run another step: its process exits after this batch
    kv_events: list = field(default_factory=list)  # KV events, when the front end routes by them
    rank: int = 0  # the data-parallel replica that ran it


class EngineCore:
    def __init__(self, engine, data_parallel_rank: int = 0, forward_kv_events: bool = False) -> None:
        """`forward_kv_events`: each batch carries the step's KV events (a data-parallel front end
        routes by them); with --kv-events-config's zmq publisher they are also published here."""
        self.engine = engine
        self.rank = data_parallel_rank
        self.forward_kv_events = forward_kv_events
        self.publisher = None
        config = engine.args.kv_events
        if config is not None and config.publishing:
            from kvserve.engine.kv_events import ZmqEventPublisher
            self.publisher = ZmqEventPublisher(config, data_parallel_rank)
        self.num_step_errors = 0
        # Why the engine cannot run another step (a tensor-parallel rank is gone): the core
        # process sends the failed batch, then exits non-zero.
        self.fatal: str | None = None
        self._live: set[str] = set()  # requests admitted and not yet finished or aborted
        self._replies: list = []
        self._aborted: list[str] = []
        self._ended: list = []
        self._failed: tuple[list[str], str] | None = None

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == ADD:
            _, call_id, request_id, prompt, params, priority, cache_salt, lora_request = msg
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                        lora_request=lora_request)
            except Exception as e:  # RequestError: the front end raises it to its caller
                self._replies.append((call_id, False, e))
                return
            self._live.add(request_id)
            self._replies.append((call_id, True, None))
        elif kind == ABORT:
            _, request_ids, reason = msg
            self.abort(request_ids, reason)
        elif kind == CALL:
            _, call_id, name, args = msg
            try:
                fn = name if callable(name) else getattr(self.engine, name)  # a callable: in-process only
                self._replies.append((call_id, True, fn(*args)))
            except Exception as e:
                self._replies.append((call_id, False, e))
        else:
            raise ValueError(f"unknown engine core message {kind!r}")

    def abort(self, request_ids: list[str], reason: str) -> None:
        for rid in request_ids:
            if rid in self._live:
                self._live.discard(rid)
                if reason == ABORT_CLIENT:
                    self._aborted.append(rid)
                    logger.info("Aborted request %s.", rid)  # vLLM's line: a client left before the end
        self._ended.extend((out, reason) for out in self.engine.abort_request(request_ids))

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self.engine.take_kv_events())  # the shutdown's write-back included
            self.publisher.close()

    @property
    def has_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def iteration(self) -> CoreBatch:
        """One step when there is work (commands already handled), and what it produced."""
        outputs, progress = [], []
        if self.engine.has_unfinished_requests():
            outputs = self._step()
            progress = self.engine.last_step_progress
        try:
            stats = self.engine.get_stats()
        except Exception:
            logger.exception("get_stats failed")
            stats = None
        events = self.engine.take_kv_events()
        if self.publisher is not None:
            self.publisher.publish(events)
        batch = CoreBatch(outputs, progress, stats, time.monotonic(), self.num_step_errors, self._replies,
                          self._aborted, self._ended, self._failed, self.fatal,
                          events if self.forward_kv_events else [], self.rank)
        self._replies, self._aborted, self._ended, self._failed = [], [], [], None
        return batch

    def _step(self) -> list:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # The batch's state is unknown: fail and abort everything in flight, keep serving.
            self.num_step_errors += 1
            ids = sorted(self._live)
            logger.exception("engine step failed; aborting %d in-flight requests", len(ids))
            self._failed = (ids, f"engine step failed: {type(e).__name__}: {e}")
            if isinstance(e, TensorParallelError):
                self.fatal = str(e)
            self._live.clear()
            try:
                self._ended.extend((out, ABORT_ERROR) for out in self.engine.abort_request(ids))
            except Exception:
                logger.exception("abort after a failed step also failed")
            return []
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return outputs


def engine_info(engine) -> dict[str, Any]:
    """What a front end needs of an engine it does not hold (the core process's first message)."""
    return {"tokenizer": engine.tokenizer, "model_config": engine.model_config, "max_model_len": engine.max_model_len,
            "max_logprobs": engine.max_logprobs, "sampling_defaults": engine.sampling_defaults,
            "stats": engine.get_stats(), "kv_cache_bytes": engine.setup.budget.kv_cache_memory,
            # the other tensor-parallel ranks' processes on this machine (their memory is the engine's too)
            "rank_pids": getattr(engine.runner, "local_pids", lambda: [])(),
            # what decides a KV block's bytes: a decode server refuses a producer's KV by it
            "kv_fingerprint": engine.setup.fingerprint.hex if engine.setup.fingerprint is not None else None}
