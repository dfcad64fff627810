"""The job/result protocol between bench/compare.py and the runner scripts.

Pure standard library: runners import it from inside each peer's own venv, where kvserve is not
installed. A job is a JSON file (workloads as token ids, engine settings, repeat count); a runner
prints exactly one line `RESULT_MARKER <json>` on stdout, so engine logging on stdout (vLLM logs
there) cannot corrupt the result.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

RESULT_MARKER = "KVSERVE_BENCH_RESULT"
PROGRESS_MARKER = "KVSERVE_BENCH_PROGRESS"  # lines compare.py echoes live while it logs the rest


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    prefix_caching: bool


@dataclass
class Job:
    dtype: str              # "bfloat16" | "float32"
    max_model_len: int
    max_num_seqs: int
    kv_cache_gib: float
    repeat: int
    workloads: list[Workload]
    options: dict = field(default_factory=dict)  # per-peer extras (model path, threads)


@dataclass
class Run:
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int | None = None   # None where the peer does not report it
    decode_tok_per_s: float | None = None     # only where first-token time is observable


@dataclass
class WorkloadResult:
    name: str
    prefix_caching: bool
    runs: list[Run]


@dataclass
class RunnerResult:
    system: str
    version: str
    settings: dict
    load_seconds: float
    workloads: list[WorkloadResult]


def read_job(path: str) -> Job:
    raw = json.loads(open(path).read())
    raw["workloads"] = [Workload(**w) for w in raw["workloads"]]
    return Job(**raw)


def write_job(job: Job, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(job), f)


def emit(result: RunnerResult) -> None:
    sys.stdout.flush()
    print(f"{RESULT_MARKER} {json.dumps(asdict(result))}", flush=True)


def progress(message: str) -> None:
    print(f"{PROGRESS_MARKER} {message}", flush=True)


def parse_result(stdout: str) -> RunnerResult | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER + " "):
            raw = json.loads(line[len(RESULT_MARKER) + 1:])
            raw["workloads"] = [WorkloadResult(w["name"], w["prefix_caching"], [Run(**r) for r in w["runs"]])
                                for w in raw["workloads"]]
            return RunnerResult(**raw)
    return None


def by_prefix_caching(workloads: list[Workload]) -> dict[bool, list[Workload]]:
    """Peers fix prefix caching per engine instance: group so each setting builds one engine."""
    groups: dict[bool, list[Workload]] = {}
    for w in workloads:
        groups.setdefault(w.prefix_caching, []).append(w)
    return groups


def timed_runs(generate: Callable[[Workload], Run], reset: Callable[[], None], w: Workload,
               repeat: int) -> WorkloadResult:
    """`repeat` timed runs, each after a reset of the prefix cache so every run starts cold."""
    runs = []
    for i in range(repeat):
        reset()
        runs.append(generate(w))
        r = runs[-1]
        progress(f"{w.name} run {i + 1}/{repeat}: {r.seconds:.2f} s, {r.output_tokens / r.seconds:.1f} out tok/s")
    return WorkloadResult(w.name, w.prefix_caching, runs)


def clock() -> float:
    return time.perf_counter()
