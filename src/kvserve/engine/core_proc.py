"""The engine core process: builds the engine, then runs EngineCore's loop on its main thread.

Why a process: the front end (HTTP, JSON, SSE, tokenizing, rebuilding outputs) and the engine's
own Python (scheduling, sampling bookkeeping) no longer take turns on one interpreter lock, and
the core's OpenMP team is the only one in its process. Messages arrive on a ZMQ PULL socket and
batches leave on a PUSH socket, both pickled: both ends are this package, on one machine, over
ipc:// sockets in a directory only this user can open.

The process ignores SIGINT and SIGTERM: the front end owns the shutdown (drain, then SHUTDOWN),
and a Ctrl-C or a service manager's SIGTERM to the whole process group must not cut the drain
short. It exits on SHUTDOWN, or by itself when its parent is gone.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import time

logger = logging.getLogger(__name__)

READY, FAILED = "ready", "failed"  # the first message out: the engine's description, or why not
PARENT_CHECK_S = 1.0
IDLE_POLL_MS = 1000
BACKOFF_POLL_MS = 5  # nothing could be scheduled: wait briefly for a message instead of spinning


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def main(args, in_addr: str, out_addr: str, log_level: int, log_format: str | None, parent_pid: int,
         rank: int = 0, cpus: list[int] | None = None, forward_kv_events: bool = False) -> None:
    """`rank`: the data-parallel rank; `cpus`: the CPUs this replica runs on (bound before torch
    starts its OpenMP team, which sizes itself to them); `forward_kv_events`: batches carry the
    KV events, for a front end that routes by them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
        os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    logging.basicConfig(level=log_level, format=log_format)
    import zmq

    from kvserve.engine.core import SHUTDOWN, EngineCore, engine_info
    from kvserve.engine.engine import LLMEngine

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 10_000)
    try:
        engine = LLMEngine.from_engine_args(args)
    except BaseException as e:  # the front end raises it to whoever started the server
        logger.debug("engine build failed", exc_info=True)
        outbox.send(pickle.dumps((FAILED, _picklable(e))))
        outbox.close()
        ctx.term()
        return
    engine.send_deltas = True
    outbox.send(pickle.dumps((READY, engine_info(engine))))
    logger.info("engine core process %d started%s", os.getpid(),
                f" (data-parallel rank {rank}, CPUs {cpus})" if rank or cpus else "")
    core = EngineCore(engine, rank, forward_kv_events)
    try:
        _loop(core, inbox, outbox, parent_pid, SHUTDOWN)
    finally:
        engine.close()  # the tiers' write-back, and the disk tier's lock
        core.close()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
        logger.info("engine core process %d stopped", os.getpid())


def _loop(core, inbox, outbox, parent_pid: int, shutdown: str) -> None:
    import zmq
    next_parent_check = time.monotonic() + PARENT_CHECK_S
    while True:
        # Every queued message is handled before the next step; with nothing to run, wait for one.
        got = inbox.poll(0 if core.has_requests else IDLE_POLL_MS)
        if time.monotonic() > next_parent_check:
            if os.getppid() != parent_pid:
                logger.warning("the front-end process %d is gone; the engine core stops", parent_pid)
                return
            next_parent_check = time.monotonic() + PARENT_CHECK_S
        if got:
            while True:
                try:
                    msg = pickle.loads(inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if msg[0] == shutdown:
                    return
                core.handle(msg)
        elif not core.has_requests:
            continue
        had_requests, started = core.has_requests, time.monotonic()
        batch = core.iteration()
        outbox.send(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        if core.fatal:
            logger.error("the engine cannot continue: %s", core.fatal)
            raise SystemExit(1)
        if had_requests and not batch.outputs and not batch.progress and time.monotonic() - started < 1e-3:
            inbox.poll(BACKOFF_POLL_MS)


if __name__ == "__main__":  # started by MPClient, which writes main's arguments to stdin
    import sys
    main(*pickle.load(sys.stdin.buffer))
