"""Data parallelism on one machine: N engine core processes behind one front end.

DPClient looks like one core client to AsyncLLM (send, start, shutdown, is_alive) and fans out:
- ADD goes to the replica a routing policy picks (kvserve/routing): from the prompt's prefix-cache
  block hashes, matched against what each replica's KV events say it holds, and from each
  replica's load (running and waiting as of its last step, plus requests still on their way).
- ABORT goes to the replica that holds the request; CALL to every live replica, and the answers
  are combined into one (reset_prefix_cache: all must succeed; get_stats: summed; others: the
  lowest live rank's).
- Each replica's batches come back tagged with its rank (CoreBatch.rank): metrics carry it as
  vLLM's `engine` label.

A replica that dies fails only its own requests and leaves the rotation; the others keep serving.
Each replica is its own process with its own KV pool and its own share of the CPUs (cpu_bind.py).
With tensor parallelism each replica's engine core drives its own T ranks (engine/tp_executor.py):
the replica is handed its ranks' CPU lists (or its T GPUs) and counts as one replica throughout.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from functools import partial

from kvserve.config import ConfigError, host_memory
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.core import ABORT, ADD, CALL, SHUTDOWN, CoreBatch
from kvserve.engine.core_client import MPClient, OnBatch, OnDead
from kvserve.engine.outputs import sum_stats
from kvserve.kv.hashing import extend_block_hashes, root_hash
from kvserve.routing import Replica, make_policy

logger = logging.getLogger(__name__)


def replica_args(args, rank: int):
    """A replica's own EngineArgs: a disk tier directory of its own (one writer per directory)."""
    if args.kv_disk_path:
        return dataclasses.replace(args, kv_disk_path=os.path.join(args.kv_disk_path, f"dp{rank}"))
    return args


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _visible_gpus(device: str) -> tuple[int, str | None]:
    """(GPUs this process sees, CUDA_VISIBLE_DEVICES) where the engine will run on CUDA, else (0, None)."""
    if device == "cpu":
        return 0, None
    import torch
    if device == "auto" and not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")


def replica_gpus(dp: int, tp: int, count: int, visible: str | None) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: T GPUs of its own (replica r the r-th T of the visible
    ones), or None to inherit this process's (on CPU; and without tensor parallelism where there
    are fewer GPUs than replicas, which then share them as before)."""
    if count == 0:
        return [None] * dp
    if dp * tp > count:
        if tp == 1:
            return [None] * dp
        raise ConfigError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs {dp * tp} GPUs, one per "
                          f"rank of each replica, but {count} are visible; lower --data-parallel-size or "
                          f"--tensor-parallel-size so that their product is at most {count}")
    ids = [d.strip() for d in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
    return [",".join(ids[r * tp:(r + 1) * tp]) for r in range(dp)]


def _first(results: dict):
    return results[min(results)]


# How the answers of a CALL sent to every replica become one.
COMBINE = {"reset_prefix_cache": lambda r: all(r.values()),
           "get_stats": lambda r: sum_stats([r[k] for k in sorted(r)])}


class DPClient:
    def __init__(self, args, on_batch: OnBatch, on_dead: OnDead) -> None:
        from kvserve import envs
        from kvserve.engine.cpu_bind import replica_cpu_sets
        n, tp = args.data_parallel_size, args.tensor_parallel_size
        binds = replica_cpu_sets(n, tp, envs.VLLM_CPU_OMP_THREADS_BIND)
        cpus = [c for c, _ in binds]
        gpus = replica_gpus(n, tp, *_visible_gpus(args.device))
        self._envs = [{k: v for k, v in (("VLLM_CPU_OMP_THREADS_BIND", bind), ("CUDA_VISIBLE_DEVICES", g))
                       if v is not None} for (_, bind), g in zip(binds, gpus)]
        self._fatal: dict[int, str] = {}  # replica -> why its tensor-parallel group failed (it exits next)
        self.on_batch, self.on_dead = on_batch, on_dead
        self.policy = make_policy(args.data_parallel_routing)
        self.block_size, self.kv_cache_dtype = args.block_size, args.kv_cache_dtype
        self._lock = threading.RLock()  # batches arrive on one thread per replica unless on the event loop
        self.replicas = [Replica(r) for r in range(n)]
        self._rank_of: dict[str, int] = {}  # live request -> replica
        self._adds: dict[int, int] = {}  # ADD call id awaiting its reply -> replica
        self._calls: dict[int, dict] = {}  # broadcast CALL id -> {"name", "waiting": ranks, "results", "error"}
        self._closing = False
        self._dead_reported = False
        self.clients: list[MPClient] = []
        try:
            # Replica 0 first, alone: what it occupies decides whether the others fit.
            self.clients.append(self._start(args, 0, cpus[0], wait=True))
            self._check_memory(args, n)
            rest = [self._start(args, r, cpus[r], wait=False) for r in range(1, n)]
            self.clients.extend(rest)
            for c in rest:
                c.wait_ready()
        except BaseException:
            for c in self.clients:
                if c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait(10)
            raise
        self.info = dict(self.clients[0].info, stats=[c.info["stats"] for c in self.clients])
        for rep, c in zip(self.replicas, self.clients):
            s = c.info["stats"]
            rep.num_running, rep.num_waiting = s.num_running, s.num_waiting
        logger.info("%d data-parallel engine core processes%s, CPUs %s, routing: %s", n,
                    f" of {tp} tensor-parallel ranks each" if tp > 1 else "",
                    [e.get("VLLM_CPU_OMP_THREADS_BIND", c) for e, c in zip(self._envs, cpus)], self.policy.name)

    def _start(self, args, rank: int, cpus, wait: bool) -> MPClient:
        return MPClient(replica_args(args, rank), partial(self._on_rank_batch, rank), partial(self._on_rank_dead, rank),
                        rank=rank, cpus=cpus, forward_kv_events=True, wait=wait, env=self._envs[rank])

    def _check_memory(self, args, n: int) -> None:
        """Each further replica takes what the first one does (weights + KV pool): refuse to start
        N that cannot fit, instead of letting the kernel's OOM killer pick one later."""
        available = host_memory("MemAvailable")
        info = self.clients[0].info
        # With tensor parallelism a replica is its engine core plus its other ranks' processes,
        # each holding its share of the weights and a KV pool of kv_cache_bytes.
        pids = [self.clients[0].proc.pid, *info.get("rank_pids", ())]
        sizes = [_rss_bytes(pid) for pid in pids]
        if available is None or None in sizes or n == 1:
            return
        rss = sum(sizes)
        kv = info.get("kv_cache_bytes", 0) * args.tensor_parallel_size
        per_replica = max(rss, kv)
        need = (n - 1) * per_replica
        if need > available:
            raise ConfigError(
                f"--data-parallel-size {n} needs about {n * per_replica / 2**30:.1f} GiB ({per_replica / 2**30:.2f} "
                f"GiB per replica: weights + KV cache, measured on the first"
                f"{f' and its {len(pids) - 1} other tensor-parallel ranks' if len(pids) > 1 else ''}) "
                f"but {available / 2**30:.1f} GiB more is available after the first; lower --data-parallel-size "
                f"or --kv-cache-memory")

    # ----- the client interface -----

    def start(self, on_loop: bool = False) -> None:
        for c in self.clients:
            c.start(on_loop)

    @property
    def is_alive(self) -> bool:
        return any(c.is_alive for c in self.clients) and not self._closing

    @property
    def exit_reason(self) -> str | None:
        reasons = [c.exit_reason for c in self.clients]
        if any(r is None for r in reasons):
            return None
        return "; ".join(f"data-parallel replica {i}: {r}" for i, r in enumerate(reasons))

    def send(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == ADD:
            self._send_add(msg)
        elif kind == ABORT:
            _, request_ids, reason = msg
            by_rank: dict[int, list[str]] = {}
            with self._lock:
                for rid in request_ids:
                    rank = self._rank_of.pop(rid, None)
                    if rank is not None:
                        by_rank.setdefault(rank, []).append(rid)
            for rank, rids in by_rank.items():
                self.clients[rank].send((ABORT, rids, reason))
        elif kind == CALL:
            _, call_id, name, _args = msg
            with self._lock:
                live = [r.rank for r in self.replicas if r.alive]
                self._calls[call_id] = {"name": name, "waiting": set(live), "results": {}, "error": None}
            for rank in live:
                self.clients[rank].send(msg)
        elif kind == SHUTDOWN:
            for c in self.clients:
                c.send(msg)
        else:
            raise ValueError(f"unknown engine core message {kind!r}")

    def _send_add(self, msg: tuple) -> None:
        _, call_id, request_id, prompt, params, priority, cache_salt, lora_request = msg
        hashes: list[bytes] = []
        if lora_request is None:  # an adapter's requests hash under its weights' digest, known in the core
            ids = self.clients[0].info["tokenizer"].encode(prompt) if isinstance(prompt, str) else prompt
            hashes = extend_block_hashes([], root_hash(self.kv_cache_dtype, cache_salt, None), ids, self.block_size)
        with self._lock:
            rank = self.policy.choose(hashes, self.replicas)
            self.replicas[rank].num_pending += 1
            self._adds[call_id] = rank
            self._rank_of[request_id] = rank
        self.clients[rank].send(msg)

    def shutdown(self, timeout: float) -> None:
        self._closing = True
        for c in self.clients:  # every replica starts its write-back at once
            c.send((SHUTDOWN,))
        for c in self.clients:
            c.shutdown(timeout)
        self._report_dead("the server is shutting down")

    # ----- what the replicas send back -----

    def _on_rank_batch(self, rank: int, batch: CoreBatch) -> None:
        with self._lock:
            rep = self.replicas[rank]
            rep.index.apply(batch.kv_events)
            replies = []
            for call_id, ok, value in batch.replies:
                if self._adds.pop(call_id, None) is not None:
                    rep.num_pending -= 1
                    replies.append((call_id, ok, value))
                elif call_id in self._calls:
                    done = self._call_answered(call_id, rank, ok, value)
                    if done is not None:
                        replies.append(done)
                else:
                    replies.append((call_id, ok, value))
            batch.replies = replies
            if batch.stats is not None:
                rep.num_running, rep.num_waiting = batch.stats.num_running, batch.stats.num_waiting
            for out in batch.outputs:
                if out.finished:
                    self._rank_of.pop(out.request_id, None)
            for out, _ in batch.ended:
                self._rank_of.pop(out.request_id, None)
            if batch.failed:
                rids, why = batch.failed
                for rid in rids:
                    self._rank_of.pop(rid, None)
                batch.failed = (rids, f"data-parallel replica {rank}: {why}")
                if batch.fatal:  # its tensor-parallel group cannot step again: the replica's process exits next
                    self._fatal[rank] = why
        self.on_batch(batch)

    def _call_answered(self, call_id: int, rank: int, ok: bool, value) -> tuple | None:
        call = self._calls[call_id]
        call["waiting"].discard(rank)
        if ok:
            call["results"][rank] = value
        elif call["error"] is None:
            call["error"] = value
        if call["waiting"]:
            return None
        del self._calls[call_id]
        if call["error"] is not None:
            return call_id, False, call["error"]
        if not call["results"]:
            return call_id, False, RuntimeError("no data-parallel replica answered")
        return call_id, True, COMBINE.get(call["name"], _first)(call["results"])

    def _on_rank_dead(self, rank: int, reason: str) -> None:
        if rank in self._fatal:
            reason = f"{reason} after its tensor-parallel group failed ({self._fatal[rank]})"
        with self._lock:
            rep = self.replicas[rank]
            if not rep.alive:
                return
            rep.alive = False
            rep.index = type(rep.index)()
            lost = [rid for rid, r in self._rank_of.items() if r == rank]
            for rid in lost:
                del self._rank_of[rid]
            lost_adds = [cid for cid, r in self._adds.items() if r == rank]
            replies = []
            for cid in lost_adds:
                del self._adds[cid]
                replies.append((cid, False, EngineDeadError(f"data-parallel replica {rank} stopped: {reason}")))
            for cid in [cid for cid, c in self._calls.items() if rank in c["waiting"]]:
                done = self._call_answered(cid, rank, False, EngineDeadError(f"data-parallel replica {rank} stopped: "
                                                                             f"{reason}"))
                if done is not None:
                    replies.append(done)
            everyone_gone = not any(r.alive for r in self.replicas)
        if self._closing:
            if everyone_gone:
                self._report_dead("the server is shutting down")
            return
        if everyone_gone:
            self._report_dead(self.exit_reason or f"every data-parallel replica stopped ({reason})")
            return
        logger.error("data-parallel replica %d stopped (%s): its %d requests fail; the other replicas keep serving",
                     rank, reason, len(lost))
        self.on_batch(CoreBatch([], [], None, time.monotonic(), replies=replies,
                                failed=(lost, f"data-parallel replica {rank} stopped: {reason}") if lost else None,
                                rank=rank))

    def _report_dead(self, reason: str) -> None:
        if not self._dead_reported:
            self._dead_reported = True
            self.on_dead(reason)
