"""Data parallelism x tensor parallelism (`kvserve serve -dp 2 -tp 2`): D engine core replicas,
each driving T ranks. The CPU and GPU split between replicas and their ranks, its refusals, the
memory check counting every rank; end to end, greedy completions routed to both replicas equal a
TP=1 engine's, and a rank killed fails its replica only, naming the replica and the rank."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from server_util import SMALL, SRC, child_pids, start_server, wait_gone, wait_until

from kvserve.config import ConfigError, EngineArgs
from kvserve.engine.cpu_bind import format_cpu_list, parse_cpu_list, replica_cpu_sets
from kvserve.engine.dp_client import replica_gpus


def test_each_replica_gets_its_ranks_lists_in_order():
    # auto: D*T shares, replica r's ranks the r-th T of them.
    assert replica_cpu_sets(2, 2, "auto", [0, 1, 2, 3]) == [([0, 1], "0|1"), ([2, 3], "2|3")]
    assert replica_cpu_sets(2, 2, "auto", list(range(8))) == [([0, 1, 2, 3], "0-1|2-3"), ([4, 5, 6, 7], "4-5|6-7")]
    # Two NUMA nodes with interleaved numbering: each replica's ranks stay in one node.
    nodes = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert replica_cpu_sets(2, 2, "auto", list(range(8)), nodes=nodes) == [([0, 2, 4, 6], "0,2|4,6"),
                                                                          ([1, 3, 5, 7], "1,3|5,7")]
    # vLLM's explicit form: one list per rank of each replica, which may share CPUs on purpose.
    assert replica_cpu_sets(2, 2, "0|1|0|1", [0, 1]) == [([0, 1], "0|1"), ([0, 1], "0|1")]
    assert replica_cpu_sets(2, 3, "0|1|2|3-4|5|6-7", list(range(8))) == [([0, 1, 2], "0|1|2"),
                                                                         ([3, 4, 5, 6, 7], "3-4|5|6-7")]
    assert replica_cpu_sets(2, 2, "all", [0, 1, 2, 3]) == [(None, None), (None, None)]
    # Without tensor parallelism: one list per replica, as before; the executor's own env untouched.
    assert replica_cpu_sets(2, 1, "auto", [0, 1]) == [([0], None), ([1], None)]
    for cpus in ([0, 1, 2, 5, 7, 8], [3], list(range(16))):
        assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_too_few_cpus_or_wrong_list_count_names_both_flags_and_the_fix():
    with pytest.raises(ConfigError, match=r"--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 CPUs.*may use "
                                          r"2; lower --data-parallel-size or --tensor-parallel-size.*'0\|1\|0\|1'"):
        replica_cpu_sets(2, 2, "auto", [0, 1])
    with pytest.raises(ConfigError, match=r"--data-parallel-size 3 x --tensor-parallel-size 2 needs 6 CPUs"):
        replica_cpu_sets(3, 2, "all", [0, 1, 2, 3])
    with pytest.raises(ConfigError, match=r"gives 2 CPU lists \('0\|1'\) for --data-parallel-size 2 x "
                                          r"--tensor-parallel-size 2; give 4"):
        replica_cpu_sets(2, 2, "0|1", [0, 1])
    with pytest.raises(ConfigError, match=r"CPUs \[5\]"):
        replica_cpu_sets(2, 2, "0|1|0|5", [0, 1])


def test_each_replica_sees_gpus_of_its_own():
    assert replica_gpus(2, 2, 0, None) == [None, None]  # CPU
    assert replica_gpus(2, 2, 4, None) == ["0,1", "2,3"]
    assert replica_gpus(2, 2, 4, "3,2,1,0") == ["3,2", "1,0"]  # the parent's numbering, in its order
    assert replica_gpus(2, 1, 8, None) == ["0", "1"]
    assert replica_gpus(2, 1, 1, None) == [None, None]  # no TP: fewer GPUs than replicas share them, as before
    with pytest.raises(ConfigError, match=r"--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs.*"
                                          r"but 2 are visible"):
        replica_gpus(2, 2, 2, None)


def test_dp_with_tp_is_accepted_by_the_config(tiny):
    EngineArgs(model=tiny, data_parallel_size=2, tensor_parallel_size=2).validate()


def test_the_memory_check_counts_every_rank_of_the_first_replica(monkeypatch):
    """Replica 0 with two ranks: its engine core and its other rank's process both count."""
    from kvserve.engine import dp_client
    client = dp_client.DPClient.__new__(dp_client.DPClient)
    me = os.getpid()
    client.clients = [SimpleNamespace(proc=SimpleNamespace(pid=me), info={"kv_cache_bytes": 0, "rank_pids": []})]
    rss = dp_client._rss_bytes(me)
    monkeypatch.setattr(dp_client, "host_memory", lambda field: int(1.5 * rss))
    client._check_memory(SimpleNamespace(tensor_parallel_size=1), 2)  # one process's RSS fits...
    client.clients[0].info["rank_pids"] = [me]
    with pytest.raises(ConfigError, match=r"and its 1 other tensor-parallel ranks"):
        client._check_memory(SimpleNamespace(tensor_parallel_size=2), 2)  # ...two do not
    # The KV pool is per rank: T of them per replica.
    client.clients[0].info.update(kv_cache_bytes=rss, rank_pids=[])
    monkeypatch.setattr(dp_client, "host_memory", lambda field: int(1.5 * rss))
    with pytest.raises(ConfigError, match=r"lower --data-parallel-size or --kv-cache-memory"):
        client._check_memory(SimpleNamespace(tensor_parallel_size=2), 2)


def test_serve_refuses_more_ranks_than_cpus_naming_both_flags(tiny):
    n = len(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=SRC, VLLM_CPU_OMP_THREADS_BIND="auto")
    proc = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--model", tiny, "-dp", "2", "-tp", str(n)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"--data-parallel-size 2 x --tensor-parallel-size {n} needs {2 * n} CPUs" in proc.stderr, \
        proc.stderr[-2000:]


PROMPTS = ["hello there", "the quick brown fox", "one two three four", "a tiny model says"]


def _complete(url: str, prompt: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _cpus_allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


@pytest.mark.slow
def test_serve_dp2_tp2_equals_tp1_and_a_killed_rank_fails_its_replica_only(tiny):
    """`kvserve serve -dp 2 -tp 2` on 2 cores ("0|1|0|1": each replica's rank 0 on CPU 0, rank 1 on
    CPU 1): greedy completions routed to both replicas equal a TP=1 engine's in fp32; killing
    replica 0's rank 1 mid-stream fails that replica's request with an error naming both, the other
    replica's stream completes, /health stays 200 and later requests go to the survivor."""
    from kvserve import LLM, SamplingParams
    ref = LLM(tiny, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB")
    try:
        want = [o.outputs[0].text for o in ref.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    finally:
        ref.engine.close()
    cpus = sorted(os.sched_getaffinity(0))
    bind = "|".join(str(cpus[i % len(cpus)]) for i in range(4))
    server = start_server(*SMALL, "--model", tiny, "-dp", "2", "-tp", "2", "--data-parallel-routing", "round_robin",
                          "--disable-log-stats", env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    cores = server.children()
    ranks = [p for core in cores for p in child_pids(core)]  # every process started, stopped by PID below
    try:
        log = server.log()
        replica_of = {int(pid): int(r) for pid, r in
                      re.findall(r"engine core process (\d+) started \(data-parallel rank (\d+)", log)}
        rank1_of = {}  # replica -> its tensor-parallel rank 1's process
        for pid in map(int, re.findall(r"tensor-parallel rank 1 of 2 running in process (\d+)", log)):
            parent = next(c for c in cores if pid in child_pids(c))
            rank1_of[replica_of[parent]] = pid
        assert sorted(replica_of.values()) == [0, 1] and sorted(rank1_of) == [0, 1], log[-4000:]
        # Each replica's rank 0 (its engine core's main thread) and rank 1 on CPUs of their own.
        assert [_cpus_allowed(rank1_of[r]) for r in (0, 1)] == [str(cpus[1 % len(cpus)])] * 2
        assert all(_cpus_allowed(c) == str(cpus[0]) for c in cores)

        got = [_complete(server.url, p) for p in PROMPTS]
        assert got == want
        served = [server.metric("vllm:request_success_total", engine=str(e)) for e in (0, 1)]
        assert served[0] > 0 and served[1] > 0, served  # both replicas answered some

        def stream(i: int):
            body = {"prompt": f"story {i}:", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            lines = []
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
            return resp.status_code, "\n".join(lines)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(stream, i) for i in range(2)]  # round robin: one on each replica
            wait_until(lambda: all(server.metric("vllm:num_requests_running", engine=str(e)) >= 1 for e in (0, 1)),
                       60, what="a request running on each replica")
            os.kill(rank1_of[0], signal.SIGKILL)
            killed_at = time.monotonic()
            results = [f.result(timeout=120) for f in futures]
        assert time.monotonic() - killed_at < 60
        failed = [text for _, text in results if '"error"' in text]
        ok = [text for status, text in results if status == 200 and "[DONE]" in text and '"error"' not in text]
        assert len(failed) == 1 and len(ok) == 1, results
        assert "data-parallel replica 0" in failed[0] and "tensor-parallel rank 1" in failed[0] \
            and "killed by signal 9" in failed[0], failed[0][-2000:]
        wait_until(lambda: "after its tensor-parallel group failed" in server.log(), 30, what="replica 0 reported dead")
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert [_complete(server.url, p) for p in PROMPTS[:2]] == want[:2]  # the survivor serves
    finally:
        server.stop()
        for pid in ranks:
            if not wait_gone(pid, 10):
                os.kill(pid, signal.SIGKILL)
                wait_gone(pid, 10)
