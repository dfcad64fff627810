"""The semantic cache under load, through the real server (default SmolLM2, greedy).

Throughput: a chat workload where 30 / 60 / 90 % of the questions repeat, by meaning, one asked
before (the paraphrase pairs of bench/data/paraphrase_pairs.jsonl: a group is introduced by its
first question and repeated by its paraphrase), the rest unique; `--concurrency` clients send
`--requests` questions in order, streamed. The same sequence against a server with
--semantic-cache (`--store`: its PATH or Redis URL) and one without, both up at once and the
runs interleaved: requests/s, TTFT and latency p50/p99, hit rate.

Decode interference: `--streams` streamed decodes of `--decode-tokens` tokens (semantic_cache
false: never looked up) while one client sends unique questions one after another (max_tokens 1;
on the cache's server with semantic_cache_threshold 1.0, so each is a lookup that misses: an
embedding, a scan, a store). Inter-token latency of the decodes with the cache on and off, and
with no other requests. Prints tables, writes JSON.

    python bench/semantic_cache_load.py [--out bench/results/semantic_cache_load.json] [--max-tokens 32]
                                        [--store redis://127.0.0.1:6379/0] [--modes off,on]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_util import start_server  # noqa: E402

DATA = Path(__file__).parent / "data" / "paraphrase_pairs.jsonl"
MIXES = (0.3, 0.6, 0.9)


def workload(repeat: float, n: int, pairs: list[dict], seed: int = 0) -> list[tuple[str, bool]]:
    """(question, is a repeat by meaning) in order: each repeat (a group's paraphrase) comes after
    its group's first question; the unique questions are the groups' first and the hard negatives."""
    rng = random.Random(seed)
    groups = [p for p in pairs if p["paraphrase"]]
    others = [p["b"] for p in pairs if not p["paraphrase"]]
    rng.shuffle(groups)
    rng.shuffle(others)
    n_repeat = round(repeat * n)
    n_unique = n - n_repeat
    groups = groups[:min(6, n_unique)]
    seq = [(q, False) for q in [g["a"] for g in groups] + others[:n_unique - len(groups)]]
    rng.shuffle(seq)
    for _ in range(n_repeat):
        g = rng.choice(groups)
        seq.insert(rng.randint(seq.index((g["a"], False)) + 1, len(seq)), (g["b"], True))
    return seq


def stream_chat(url: str, question: str, max_tokens: int, **extra) -> dict:
    """One streamed chat request: TTFT, latency, the arrival time of every content chunk."""
    t0 = time.perf_counter()
    times, header = [], None
    body = {"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": max_tokens,
            "stream": True, **extra}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        header = r.headers.get("x-kvserve-semantic-cache", "")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": (times[0] if times else end) - t0, "latency": end - t0, "times": times,
            "hit": header.startswith("hit")}


def pct(values, q) -> float:
    return float(np.percentile(values, q) * 1000) if len(values) else float("nan")


def throughput(url: str, seq: list[tuple[str, bool]], concurrency: int, max_tokens: int) -> dict:
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda item: stream_chat(url, item[0], max_tokens), seq))
    wall = time.perf_counter() - t
    return {"requests": len(rows), "wall_s": wall, "rps": len(rows) / wall,
            "ttft_p50_ms": pct([r["ttft"] for r in rows], 50), "ttft_p99_ms": pct([r["ttft"] for r in rows], 99),
            "latency_p50_ms": pct([r["latency"] for r in rows], 50),
            "latency_p99_ms": pct([r["latency"] for r in rows], 99),
            "hit_rate": sum(r["hit"] for r in rows) / len(rows)}


def interference(url: str, streams: int, tokens: int, side: dict | None) -> dict:
    """ITL of `streams` decodes; `side`: extra body of the lookups sent meanwhile (None: none)."""
    stop, sent = threading.Event(), [0]

    def lookups():
        i = 0
        while not stop.is_set():
            stream_chat(url, f"Tell me one fact about the number {i * 7919 % 100003} and the colour of a "
                             f"{['fox', 'boat', 'leaf', 'kite', 'drum'][i % 5]} in {1900 + i % 120}.", 1, **side)
            i += 1
        sent[0] = i

    side_thread = threading.Thread(target=lookups) if side is not None else None
    if side_thread:
        side_thread.start()
        time.sleep(0.5)
    with ThreadPoolExecutor(streams) as pool:
        rows = list(pool.map(lambda i: stream_chat(url, f"Write a long story about a lighthouse keeper, part {i}.",
                                                   tokens, semantic_cache=False, ignore_eos=True), range(streams)))
    stop.set()
    if side_thread:
        side_thread.join(300)
    itl = np.concatenate([np.diff(r["times"]) for r in rows if len(r["times"]) > 1])
    return {"itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "tokens": int(itl.size) + len(rows),
            "side_requests": sent[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/semantic_cache_load.json")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--store", metavar="PATH|URL", help="the cache's --semantic-cache (default: a new SQLite file); "
                    "a Redis URL's database is flushed")
    ap.add_argument("--modes", default="off,on", help="servers to run: off (no cache), on, or both")
    a = ap.parse_args()
    pairs = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    args = ("--max-model-len", "512", "--disable-log-stats")
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "args": vars(a),
              "throughput": {}, "interference": {}}
    store = tempfile.mkdtemp(prefix="kvserve-semantic-load-")
    if a.store and a.store.startswith("redis"):
        import redis
        redis.Redis.from_url(a.store).flushdb()
    servers = {}
    try:
        # both servers up at once, the runs interleaved: load from other work on a shared machine
        # falls on both alike
        for mode in a.modes.split(","):
            extra = ("--semantic-cache", a.store or os.path.join(store, "cache.db")) if mode == "on" else ()
            servers[mode] = start_server(*args, *extra)
            stream_chat(servers[mode].url, "Hello!", 4, semantic_cache=False)  # warm up
        for mix in MIXES:
            for mode, server in servers.items():
                if mode == "on":
                    httpx.delete(f"{server.url}/v1/semantic_cache", timeout=30).raise_for_status()
                r = throughput(server.url, workload(mix, a.requests, pairs), a.concurrency, a.max_tokens)
                result["throughput"][f"{mix:.0%} {mode}"] = r
                print(f"{mix:.0%} repeated, cache {mode}: {r['rps']:.2f} req/s, TTFT p50 {r['ttft_p50_ms']:.0f} "
                      f"p99 {r['ttft_p99_ms']:.0f} ms, latency p50 {r['latency_p50_ms']:.0f} p99 "
                      f"{r['latency_p99_ms']:.0f} ms, hits {r['hit_rate']:.0%}", flush=True)
        cases = [("off", "alone", None), ("off", "with lookups", {}),
                 ("on", "with lookups", {"semantic_cache_threshold": 1.0})]
        for mode, name, side in cases:
            if mode in servers:
                r = interference(servers[mode].url, a.streams, a.decode_tokens, side)
                result["interference"][f"cache {mode}, {name}"] = r
                print(f"decode ITL, cache {mode}, {name}: p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} ms "
                      f"({r['side_requests']} other requests)", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print("\n| repeated | cache | req/s | TTFT p50 / p99 ms | latency p50 / p99 ms | hit rate |\n|---|---|---:|---:|---:|---:|")
    for k, r in result["throughput"].items():
        mix, mode = k.split()
        print(f"| {mix} | {mode} | {r['rps']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f} | {r['hit_rate']:.0%} |")
    print("\n| decodes | ITL p50 ms | ITL p99 ms | other requests |\n|---|---:|---:|---:|")
    for k, r in result["interference"].items():
        print(f"| {k} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['side_requests']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
