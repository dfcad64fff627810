"""Which CPUs each data-parallel engine core process runs on (vLLM's VLLM_CPU_OMP_THREADS_BIND).

Each replica gets CPUs of its own and an OpenMP team of that size: two teams spinning on the
same cores would each wait on the other's barriers (bench/NOTES.md measures what that costs)."""
from __future__ import annotations

import os

from kvserve.config import ConfigError


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND: {part!r} is not a CPU number or range like 0-3")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_sets(num_replicas: int, bind: str, available: list[int] | None = None,
             flag: str = "--data-parallel-size") -> list[list[int] | None]:
    """One CPU list per replica (None: no binding), or per tensor-parallel rank (`flag` the one
    that set their number). Raises ConfigError when there are fewer CPUs than replicas, naming
    both numbers; explicit lists may share CPUs (the user asked for it)."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if bind == "all":
        if num_replicas > len(cpus):
            raise _too_many(num_replicas, len(cpus), flag)
        return [None] * num_replicas
    if bind == "auto":
        if num_replicas > len(cpus):
            raise _too_many(num_replicas, len(cpus), flag)
        share = len(cpus) // num_replicas
        return [cpus[r * share:(r + 1) * share] for r in range(num_replicas)]
    lists = [parse_cpu_list(p) for p in bind.split("|")]
    if len(lists) != num_replicas:
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND gives {len(lists)} CPU lists ({bind!r}) for "
                          f"{flag} {num_replicas}; give one list per replica, separated by |")
    missing = sorted({c for cl in lists for c in cl} - set(cpus))
    if missing:
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND names CPUs {missing} that this process may not use "
                          f"(it may use {cpus})")
    return lists


def _too_many(n: int, cpus: int, flag: str) -> ConfigError:
    return ConfigError(f"{flag} {n} needs at least one CPU per replica, but this process may use "
                       f"{cpus}; lower {flag} to at most {cpus} (or give VLLM_CPU_OMP_THREADS_BIND one CPU list "
                       f"per replica, e.g. \"0|1|0\", to share CPUs)")
