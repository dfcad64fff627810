"""Data-parallel replicas on one machine, on a multi-tenant shared-prefix workload: how much of the
prefix cache each way of routing keeps.

    python bench/scale_out.py                                  # every mode below
    python bench/scale_out.py --modes round_robin,cache_aware --requests 96 --rate 3

Workload: 8 system prompts of 1-2K tokens (one per tenant application), many users each asking
their own question (a system prompt chosen with Zipf-like popularity), Poisson arrivals at --rate,
32 output tokens each, greedy. Two replicas on this machine, one CPU each, each with a KV budget
(--kv-cache-memory) that holds about half of the system prompts: a router that keeps each prompt
on one replica fits them all, one that scatters them thrashes both caches.

Modes (each a fresh server, one after the other):
  round_robin   kvserve serve -dp 2 --data-parallel-routing round_robin (a cache-blind balancer)
  least_loaded  kvserve serve -dp 2 --data-parallel-routing least_loaded (vLLM's DP balancing)
  cache_aware   kvserve serve -dp 2 (the default: cached prefix, weighed against load)
  vllm-router   two `kvserve serve` (one CPU each) behind vllm-router --policy cache_aware
                (needs the vllm-router binary on PATH)
Prints a table; writes bench/results/scale_out.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
from helpers import free_port  # noqa: E402
from server_util import parse_metrics  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TEXT = (ROOT / "bench" / "data" / "lighthouse_keepers.txt").read_text()


def system_prompts(n: int, rng: random.Random) -> list[str]:
    out = []
    for k in range(n):
        length = rng.randrange(4500, 8000)  # ~1-2K tokens
        start = rng.randrange(0, len(TEXT) - length)
        out.append(f"You are assistant #{k} of a maritime museum. Use this reference:\n{TEXT[start:start + length]}\n")
    return out


def workload(n_requests: int, rate: float, seed: int) -> list[tuple[float, int, str]]:
    """(arrival offset s, system prompt index, prompt)."""
    rng = random.Random(seed)
    prompts = system_prompts(8, rng)
    weights = [1 / (k + 1) ** 0.8 for k in range(8)]
    t, out = 0.0, []
    for i in range(n_requests):
        t += rng.expovariate(rate)
        k = rng.choices(range(8), weights)[0]
        out.append((t, k, prompts[k] + f"Visitor {i} asks: what did keeper number {rng.randrange(1000)} do at night?"))
    return out


class Proc:
    def __init__(self, name: str, cmd: list[str], env: dict | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"scale-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or dict(os.environ))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_healthy(url: str, procs: list[Proc], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited:\n{Path(p.log.name).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def kvserve_cmd(port: int, kv_memory: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--host", "127.0.0.1",
            "--kv-cache-memory", kv_memory, "--max-model-len", "4096", "--disable-log-stats",
            "--uvicorn-log-level", "warning", *extra]


def start(mode: str, kv_memory: str, request_log: str) -> tuple[str, list[Proc], list[str], str]:
    """(url, processes, metrics urls, the command(s))."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    if mode != "vllm-router":
        port = free_port()
        cmd = kvserve_cmd(port, kv_memory, "--data-parallel-size", "2", "--data-parallel-routing", mode,
                          "--request-log", request_log)
        p = Proc(mode, cmd, env)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [p])
        return url, [p], [url], " ".join(cmd[1:])
    router = shutil.which("vllm-router")
    if router is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
    procs, urls, cmds = [], [], []
    cpus = sorted(os.sched_getaffinity(0))
    for rank in range(2):
        port = free_port()
        cmd = ["taskset", "-c", str(cpus[rank]), *kvserve_cmd(port, kv_memory)]
        procs.append(Proc(f"kvserve{rank}", cmd, dict(env, OMP_NUM_THREADS="1")))
        urls.append(f"http://127.0.0.1:{port}")
        cmds.append(" ".join(cmd))
    for u in urls:
        wait_healthy(u, procs)
    port = free_port()
    cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware", "--worker-urls", *urls,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warning"]
    procs.append(Proc("vllm-router", cmd))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs, 120)
    return url, procs, urls, " && ".join(cmds + [" ".join(cmd)])


def scrape(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for u in urls:
        for key, v in parse_metrics(httpx.get(f"{u}/metrics", timeout=10).text).items():
            name = key.partition("{")[0]
            total[name] = total.get(name, 0.0) + v
    return total


async def run_load(url: str, work: list[tuple[float, int, str]], max_tokens: int) -> dict:
    ttfts, tokens, errors = [], 0, 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        async def one(at: float, prompt: str, t0: float) -> None:
            nonlocal tokens, errors
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent, first, n = time.perf_counter(), None, 0
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors += 1
                        return
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            if chunk.get("choices") and chunk["choices"][0].get("text"):
                                n += 1
                                if first is None:
                                    first = time.perf_counter()
            except httpx.HTTPError:
                errors += 1
                return
            if first is not None:
                ttfts.append(first - sent)
            tokens += n
        t0 = time.perf_counter()
        await asyncio.gather(*(one(at, p, t0) for at, _, p in work))
        duration = time.perf_counter() - t0
    ttfts.sort()
    q = (lambda f: ttfts[min(len(ttfts) - 1, int(f * len(ttfts)))] if ttfts else float("nan"))
    return {"duration_s": duration, "output_tok_s": tokens / duration, "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": q(0.99), "completed": len(ttfts), "errors": errors}


def simulated(request_log: str, kv_memory: str) -> dict[str, float]:
    """`kvserve simulate`'s prediction of each routing's prefix hit rate, from the request log of
    a run (its prompts and arrival times), without weights."""
    if not os.path.exists(request_log):
        return {}
    cmd = [sys.executable, "-m", "kvserve", "simulate", "--trace", request_log, "--kv-cache-memory", kv_memory,
           "--max-model-len", "4096", "--hardware", "cpu", "--data-parallel-size", "2",
           "--data-parallel-routing", "round_robin,least_loaded,cache_aware", "--json", "-"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    doc = json.loads(out.stdout)
    print("simulate:", " ".join(cmd[1:]), file=sys.stderr)
    return {x["config"]["data_parallel_routing"]: x["prefix_hit_rate"] for x in doc["results"]
            if x["config"]["data_parallel_size"] == 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="round_robin,least_loaded,cache_aware,vllm-router")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="160MiB", help="per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale_out.json"))
    a = ap.parse_args()
    work = workload(a.requests, a.rate, a.seed)
    rows = []
    logs = tempfile.mkdtemp(prefix="scale-out-logs-")
    for mode in a.modes.split(","):
        url, procs, metric_urls, cmd = start(mode, a.kv_cache_memory, os.path.join(logs, f"{mode}.jsonl"))
        try:
            before = scrape(metric_urls)
            res = asyncio.run(run_load(url, work, a.max_tokens))
            after = scrape(metric_urls)
        finally:
            for p in reversed(procs):
                p.stop()
        q = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        h = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        res |= {"mode": mode, "prefix_hit_rate": h / q if q else 0.0, "command": cmd}
        rows.append(res)
        print(f"{mode}: {res}", file=sys.stderr)
    sim = simulated(os.path.join(logs, "cache_aware.jsonl"), a.kv_cache_memory)
    for r in rows:
        r["simulated_hit_rate"] = sim.get(r["mode"] if r["mode"] != "vllm-router" else "cache_aware")
    print(f"\n{a.requests} requests, 8 system prompts of 1-2K tokens, Poisson {a.rate}/s, {a.max_tokens} output tokens, "
          f"2 replicas x 1 CPU, {a.kv_cache_memory} KV each ({platform.processor() or platform.machine()})")
    print(f"| {'routing':<13} | hit rate | simulated | TTFT p50 | TTFT p99 | output tok/s | duration | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        simr = r["simulated_hit_rate"]
        simr = f"{100 * simr:7.1f} %" if simr is not None else "      -  "
        print(f"| {r['mode']:<13} | {100 * r['prefix_hit_rate']:6.1f} % | {simr} | {r['ttft_p50_s']:6.2f} s | "
              f"{r['ttft_p99_s']:6.2f} s | {r['output_tok_s']:12.1f} | {r['duration_s']:6.1f} s | {r['errors']:6d} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
