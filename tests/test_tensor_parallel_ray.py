"""Tensor parallelism on a real Ray cluster (--distributed-executor-backend ray): one head node
started on 127.0.0.1 for the module, greedy tokens at TP=2 equal to TP=1, an actor killed
mid-run fails the step naming the rank, and the start-up errors for no cluster and no ray."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers import closed_port, free_port
from test_tensor_parallel import _run

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError, EngineArgs

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _ray_cli() -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts"]


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node cluster (2 CPUs) whose workers import this checkout; RAY_ADDRESS names it while
    the module runs. Stopped, and anything of it left killed, however the module ends."""
    import ray  # noqa: F401 (the test extra installs it: a missing ray fails here, never skips)
    port = free_port()
    temp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    saved = os.environ.get("RAY_ADDRESS")
    try:
        subprocess.run(_ray_cli() + ["start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
                                     "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats",
                                     "--temp-dir", temp],
                       env=env, check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        yield f"127.0.0.1:{port}"
    finally:
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
        subprocess.run(_ray_cli() + ["stop", "--force"], env=env, timeout=60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(temp in part for part in p.info["cmdline"] or ()):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_tp2_greedy_equals_tp1_through_prefix_hits_chunks_and_preemption(tiny, ray_cluster):
    """Rank 1 a Ray actor dialled back over TCP, the gloo group at rank 0's node address: the
    same tokens, prefix hits and preemptions as one process."""
    want, counters = _run(tiny, 1)
    got, ray_counters = _run(tiny, 2, distributed_executor_backend="ray")
    assert got == want
    assert ray_counters == counters


@pytest.mark.slow
def test_a_killed_actor_fails_the_step_naming_the_rank(tiny, ray_cluster, monkeypatch):
    """The actor, on rank 0's node, is bound to rank 1's share of the CPUs as a spawned rank is;
    killed, the next step fails within the bound, naming rank 1 and its actor."""
    from kvserve.errors import TensorParallelError
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    cpus = sorted(os.sched_getaffinity(0))
    llm = LLM(tiny, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              kv_cache_memory=4 << 20)
    try:
        rank = llm.engine.runner._ranks[0]
        assert rank.proc.backend == "ray" and rank.proc.pid != os.getpid()
        assert sorted(psutil.Process(rank.proc.pid).cpu_affinity()) == cpus[len(cpus) // 2:2 * (len(cpus) // 2)]
        assert psutil.Process(rank.proc.pid).nice() == os.getpriority(os.PRIO_PROCESS, 0)  # not Ray's 15
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        os.kill(rank.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(Ray actor, process \d+ on node"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError, match="cannot run another step"):
            llm.engine.runner.execute(None)
    finally:
        llm.engine.close()


def test_ray_without_a_cluster_is_a_start_up_error_naming_the_flag_and_the_fix(tiny, monkeypatch):
    import ray
    assert not ray.is_initialized()
    with closed_port() as port:
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        start = time.monotonic()
        with pytest.raises(ConfigError, match=r"--distributed-executor-backend ray found no Ray cluster at "
                                              r"127\.0\.0\.1:\d+ .*ray start --head"):
            LLM(tiny, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
                kv_cache_memory=4 << 20)
        assert time.monotonic() - start < 30
    assert not ray.is_initialized()


def test_ray_not_installed_names_the_extra(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError; find_spec says None
    with pytest.raises(ConfigError, match=r"pip install 'kvserve\[ray\]'"):
        EngineArgs(model=tiny, tensor_parallel_size=2, distributed_executor_backend="ray").validate()
    from kvserve.engine import tp_ray
    with pytest.raises(ConfigError, match=r"pip install 'kvserve\[ray\]'"):
        tp_ray.connect()
