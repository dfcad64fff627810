"""The tensor-parallel process group: torch.distributed over gloo (CPU) or NCCL (CUDA), and the
timed all-reduce a sharded model calls after its row-parallel projections."""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch

from kvserve.errors import TensorParallelError  # noqa: F401 (raised by engine/tp_executor.py)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` nothing listens on now, for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float,
               host: str = "127.0.0.1") -> None:
    """Join the group (rank 0's process included) at rank 0's `host`:`port`. Every collective then
    waits at most timeout_s: a rank that died or hangs fails the others' step instead of blocking them."""
    import torch.distributed as dist
    dist.init_process_group(backend_for(device), init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def destroy_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


class AllReduce:
    """Sum a tensor across the group in place, counting the calls and the seconds spent in them
    (what bench/tensor_parallel.py reports as the all-reduce cost of a step)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self._all_reduce = dist.all_reduce
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self._all_reduce(t)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return t


def to_wire(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, torch.Tensor]]:
    """KV block tensors as bytes for the pipe to another rank: torch cannot unpickle a float8
    tensor (its storage has no dtype), so each goes as uint8 beside its dtype."""
    return [(t.dtype, t.detach().cpu().contiguous().view(torch.uint8)) for t in tensors]


def from_wire(items: list[tuple[torch.dtype, torch.Tensor]]) -> list[torch.Tensor]:
    return [raw.view(dtype) for dtype, raw in items]
