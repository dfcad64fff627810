"""Two tenants through the real server: does the premium tenant's shared system prompt survive a
free tier's bursts? Premium sends a 1,500-token system prompt plus a unique 16-token question at
a steady rate (one output token: its latency is its TTFT); free sends bursts of unique 1,000-token
prompts that overflow the KV pool (sized by --kv-cache-memory). The same schedule runs under
  lru       no retention (the default eviction order),
  priority  tenant defaults in --api-keys-file: premium cache_retention priority 90, free 10,
  pinned    the system prompt pinned (POST /v1/cache/pins) before the run, no retention,
and `kvserve simulate` replays the same trace (same token ids, arrivals and pool) under each to
predict premium's hit rate. Prints a table, writes JSON.

    python bench/retention.py [--duration 60] [--kv-cache-memory 72MiB] [--out bench/results/retention.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")
SYSTEM_LEN, QUESTION_LEN, FREE_LEN, BLOCK = 1500, 16, 1000, 16
PREFIX = SYSTEM_LEN // BLOCK * BLOCK  # the system prompt's tokens in full blocks: what can hit
MODES = ("lru", "priority", "pinned")


def keys(mode: str) -> list[dict]:
    premium = {"key": "k-premium", "tenant": "premium", "admin": True}
    free = {"key": "k-free", "tenant": "free"}
    if mode == "priority":
        premium["cache_retention"], free["cache_retention"] = {"priority": 90}, {"priority": 10}
    return [premium, free]


def schedule(seed: int, duration: float, rate: float, burst: int, period: float) -> tuple[list[tuple], list[int]]:
    """(time s, tenant, token ids, max_tokens), sorted, the same for every mode; and the system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 40000) for _ in range(SYSTEM_LEN)]
    out = [(0.0, "warm", system + [rng.randrange(1000, 40000) for _ in range(QUESTION_LEN)], 1)]
    t = 1.0
    while t < duration:
        out.append((t, "premium", system + [rng.randrange(1000, 40000) for _ in range(QUESTION_LEN)], 1))
        t += 1.0 / rate
    t = 1.5
    while t < duration:
        for j in range(burst):
            out.append((t + 0.01 * j, "free", [rng.randrange(1000, 40000) for _ in range(FREE_LEN)], 16))
        t += period
    return sorted(out, key=lambda x: x[0]), system


def start(args: list[str], workdir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(workdir, "server.log"), "a")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", *args, "--port", str(port)],
                            env=dict(os.environ, PYTHONPATH=SRC), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {workdir}/server.log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("server not healthy after 300 s")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def replay(url: str, plan: list[tuple]) -> list[dict]:
    results: list[dict] = []
    # No keep-alive: uvicorn closes a connection idle for 5 s, racing its reuse (httpx.ReadError).
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(t: float, tenant: str, ids: list[int], max_tokens: int) -> None:
            key = "k-free" if tenant == "free" else "k-premium"
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            u = r.json()["usage"]
            results.append({"t": t, "tenant": tenant, "latency_s": time.perf_counter() - t0,
                            "prompt_tokens": u["prompt_tokens"],
                            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]})

        warm = plan[0]
        await one(*warm)  # the system prompt cached (or pinned) before the clock starts
        start_at = time.perf_counter() - 1.0
        tasks = []
        for t, tenant, ids, max_tokens in plan[1:]:
            delay = start_at + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(t, tenant, ids, max_tokens)))
        await asyncio.gather(*tasks)
    return results


def summarize(results: list[dict]) -> dict:
    prem = [r for r in results if r["tenant"] == "premium"]
    ttft = sorted(r["latency_s"] for r in prem)
    return {"premium_requests": len(prem), "free_requests": sum(r["tenant"] == "free" for r in results),
            "prefix_hit_rate": sum(min(r["cached_tokens"], PREFIX) for r in prem) / (PREFIX * len(prem)),
            "full_prefix_hits": sum(r["cached_tokens"] >= PREFIX for r in prem),
            "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]}


def simulated(plan: list[tuple], system: list[int], mode: str, num_blocks: int, max_model_len: int) -> float:
    """kvserve simulate's premium prefix hit rate for the same trace and pool."""
    sys.path.insert(0, SRC)
    from kvserve.tools import simulate as sim
    from kvserve.tools.workload import Conversation, Trace, Turn
    retention = {"premium": {"priority": 90}, "warm": {"priority": 90}, "free": {"priority": 10}}
    convs = [Conversation(f"{tenant}{i}", t, [Turn(ids, max_tokens)],
                          cache_retention=retention[tenant] if mode == "priority" else None)
             for i, (t, tenant, ids, max_tokens) in enumerate(plan)]
    res = sim.simulate(Trace(convs, "two tenants"), sim.SimConfig(block_size=BLOCK, num_blocks=num_blocks),
                       max_model_len, pins=[system] if mode == "pinned" else [])
    if res.error:
        raise RuntimeError(res.error)
    prem = [res.request_cached_tokens[f"{c.conversation_id}/t0"] for c in convs if c.conversation_id.startswith("premium")]
    return sum(min(cached, PREFIX) for _, cached in prem) / (PREFIX * len(prem))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of schedule per mode")
    ap.add_argument("--rate", type=float, default=0.5, help="premium requests per second")
    ap.add_argument("--burst", type=int, default=4, help="free prompts per burst")
    ap.add_argument("--period", type=float, default=6.0, help="seconds between free bursts")
    ap.add_argument("--kv-cache-memory", default="72MiB")
    ap.add_argument("--max-model-len", type=int, default=1536)  # the pin leaves 1,536 tokens unpinned
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/retention.json")
    a = ap.parse_args()
    plan, system = schedule(a.seed, a.duration, a.rate, a.burst, a.period)
    rows = {}
    for mode in a.modes.split(","):
        work = tempfile.mkdtemp(prefix=f"kvserve-retention-{mode}-")
        keys_file = os.path.join(work, "keys.json")
        Path(keys_file).write_text(json.dumps(keys(mode)))
        proc, url = start(["--max-model-len", str(a.max_model_len), "--kv-cache-memory", a.kv_cache_memory,
                           "--disable-log-stats", "--api-keys-file", keys_file], work)
        try:
            num_blocks = int(metric(url, "kvserve:kv_blocks_total"))
            if mode == "pinned":
                r = httpx.post(f"{url}/v1/cache/pins", json={"prompt_token_ids": system}, timeout=600,
                               headers={"Authorization": "Bearer k-premium"})
                r.raise_for_status()
            results = asyncio.run(replay(url, plan))
            row = summarize(results)
            row["evictions"] = metric(url, "kvserve:cached_block_evictions_total")
        finally:
            proc.terminate()
            proc.wait(60)
        row["num_blocks"] = num_blocks
        row["simulated_prefix_hit_rate"] = simulated(plan, system, mode, num_blocks, a.max_model_len)
        rows[mode] = row
        print(f"{mode}: {row}", flush=True)
    print(f"\npremium: {SYSTEM_LEN}-token system prompt + {QUESTION_LEN}-token question, {a.rate}/s, 1 output token; "
          f"free: bursts of {a.burst} unique {FREE_LEN}-token prompts every {a.period} s; "
          f"pool {next(iter(rows.values()))['num_blocks']} blocks of {BLOCK}; {a.duration:.0f} s\n")
    print("| eviction | premium prefix hit rate | full-prefix hits | TTFT p50 ms | TTFT p99 ms | simulate's hit rate | evictions |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['prefix_hit_rate']:.3f} | {r['full_prefix_hits']}/{r['premium_requests']} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['simulated_prefix_hit_rate']:.3f} | "
              f"{r['evictions']:.0f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "modes": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
