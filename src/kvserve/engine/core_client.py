"""How the front end reaches the engine core: on a thread of its own process, or in another process.

Both clients take messages (engine/core.py) with `send` and hand every CoreBatch to `on_batch`
on a thread of their own; `on_dead` is called once when the core stops for good.

- InprocClient: EngineCore on a thread here. The engine object is at hand (tests reach into it,
  and a CALL may carry any callable), at the price of one interpreter lock for both sides.
- MPClient: EngineCore in a process of its own (engine/core_proc.py). Outputs come as deltas and
  are rebuilt here into vLLM's cumulative outputs, from the prompt this side already holds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import zmq

from kvserve.core.sampling_params import RequestOutputKind
from kvserve.engine.core import ADD, SHUTDOWN, CoreBatch, EngineCore

logger = logging.getLogger(__name__)

OnBatch = Callable[[CoreBatch], None]
OnDead = Callable[[str], None]


class EngineCoreStartError(RuntimeError):
    """The engine core process exited before it was ready."""


class InprocClient:
    BACKOFF_S = 0.005

    def __init__(self, engine, on_batch: OnBatch, on_dead: OnDead) -> None:
        self.engine = engine
        self.core = EngineCore(engine)
        self.on_batch, self.on_dead = on_batch, on_dead
        self._cv = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._stop = False
        self.thread: threading.Thread | None = None

    def start(self, on_loop: bool = False) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="kvserve-engine", daemon=True)
            self.thread.start()

    def send(self, msg: tuple) -> None:
        with self._cv:
            self._inbox.append(msg)
            self._cv.notify()

    @property
    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self._stop

    def shutdown(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        # Queued offload writes reach disk/Redis and the disk tier's directory lock is released.
        self.engine.close()
        self.core.close()

    def run(self) -> None:
        logger.info("engine loop started")
        core = self.core
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not core.has_requests:
                    self._cv.wait()
                if self._stop:
                    break
                msgs = list(self._inbox)
                self._inbox.clear()
            for msg in msgs:
                core.handle(msg)
            had_requests, started = core.has_requests, time.monotonic()
            batch = core.iteration()
            if had_requests and not batch.outputs and not batch.progress and time.monotonic() - started < 1e-3:
                # Nothing could be scheduled (no forward ran): back off briefly instead of
                # spinning, which would starve the event loop of the interpreter lock.
                with self._cv:
                    if not self._inbox:
                        self._cv.wait(self.BACKOFF_S)
            self.on_batch(batch)
            if core.fatal:  # a tensor-parallel rank is gone: no step can run again
                logger.error("the engine cannot continue: %s", core.fatal)
                with self._cv:
                    self._stop = True
                self.on_dead(f"the engine cannot continue: {core.fatal}")
                return
        self.on_dead("the server is shutting down")
        logger.info("engine loop stopped")


@dataclass
class _Accumulated:
    """One request's output so far, rebuilt from the core's deltas."""
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    texts: dict[int, str] = dataclasses.field(default_factory=dict)
    token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list | None = None


class OutputRebuilder:
    """Delta outputs from the core -> the outputs an in-process engine gives (cumulative, with
    the prompt): requests are registered when sent, forgotten when they finish or end."""

    def __init__(self) -> None:
        self._acc: dict[str, _Accumulated] = {}

    def expect(self, request_id: str, prompt_token_ids, prompt: str | None, kind: RequestOutputKind) -> None:
        ids = [] if isinstance(prompt_token_ids, str) else list(prompt_token_ids)
        self._acc[request_id] = _Accumulated(prompt, ids, kind)

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)

    def rebuild(self, out, ended: bool = False):
        acc = self._acc.get(out.request_id)
        if acc is None:
            return None
        if out.finished or ended:
            del self._acc[out.request_id]
        if out.prompt_logprobs is not None:
            acc.prompt_logprobs = out.prompt_logprobs
        delta_kind = acc.kind == RequestOutputKind.DELTA
        # Filled in place: the output was just unpickled and nothing else holds it (a streamed
        # token's two dataclasses.replace calls were 2.7 of the rebuild's 3.8 us).
        for o in out.outputs:
            i = o.index
            text = acc.texts[i] = acc.texts.get(i, "") + o.delta_text
            ids = acc.token_ids.setdefault(i, [])
            ids.extend(o.delta_token_ids)
            lps = None
            if o.delta_logprobs is not None:
                lps = acc.logprobs.setdefault(i, [])
                lps.extend(o.delta_logprobs)
            if delta_kind:
                text, ids, lps = o.delta_text, list(o.delta_token_ids), o.delta_logprobs
            else:
                ids, lps = list(ids), None if lps is None else list(lps)
            o.text, o.token_ids, o.logprobs = text, ids, lps
        out.prompt, out.prompt_token_ids, out.prompt_logprobs = acc.prompt, acc.prompt_token_ids, acc.prompt_logprobs
        return out


class MPClient:
    POLL_MS = 200
    SHUTDOWN_GRACE_S = 90.0  # the core writes its cached blocks down to disk / Redis (60 s at most)

    def __init__(self, args, on_batch: OnBatch, on_dead: OnDead, rank: int = 0, cpus: list[int] | None = None,
                 forward_kv_events: bool = False, wait: bool = True, env: dict[str, str] | None = None) -> None:
        """`rank`, `cpus`, `forward_kv_events`, `env` (variables set for the process only, such as
        its tensor-parallel ranks' CPU lists): a data-parallel replica's (engine/dp_client.py);
        `wait=False` returns once the process is started (then call wait_ready())."""
        self.on_batch, self.on_dead = on_batch, on_dead
        self.rank = rank
        self.rebuilder = OutputRebuilder()
        self._adds: dict[int, str] = {}  # ADD call ids awaiting their reply -> request ids
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")  # 0700: only this user reaches the sockets
        self._zmq = zmq.Context()
        self._inbox = self._zmq.socket(zmq.PUSH)  # the core's inbox
        self._outbox = self._zmq.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._inbox.bind(in_addr)
        self._outbox.bind(out_addr)
        self._lock = threading.Lock()  # send() is called from the event loop, timers and the receiver
        self._loop: asyncio.AbstractEventLoop | None = None  # outputs taken on this loop (start())
        self._watch: asyncio.TimerHandle | None = None
        self._dead = False
        self._closing = False
        self._shutdown_sent = False  # SHUTDOWN already on its way (a data-parallel client sends it to all at once)
        root = logging.getLogger()
        fmt = root.handlers[0].formatter._fmt if root.handlers and root.handlers[0].formatter else None
        # A fresh interpreter on this package (never a fork of one that may hold torch threads,
        # and never a re-run of the caller's __main__, as multiprocessing's spawn would do).
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.engine.core_proc"], stdin=subprocess.PIPE,
                                     env=dict(os.environ, **(env or {}), PYTHONPATH=path))
        with self.proc.stdin as stdin:
            pickle.dump((args, in_addr, out_addr, root.getEffectiveLevel(), fmt, os.getpid(), rank, cpus,
                         forward_kv_events), stdin)
        self.info: dict = {}
        self.thread = threading.Thread(target=self._receive, name=f"kvserve-core-outputs-{rank}", daemon=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the core has built its engine and warmed up; raises why it could not."""
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._close_sockets()
            raise

    def _wait_ready(self) -> dict:
        from kvserve.engine.core_proc import FAILED
        while not self._outbox.poll(self.POLL_MS):
            if self.proc.poll() is not None:
                raise EngineCoreStartError(f"the engine core process exited with code {self.proc.returncode} "
                                           f"before it was ready; its log lines above say why")
        kind, value = pickle.loads(self._outbox.recv())
        if kind == FAILED:
            # The process exits by itself after sending why; on a loaded machine it may not within
            # the wait, and then the reason must still reach the user and no orphan stay behind.
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            raise value
        return value

    def start(self, on_loop: bool = False) -> None:
        """Take outputs on a thread, or with `on_loop` on the running event loop (the server's,
        which lives as long as the engine): there a batch costs no thread switch and no wake-up
        of the loop."""
        if self.thread.ident is not None or self._loop is not None or self._dead:
            return
        if not on_loop:
            self.thread.start()
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._outbox.getsockopt(zmq.FD), self._on_readable)
        self._watch = self._loop.call_later(self.POLL_MS / 1000, self._check_alive)

    def _on_readable(self) -> None:
        # The ZMQ descriptor is edge-triggered: drain every queued batch on each wake-up.
        while not self._closing and self._outbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._take(self._outbox.recv(zmq.NOBLOCK))

    def _check_alive(self) -> None:
        if self._closing or self._dead:
            return
        if self.proc.poll() is not None:
            self._on_readable()  # what it sent before it died
            self._stop_loop_reader()
            self._die(self.exit_reason)
            return
        self._on_readable()  # a wake-up the edge-triggered descriptor may have folded into another
        self._watch = self._loop.call_later(self.POLL_MS / 1000, self._check_alive)

    def _stop_loop_reader(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._outbox.getsockopt(zmq.FD))
            if self._watch is not None:
                self._watch.cancel()

    def _take(self, data: bytes) -> None:
        batch: CoreBatch = pickle.loads(data)
        self._rebuild(batch)
        self.on_batch(batch)

    def _die(self, reason: str) -> None:
        if not self._dead:
            self._dead = True
            if reason != "the server is shutting down":
                logger.error("%s; every request in flight fails, and /health reports 503", reason)
            self.on_dead(reason)

    def send(self, msg: tuple) -> None:
        if msg[0] == ADD:
            _, call_id, request_id, prompt, params, *rest = msg
            text = None
            if isinstance(prompt, str) and prompt:  # tokenized here: the core gets token ids only
                text, prompt = prompt, self.info["tokenizer"].encode(prompt)
                msg = (ADD, call_id, request_id, prompt, params, *rest)
            self.rebuilder.expect(request_id, prompt, text, params.output_kind)
            self._adds[call_id] = request_id
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if not self._closing:
                self._inbox.send(data)
                self._shutdown_sent |= msg[0] == SHUTDOWN

    @property
    def is_alive(self) -> bool:
        return not self._dead and not self._closing and self.proc.poll() is None

    @property
    def exit_reason(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"the engine core process exited with code {code}"

    def _receive(self) -> None:
        reason = "the server is shutting down"
        while not self._closing:
            if not self._outbox.poll(self.POLL_MS):
                if self.proc.poll() is not None:
                    reason = self.exit_reason
                    break
                continue
            self._take(self._outbox.recv())
        self._die(reason)

    def _rebuild(self, batch: CoreBatch) -> None:
        r = self.rebuilder
        for call_id, ok, _ in batch.replies:
            rid = self._adds.pop(call_id, None)
            if rid is not None and not ok:  # a refused request: nothing more comes for it
                r.forget(rid)
        batch.outputs = [o for o in (r.rebuild(out) for out in batch.outputs) if o is not None]
        batch.ended = [(o, why) for o, why in ((r.rebuild(out, ended=True), why) for out, why in batch.ended)
                       if o is not None]
        if batch.failed:
            for rid in batch.failed[0]:
                r.forget(rid)

    def shutdown(self, timeout: float) -> None:
        with self._lock:
            if not self._closing and not self._shutdown_sent and self.proc.poll() is None:
                self._inbox.send(pickle.dumps((SHUTDOWN,)))
            self._closing = True
        try:
            self.proc.wait(max(timeout, self.SHUTDOWN_GRACE_S))
        except subprocess.TimeoutExpired:
            logger.warning("the engine core process did not stop in %.0f s; killing it", self.SHUTDOWN_GRACE_S)
            self.proc.kill()
            self.proc.wait(10)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(2 * self.POLL_MS / 1000 + 1)
        self._stop_loop_reader()
        self._close_sockets()
        self._die("the server is shutting down")

    def _close_sockets(self) -> None:
        self._inbox.close(linger=0)
        self._outbox.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


