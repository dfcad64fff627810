"""Tensor-parallel ranks 1..N-1 as Ray actors (--distributed-executor-backend ray), for ranks on
several machines of a Ray cluster the user started (`ray start --head`; never started here).

Each actor runs the same worker loop as a spawned rank (engine/tp_worker.py) on a
multiprocessing.connection Client dialled back to a Listener on rank 0's node: it has a pipe's
send/recv/poll, so the per-step protocol and its bounded waits are the mp backend's. The group's
rendezvous is rank 0's node IP, not 127.0.0.1, so ranks on other nodes can join. An actor that
dies closes its connection and its gloo sockets, as a dead process does; its `run` call's result
then says how it ended. Ray is imported only here, only for this backend.
"""
from __future__ import annotations

import logging
import os
import socket
import time

from kvserve.config import NO_RAY, ConfigError
from kvserve.errors import TensorParallelError

logger = logging.getLogger(__name__)

_connected_here = False  # whether ray.init was ours (then ours to disconnect, never the cluster to stop)


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError(NO_RAY) from e
    return ray


def connect():
    """Join the running cluster (RAY_ADDRESS, else the one `ray start` on this machine recorded)."""
    global _connected_here
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        _probe(address)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"--distributed-executor-backend ray found no Ray cluster at {address} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); start one with "
                          f"`ray start --head` (and `ray start --address <head>:6379` on each other node), set "
                          f"RAY_ADDRESS to its address, or use --distributed-executor-backend mp") from e
    _connected_here = True
    return ray


def _probe(address: str) -> None:
    """Fail in seconds where no cluster answers: ray.init waits minutes on an address nobody serves."""
    if "://" in address:
        return  # Ray Client (ray://): its own connect is bounded
    target = address
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address_or_die
        except ImportError:
            return
        target = canonicalize_bootstrap_address_or_die("auto")  # ConnectionError when `ray start` ran nowhere here
    host, _, port = target.rpartition(":")
    socket.create_connection((host, int(port)), timeout=5.0).close()


def disconnect() -> None:
    """Leave the cluster if this process joined it here (the cluster itself keeps running)."""
    global _connected_here
    if _connected_here:
        import ray
        ray.shutdown()
        _connected_here = False


class _RankActor:
    """One rank's process on some node of the cluster."""

    def run(self, address, authkey: bytes, rank0_node: str, args, rank, world, host, port, cpus, budget, dtype,
            device, kv_scales, timeout_s, log_level) -> str:
        from multiprocessing.connection import Client

        import ray

        from kvserve.engine import tp_worker
        here = ray.util.get_node_ip_address()
        if ray.get_runtime_context().get_node_id() != rank0_node:
            cpus = None  # rank 0's CPU numbers mean nothing on another node: Ray's num_cpus sets the threads
        conn = Client(address, authkey=authkey)
        conn.send((rank, here, os.getpid()))
        tp_worker.main(args, rank, world, port, cpus, budget, dtype, device, kv_scales, conn, timeout_s, log_level,
                       host=host, own_process=False)
        return "returned"


class RayProc:
    """A rank's actor with the part of multiprocessing.Process's API the executor uses."""

    backend = "ray"

    def __init__(self, ray, actor, rank: int) -> None:
        self._ray, self.actor, self.rank = ray, actor, rank
        self.done = None  # the ObjectRef of its `run` call
        self.node, self.pid = "?", None
        self._ended: str | None = None

    def join(self, wait_s: float = 0.0) -> None:
        if self._ended is not None or self.done is None:
            return
        ready, _ = self._ray.wait([self.done], timeout=max(wait_s, 0.0))
        if not ready:
            return
        try:
            self._ray.get(self.done)
            self._ended = "stopped"
        except Exception as e:  # RayActorError: the actor's process is gone (killed, out of memory, os._exit)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self._ended = f"died ({type(e).__name__}: {first})"
        self.kill()  # its loop is over: the actor would otherwise idle on the cluster, holding its CPUs

    def how_ended(self, wait_s: float = 0.0) -> str | None:
        self.join(wait_s)
        return self._ended

    @property
    def where(self) -> str:
        return f"Ray actor, process {self.pid} on node {self.node}"

    def is_alive(self) -> bool:
        return self.done is not None and self._ended is None

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception as e:  # already gone
            logger.debug("ray.kill of rank %d: %s", self.rank, e)
        self._ended = self._ended or "was killed (ray.kill)"

    terminate = kill


def start_actors(args, world: int, cpus, port: int, rank0_ip: str, budget, dtype, device, kv_scales, timeout_s: float,
                 log_level: int, start_timeout_s: float) -> list[tuple[int, RayProc, object]]:
    """Place ranks 1..world-1 as actors, each dialling back to a Listener here; (rank, proc, connection)
    once every one has connected, or TensorParallelError naming the rank that did not."""
    from multiprocessing.connection import Listener
    ray = connect()
    remote = ray.remote(_RankActor)
    authkey = os.urandom(32)
    listener = Listener((rank0_ip, 0), authkey=authkey)
    procs: dict[int, RayProc] = {}
    conns: dict[int, object] = {}
    try:
        for r in range(1, world):
            num_cpus = len(cpus[r]) if cpus[r] else 1
            # Ray runs its workers at niceness 15: a rank below its peers' priority waits for them at
            # every all-reduce on a busy machine (half the decode tok/s on 2 cores: bench/NOTES.md).
            actor = remote.options(num_cpus=num_cpus, max_restarts=0, name=f"kvserve-tp-rank{r}-{os.getpid()}",
                                   runtime_env={"env_vars": {"RAY_worker_niceness": "0"}}).remote()
            proc = RayProc(ray, actor, r)
            procs[r] = proc
            proc.done = actor.run.remote(listener.address, authkey, ray.get_runtime_context().get_node_id(), args, r, world, rank0_ip, port, cpus[r],
                                         budget, dtype, device, kv_scales, timeout_s, log_level)
        # Accept with a bound: an actor Ray cannot place (too few CPUs) never dials.
        sock = listener._listener._socket
        sock.settimeout(1.0)
        deadline = time.monotonic() + start_timeout_s
        while len(conns) < world - 1:
            try:
                conn = listener.accept()
            except (socket.timeout, TimeoutError):
                for r, proc in procs.items():
                    if r not in conns and proc.how_ended():
                        raise TensorParallelError(f"tensor-parallel rank {r} (Ray actor) {proc.how_ended()} "
                                                  f"while starting")
                if time.monotonic() > deadline:
                    missing = sorted(set(procs) - set(conns))
                    raise TensorParallelError(
                        f"tensor-parallel ranks {missing} (Ray actors) did not connect within "
                        f"{start_timeout_s:.0f} s: the cluster may lack the CPUs they ask for "
                        f"(`ray status`), or this node's address {rank0_ip} is unreachable from theirs")
                continue
            if not conn.poll(timeout_s):
                conn.close()
                continue
            r, procs[r].node, procs[r].pid = conn.recv()
            conns[r] = conn
    except BaseException:
        for proc in procs.values():
            proc.kill()
        for conn in conns.values():
            conn.close()
        raise
    finally:
        listener.close()
    return [(r, procs[r], conns[r]) for r in sorted(procs)]


def node_ip() -> str:
    """This node's address as the cluster knows it (the rendezvous and the Listener bind to it)."""
    ray = connect()
    return ray.util.get_node_ip_address()
