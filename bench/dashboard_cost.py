"""The dashboard's cost on engine steps: the same workload against `kvserve serve` with nobody
watching, with a poller fetching /dashboard/data as the page does (every 1.5 s), and with a
poller at 10x that rate (every 0.15 s), alternated `--rounds` times on one server.

    python bench/dashboard_cost.py [--rounds 3] [--requests 16] [--max-tokens 64]

Per run: mean step time (the mean inter-token latency from /metrics' histogram sums over the run:
every running request gets one token per step), output tok/s, and the snapshot's own time as the
engine core reports it. Prints a table; writes bench/results/dashboard_cost.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_util import SMALL, start_server  # noqa: E402


def counters(server) -> tuple[float, float, float]:
    m = server.metrics()
    pick = lambda name: sum(v for k, v in m.items() if k.startswith(name + "{"))  # noqa: E731
    return (pick("vllm:inter_token_latency_seconds_sum"), pick("vllm:inter_token_latency_seconds_count"),
            pick("vllm:generation_tokens_total"))


def run(server, poll_s: float | None, requests: int, max_tokens: int) -> dict:
    stop, snaps = threading.Event(), []

    def poller():
        since = 0.0
        while not stop.is_set():
            d = httpx.get(f"{server.url}/dashboard/data", params={"since": since}, timeout=30).json()
            snaps.append(d["engine"]["snapshot_ms"])
            if d["series"]["t"]:
                since = d["series"]["t"][-1]
            stop.wait(poll_s)
    thread = threading.Thread(target=poller, daemon=True) if poll_s else None
    before = counters(server)
    t0 = time.perf_counter()
    if thread:
        thread.start()

    def one(i):
        httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "prompt": f"Request {i} asks the same question about caches. " * 4, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0})
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    stop.set()
    if thread:
        thread.join(30)
    after = counters(server)
    return {"poll_s": poll_s, "step_ms": 1000 * (after[0] - before[0]) / max(1, after[1] - before[1]),
            "tok_s": (after[2] - before[2]) / wall, "polls": len(snaps),
            "snapshot_ms": statistics.mean(snaps) if snaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    server = start_server(*SMALL, "--max-num-seqs", "8", "--disable-log-stats", "--disable-uvicorn-access-log")
    results = []
    try:
        run(server, None, 8, 16)  # warm-up
        for r in range(a.rounds):
            for poll in (None, 1.5, 0.15):
                results.append({"round": r, **run(server, poll, a.requests, a.max_tokens)})
                print(results[-1], flush=True)
    finally:
        server.stop()
    rows = []
    base = statistics.median(x["step_ms"] for x in results if x["poll_s"] is None)
    print(f"\n{'watcher':<22}{'step ms (median)':>18}{'vs none':>10}{'tok/s':>9}{'snapshot ms':>13}")
    for poll, label in ((None, "nobody"), (1.5, "page (every 1.5 s)"), (0.15, "10x (every 0.15 s)")):
        xs = [x for x in results if x["poll_s"] == poll]
        step = statistics.median(x["step_ms"] for x in xs)
        snap = [x["snapshot_ms"] for x in xs if x["snapshot_ms"] is not None]
        row = {"watcher": label, "step_ms": step, "vs_none_pct": 100 * (step / base - 1),
               "tok_s": statistics.median(x["tok_s"] for x in xs), "snapshot_ms": statistics.mean(snap) if snap else None,
               "runs": [x["step_ms"] for x in xs]}
        rows.append(row)
        print(f"{label:<22}{step:>18.2f}{row['vs_none_pct']:>+9.1f}%{row['tok_s']:>9.1f}"
              f"{(row['snapshot_ms'] or 0):>13.3f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "dashboard_cost.json"), "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "args": vars(a),
                   "table": rows, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
