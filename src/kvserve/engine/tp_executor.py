"""Tensor parallelism's executor: rank 0 runs in the engine's own process and drives ranks 1..N-1,
each a process of its own (engine/tp_worker.py), spawned here or placed by Ray (engine/tp_ray.py).

Why rank 0 here, as vLLM's uniprocess driver: the sampled tokens come out of rank 0's runner in
the process that schedules, with no reply to wait for per step, and one process fewer shares the
cores. Each step goes to the other ranks once, pickled on a pipe before rank 0 runs it (measured
against torch.distributed's broadcast_object_list: bench/NOTES.md); inside the step the ranks
meet only in the all-reduces. Every wait is bounded: the group's collectives by
KVSERVE_TP_TIMEOUT_S, the start by the same bound past the model load, and a rank that dies is
noticed at the next collective (its sockets close), named, and fails the step with
TensorParallelError; the group then refuses every later step (the engine core process exits).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from dataclasses import dataclass

import torch

from kvserve import envs
from kvserve.config import ConfigError, EngineArgs
from kvserve.errors import TensorParallelError
from kvserve.runner.distributed import AllReduce, destroy_group, free_port, from_wire, init_group, to_wire

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a rank's model load (the first dequantization of a GGUF checkpoint is slow)
STOP_TIMEOUT_S = 5.0


def rank_cpus(args: EngineArgs, device: torch.device) -> list[list[int] | None]:
    """The CPUs of each rank (VLLM_CPU_OMP_THREADS_BIND: auto splits this process's CPUs, or one
    list per rank), or Nones on CUDA, where each rank has a GPU of its own."""
    tp = args.tensor_parallel_size
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if tp > count:
            raise ConfigError(f"--tensor-parallel-size {tp} needs one GPU per rank, but {count} are visible; "
                              f"lower --tensor-parallel-size to at most {count}")
        return [None] * tp
    from kvserve.engine.cpu_bind import cpu_sets
    return cpu_sets(tp, envs.VLLM_CPU_OMP_THREADS_BIND, flag="--tensor-parallel-size")


@dataclass
class _Rank:
    rank: int
    proc: object  # multiprocessing.Process
    conn: object  # its end of the pipe

    def exit_reason(self, wait_s: float = 0.0) -> str | None:
        if getattr(self.proc, "backend", "mp") == "ray":
            how = self.proc.how_ended(wait_s)
            return None if how is None else f"tensor-parallel rank {self.rank} ({self.proc.where}) {how}"
        self.proc.join(wait_s)
        code = self.proc.exitcode
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"tensor-parallel rank {self.rank} (process {self.proc.pid}) {how}"

    def message(self, wait_s: float = 0.0):
        try:
            if self.conn.poll(wait_s):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None


def start(args: EngineArgs, loaded, budget, dtype: torch.dtype, device: torch.device, kv_scales):
    """Start ranks 1..N-1, build rank 0's runner here, join the group: the runner the engine steps."""
    import multiprocessing as mp

    from kvserve.engine import tp_worker
    from kvserve.runner.build import cuda_graph_sizes, make_runner

    tp = args.tensor_parallel_size
    cpus = rank_cpus(args, device)
    timeout_s = envs.KVSERVE_TP_TIMEOUT_S
    ray = args.distributed_executor_backend == "ray"
    host = "127.0.0.1"
    if ray:
        from kvserve.engine import tp_ray
        host = tp_ray.node_ip()  # connects to the cluster, or a ConfigError naming the fix
    port = free_port(host)
    ctx = mp.get_context("spawn")
    ranks: list[_Rank] = []
    saved = (os.sched_getaffinity(0), torch.get_num_threads())
    runner = None
    log_level = logging.getLogger().getEffectiveLevel()
    try:
        if ray:
            ranks = [_Rank(r, proc, conn) for r, proc, conn in tp_ray.start_actors(
                args, tp, cpus, port, host, budget, dtype, device, kv_scales, timeout_s, log_level, START_TIMEOUT_S)]
        for r in range(1, tp) if not ray else ():
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=tp_worker.main, name=f"kvserve-tp-rank{r}", daemon=True,
                            args=(args, r, tp, port, cpus[r], budget, dtype, device, kv_scales, theirs, timeout_s,
                                  log_level))
            p.start()
            theirs.close()
            ranks.append(_Rank(r, p, mine))
        if cpus[0]:
            os.sched_setaffinity(0, cpus[0])
            torch.set_num_threads(len(cpus[0]))
        if device.type == "cuda":
            torch.cuda.set_device(0)
        runner = make_runner(args, loaded.config, loaded.weights, loaded.codes, budget, dtype, device, kv_scales, 0)
        _await(ranks, "built", START_TIMEOUT_S)
        init_group(0, tp, port, device, timeout_s, host)
        runner.model.all_reduce = AllReduce()
        # Every rank captures the same decode sizes in the same order: each capture's eager run
        # meets the others' in its all-reduces.
        graph_sizes = cuda_graph_sizes(args, device)
        runner.capture_graphs(graph_sizes, budget.max_model_len)
        _await(ranks, "ready", START_TIMEOUT_S if graph_sizes else timeout_s)
    except BaseException:
        _stop(ranks)
        destroy_group()
        _restore(saved)
        if ray:
            tp_ray.disconnect()
        raise
    logger.info("tensor parallelism: %d ranks (rank 0 in process %d%s; %s), %s all-reduce at %s, step timeout %.0f s",
                tp, os.getpid(), f" on CPUs {cpus[0]}" if cpus[0] else "",
                ", ".join(f"rank {k.rank} in " + (k.proc.where if ray else f"process {k.proc.pid}")
                          + (f" on CPUs {cpus[k.rank]}" if cpus[k.rank] else "")
                          for k in ranks), "NCCL" if device.type == "cuda" else "gloo", host, timeout_s)
    return TensorParallelRunner(runner, ranks, saved, host)


def _await(ranks: list[_Rank], what: str, timeout_s: float) -> None:
    """Each rank's `what` reply, or an error naming the rank that failed or said nothing in time."""
    deadline = time.monotonic() + timeout_s
    for k in ranks:
        while True:
            msg = k.message(0.1)
            if msg is not None:
                if msg[0] == what:
                    break
                raise TensorParallelError(f"tensor-parallel rank {k.rank} failed to start: {msg[1]}")
            gone = k.exit_reason()
            if gone:
                raise TensorParallelError(f"{gone} while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {k.rank} (process {k.proc.pid}) did not report "
                                          f"{what!r} within {timeout_s:.0f} s; raise KVSERVE_TP_TIMEOUT_S on a slow "
                                          f"machine")


def _stop(ranks: list[_Rank]) -> None:
    for k in ranks:
        try:
            k.conn.send_bytes(pickle.dumps(("stop", ())))
        except (OSError, ValueError):
            pass
    for k in ranks:
        k.proc.join(STOP_TIMEOUT_S)
        if k.proc.is_alive():
            k.proc.terminate()  # a Ray actor: ray.kill
            k.proc.join(STOP_TIMEOUT_S)
        if k.proc.is_alive():
            k.proc.kill()
            k.proc.join(STOP_TIMEOUT_S)
        k.conn.close()


def _restore(saved) -> None:
    """This process's CPUs and thread count as before rank 0 bound them (offline LLM: the caller's)."""
    affinity, threads = saved
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


class TensorParallelRunner:
    """Rank 0's ModelRunner, as the engine sees one runner: each call that runs the model goes to
    every rank first. Attributes it does not define are rank 0's runner's (its kv_cache holds
    rank 0's heads)."""

    def __init__(self, runner, ranks: list[_Rank], saved, host: str = "127.0.0.1") -> None:
        self._runner, self._ranks, self._saved = runner, ranks, saved
        self.host = host  # rank 0's node address (a Ray actor whose node is this one runs here)
        self._failed: str | None = None
        self.tensor_parallel_size = len(ranks) + 1
        self._ranked_kv: RankedKVCache | None = None

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    @property
    def lora(self) -> "RankedLoRA | None":
        """Rank 0's adapter manager, whose loads and unpins every rank repeats (so that each step's
        slot choices agree), each rank splitting the adapter as its projections are."""
        return None if self._runner.lora is None else RankedLoRA(self)

    @property
    def kv_cache(self) -> "RankedKVCache":
        """Every rank's blocks as one cache (what the offload tiers read and write)."""
        if self._ranked_kv is None:
            self._ranked_kv = RankedKVCache(self)
        return self._ranked_kv

    def execute(self, out):
        if self._failed:
            raise TensorParallelError(self._failed)
        # The step's tier moves ran before it, on rank 0, each rank writing its own heads: the
        # other ranks need the forward's part only, not every rank's restored bytes.
        wire = dataclasses.replace(out, kv_offloads=[], kv_restores=[]) if out.kv_offloads or out.kv_restores else out
        self._send("execute", (wire,))
        try:
            return self._runner.execute(out)
        except Exception as e:
            raise self._fail(e) from e

    def local_pids(self) -> list[int]:
        """The processes of ranks 1..N-1 on this machine (a Ray actor on another node has none here)."""
        return [k.proc.pid for k in self._ranks
                if getattr(k.proc, "backend", "mp") == "mp" or (k.proc.pid is not None and k.proc.node == self.host)]

    def warm_up(self, prompt_len: int) -> None:
        self._call("warm_up", prompt_len)

    def all_reduce_stats(self) -> list[tuple[int, float]]:
        """Each rank's (all-reduce calls, seconds in them) so far, rank 0 first."""
        reduce = self._runner.model.all_reduce
        stats = [(reduce.calls, reduce.seconds)]
        self._send("stats", ())
        for k in self._ranks:
            msg = k.message(envs.KVSERVE_TP_TIMEOUT_S)
            if msg is None or msg[0] != "stats":
                raise self._fail(RuntimeError(f"no stats from rank {k.rank}"))
            stats.append(msg[1])
        return stats

    def _send(self, name: str, payload: tuple) -> None:
        if self._failed:
            raise TensorParallelError(self._failed)
        data = pickle.dumps((name, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for k in self._ranks:
            try:
                k.conn.send_bytes(data)
            except (OSError, ValueError) as e:
                raise self._fail(e) from e

    def gather_blocks(self, ids: torch.Tensor) -> list[list[torch.Tensor]]:
        """Each rank's read_blocks(ids), rank 0 first; every reply waited for at most KVSERVE_TP_TIMEOUT_S."""
        self._send("read_blocks", (ids,))
        parts = [self._runner.kv_cache.read_blocks(ids)]
        for k in self._ranks:
            msg = k.message(envs.KVSERVE_TP_TIMEOUT_S)
            if msg is None or msg[0] != "blocks":
                raise self._fail(RuntimeError(f"rank {k.rank} sent no KV blocks"))
            parts.append(from_wire(msg[1]))
        return parts

    def scatter_blocks(self, ids: torch.Tensor, per_rank: list[list[torch.Tensor]]) -> None:
        """Rank r writes per_rank[r] into its pool's blocks `ids`."""
        if self._failed:
            raise TensorParallelError(self._failed)
        for k in self._ranks:
            try:
                k.conn.send_bytes(pickle.dumps(("write_blocks", (ids, to_wire(per_rank[k.rank]))),
                                               protocol=pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError) as e:
                raise self._fail(e) from e
        self._runner.kv_cache.write_blocks(ids, per_rank[0])

    def _call(self, name: str, *payload):
        self._send(name, payload)
        try:
            return getattr(self._runner, name)(*payload)
        except Exception as e:
            # A rank gone or failed breaks rank 0's collective; any other error leaves the ranks out of step.
            raise self._fail(e) from e

    def _fail(self, cause: BaseException) -> TensorParallelError:
        reasons = []
        for k in self._ranks:
            msg = k.message()
            gone = k.exit_reason(0.5 if msg is None else 1.0)
            if msg is not None and msg[0] == "error":
                reasons.append(f"tensor-parallel rank {k.rank} failed: {msg[1]}")
            elif gone:
                reasons.append(gone)
        if not reasons:
            first = str(cause).splitlines()[0] if str(cause) else ""
            reasons.append(f"tensor-parallel rank 0's step failed ({type(cause).__name__}: {first}) with every other "
                           f"rank alive: a rank that hangs is given up on after KVSERVE_TP_TIMEOUT_S "
                           f"({envs.KVSERVE_TP_TIMEOUT_S:g} s)")
        self._failed = "; ".join(reasons) + " (the tensor-parallel group cannot run another step; restart the engine)"
        logger.error("%s", self._failed)
        return TensorParallelError(self._failed)

    def close(self) -> None:
        """Stop the other ranks, leave the group, give this process its CPUs back. Idempotent."""
        if self._saved is None:
            return
        _stop(self._ranks)
        destroy_group()
        _restore(self._saved)
        self._saved = None
        if any(getattr(k.proc, "backend", "mp") == "ray" for k in self._ranks):
            from kvserve.engine import tp_ray
            tp_ray.disconnect()


class RankedKVCache:
    """The KV blocks of every rank as one cache, for the offload tiers: a block read is each rank's
    fields in rank order (so a tier entry holds every rank's heads, under a fingerprint that names
    the rank count), and a write hands each rank its own. Anything else is rank 0's cache's.

    A quantized cache appends its open blocks' state (the full-precision residual) after the
    stored fields when a read includes an open block, and the offloader looks for it at the end:
    so every rank's sealed fields come first, then every rank's open state, each in rank order."""

    def __init__(self, runner: TensorParallelRunner) -> None:
        self._tp = runner
        self._own = runner._runner.kv_cache
        self._open = len(getattr(self._own, "open_block_layout", ()))
        # Tensors of one rank's read of sealed blocks: at start-up no block is open.
        self._sealed = len(self._own.read_blocks(torch.tensor([0]))) if self._open else 0

    def __getattr__(self, name: str):
        return getattr(self._own, name)

    @property
    def open_block_layout(self) -> list:
        return list(getattr(self._own, "open_block_layout", ())) * self._tp.tensor_parallel_size

    def read_blocks(self, ids: torch.Tensor) -> list[torch.Tensor]:
        parts = self._tp.gather_blocks(ids)
        s = self._sealed
        if not self._open or len(parts[0]) == s:
            return [t for part in parts for t in part]
        return [t for part in parts for t in part[:s]] + [t for part in parts for t in part[s:]]

    def write_blocks(self, ids: torch.Tensor, fields: list[torch.Tensor]) -> None:
        tp, s, o = self._tp.tensor_parallel_size, self._sealed, self._open
        if o and len(fields) == tp * (s + o):
            sealed, open_state = fields[:tp * s], fields[tp * s:]
            per_rank = [list(sealed[r * s:(r + 1) * s]) + list(open_state[r * o:(r + 1) * o]) for r in range(tp)]
        else:
            n = len(fields) // tp
            per_rank = [list(fields[r * n:(r + 1) * n]) for r in range(tp)]
        self._tp.scatter_blocks(ids, per_rank)


class RankedLoRA:
    """LoRAManager.resolve / unpin on every rank: rank 0's first (a bad adapter is refused there,
    before any other rank is told), then the same call sent to the others."""

    def __init__(self, runner: TensorParallelRunner) -> None:
        self._tp = runner
        self._own = runner._runner.lora

    def __getattr__(self, name: str):
        return getattr(self._own, name)

    def resolve(self, req, pins: int = 0) -> str:
        key = self._own.resolve(req, pins)
        self._tp._send("lora_resolve", (req, pins))
        return key

    def unpin(self, key: str) -> None:
        self._own.unpin(key)
        self._tp._send("lora_unpin", (key,))
