"""Which CPUs each data-parallel replica or tensor-parallel rank runs on (vLLM's VLLM_CPU_OMP_THREADS_BIND).

Each gets CPUs of its own and an OpenMP team of that size: two teams spinning on the same cores
would each wait on the other's barriers (bench/NOTES.md measures what that costs). On a machine
with several NUMA nodes, `auto` keeps each process inside one node: the weights and KV it loads
after binding are first touched there, so its memory reads stay local."""
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


def numa_nodes(root: str = "/sys/devices/system/node") -> list[list[int]]:
    """Each NUMA node's CPUs, in node order ([] where the kernel does not say)."""
    try:
        names = sorted((n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()),
                       key=lambda n: int(n[4:]))
        return [parse_cpu_list(open(os.path.join(root, n, "cpulist")).read().strip()) for n in names]
    except (OSError, ConfigError):
        return []


def _auto(n: int, cpus: list[int], nodes: list[list[int]]) -> list[list[int]]:
    """`auto`: where the allowed CPUs span several NUMA nodes and the processes divide among them
    (or are fewer), each process stays in one node; otherwise an even split of the CPUs."""
    allowed = set(cpus)
    local = [sorted(allowed & set(node)) for node in nodes]
    local = [node for node in local if node]
    if len(local) > 1 and (n <= len(local) or n % len(local) == 0):
        per_node = max(1, n // len(local))
        out = []
        for r in range(n):
            node = local[r // per_node]
            share = len(node) // per_node
            if share == 0:
                break  # a node with fewer CPUs than the processes it would hold: split evenly instead
            out.append(node[(r % per_node) * share:(r % per_node + 1) * share])
        else:
            return out
    share = len(cpus) // n
    return [cpus[r * share:(r + 1) * share] for r in range(n)]


def cpu_sets(num_replicas: int, bind: str, available: list[int] | None = None,
             flag: str = "--data-parallel-size", nodes: list[list[int]] | None = None) -> list[list[int] | None]:
    """One CPU list per replica (None: no binding), or per tensor-parallel rank (`flag` the one
    that set their number). Raises ConfigError when there are fewer CPUs than replicas, naming
    both numbers; explicit lists may share CPUs (the user asked for it). `nodes`: the NUMA
    nodes' CPUs (read from sysfs when None)."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if bind == "all":
        if num_replicas > len(cpus):
            raise _too_many(num_replicas, len(cpus), flag)
        return [None] * num_replicas
    if bind == "auto":
        if num_replicas > len(cpus):
            raise _too_many(num_replicas, len(cpus), flag)
        return _auto(num_replicas, cpus, numa_nodes() if nodes is None else nodes)
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


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (parse_cpu_list's inverse)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def replica_cpu_sets(dp: int, tp: int, bind: str, available: list[int] | None = None,
                     nodes: list[list[int]] | None = None) -> list[tuple[list[int] | None, str | None]]:
    """Data parallelism x tensor parallelism: per replica, the CPUs its engine core process is bound
    to and the VLLM_CPU_OMP_THREADS_BIND its tensor-parallel executor reads (None: this one's).

    vLLM's lists are one per local rank: with D replicas of T ranks there are D*T of them, replica
    r's ranks taking lists r*T .. r*T+T-1. `auto` splits the CPUs into D*T shares the same way (so
    where they span NUMA nodes a replica's ranks sit in consecutive shares, inside one node when
    the counts divide). Each replica is handed its own T lists, which its executor checks against
    the union it is bound to."""
    if tp == 1:
        return [(c, None) for c in cpu_sets(dp, bind, available, nodes=nodes)]
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    n = dp * tp
    flags = f"--data-parallel-size {dp} x --tensor-parallel-size {tp}"
    if bind in ("auto", "all"):
        if n > len(cpus):
            raise ConfigError(f"{flags} needs {n} CPUs, one per rank of each replica, but this process may use "
                              f"{len(cpus)}; lower --data-parallel-size or --tensor-parallel-size so that their "
                              f"product is at most {len(cpus)} (or give VLLM_CPU_OMP_THREADS_BIND {n} CPU lists, "
                              f"one per rank, e.g. {_example(n, cpus)!r}, to share CPUs)")
        if bind == "all":
            return [(None, None)] * dp
    elif len(bind.split("|")) != n:
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND gives {len(bind.split('|'))} CPU lists ({bind!r}) for {flags}; "
                          f"give {n}, one per tensor-parallel rank of each replica (replica r's ranks take lists "
                          f"r*{tp} .. r*{tp}+{tp - 1}), separated by |")
    per_rank = cpu_sets(n, bind, cpus, flag=flags, nodes=nodes)
    out: list[tuple[list[int] | None, str | None]] = []
    for r in range(dp):
        ranks = per_rank[r * tp:(r + 1) * tp]
        out.append((sorted({c for cl in ranks for c in cl}), "|".join(format_cpu_list(cl) for cl in ranks)))
    return out


def _example(n: int, cpus: list[int]) -> str:
    return "|".join(str(cpus[i % len(cpus)]) for i in range(n))
