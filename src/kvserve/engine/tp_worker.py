"""A tensor-parallel rank above 0: a process holding its share of the model and the KV pool of its
heads, running each step it is sent (engine/tp_executor.py) in lockstep with rank 0.

Messages arrive pickled on a pipe (or, as a Ray actor, a socket connection with a pipe's API) from rank 0, one per step, never one per layer; the only
traffic inside a step is the group's all-reduces. Replies: "built" once the runner exists,
"ready" once the group is joined, "error" (then the process exits, which fails the others'
collective at once instead of at the timeout). The process ends on "stop", or when rank 0's end
of the pipe closes (rank 0 gone).
"""
from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)


def main(args, rank: int, world: int, port: int, cpus: list[int] | None, budget, dtype, device, kv_scales,
         conn, timeout_s: float, log_level: int, host: str = "127.0.0.1", own_process: bool = True) -> None:
    """`own_process` False: a Ray actor (engine/tp_ray.py), whose signals and logging are Ray's."""
    if own_process:
        # The engine owns shutdown (Ctrl-C reaches the whole process group); the engine core process
        # ignores SIGTERM, and an ignored signal stays ignored across exec: restore it, so that
        # terminate() ends this process.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cpus:
        os.sched_setaffinity(0, cpus)
        os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    if own_process:
        logging.basicConfig(level=log_level)
    try:
        import torch

        from kvserve.model.loader import load_model
        from kvserve.runner.build import cuda_graph_sizes, make_runner
        from kvserve.runner.distributed import AllReduce, init_group
        if cpus:
            torch.set_num_threads(len(cpus))
        if device.type == "cuda":
            torch.cuda.set_device(rank)  # NCCL: one GPU per rank
        loaded = load_model(args.model, dtype=dtype)
        runner = make_runner(args, loaded.config, loaded.weights, loaded.codes, budget, dtype,
                             torch.device(device.type, rank) if device.type == "cuda" else device, kv_scales, rank)
        del loaded
        conn.send(("built", os.getpid()))
        init_group(rank, world, port, device, timeout_s, host)
        runner.model.all_reduce = AllReduce()
        runner.capture_graphs(cuda_graph_sizes(args, device), budget.max_model_len)  # with rank 0's, size by size
        conn.send(("ready", os.getpid()))
    except BaseException as e:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    logger.info("tensor-parallel rank %d of %d running in process %d%s", rank, world, os.getpid(),
                f" on CPUs {cpus}" if cpus else "")
    _loop(runner, conn, rank)


def _loop(runner, conn, rank: int) -> None:
    import pickle

    import torch

    from kvserve.runner.distributed import destroy_group, from_wire, to_wire
    while True:
        try:
            name, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            logger.warning("tensor-parallel rank %d: rank 0 is gone; stopping", rank)
            return
        if name == "stop":
            destroy_group()
            return
        try:
            if name == "execute":
                runner.execute(*payload, sample=False)
            elif name == "read_blocks":  # the offload tiers: rank 0 stores every rank's heads
                with torch.inference_mode():
                    data = to_wire(runner.kv_cache.read_blocks(*payload))
                conn.send_bytes(pickle.dumps(("blocks", data), protocol=pickle.HIGHEST_PROTOCOL))
            elif name == "lora_resolve":
                runner.lora.resolve(*payload)
            elif name == "lora_unpin":
                runner.lora.unpin(*payload)
            elif name == "write_blocks":
                with torch.inference_mode():
                    ids, wire = payload
                    runner.kv_cache.write_blocks(ids, from_wire(wire))
            elif name == "stats":
                reduce = runner.model.all_reduce
                conn.send(("stats", (reduce.calls, reduce.seconds)))
            else:
                getattr(runner, name)(*payload)
        except BaseException as e:
            logger.exception("tensor-parallel rank %d: %s failed", rank, name)
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            finally:
                os._exit(1)  # the group is out of step: leave it now, failing the others' collective
