"""Disaggregated prefill/decode against one server on the same cores: the inter-token latency of
running decodes while long prompts arrive (the reason P/D exists: vLLM's docs say it controls tail
ITL rather than raising throughput), and what moving the KV through Redis costs per token.

    python bench/disagg.py [--decodes 4] [--decode-tokens 160] [--long 4] [--long-tokens 1000]

one:  one kvserve server on both cores, every request sent to it.
pd:   a prefill server on core 0 and a decode server on core 1 (one thread each), a redis-server,
      and vllm-router --vllm-pd-disaggregation in front; every request goes through the router.
The decodes (short prompts, streamed) start together; the long prompts arrive one a second from
the first second on. ITL: the gaps between a decode's streamed tokens. Transfer cost, measured
on the two P/D servers directly (median of --reps): the prefill server's time with the KV
written to Redis minus without, and the decode server's time to read a prompt's KV from Redis
minus the same prompt from its own pool, each per prompt token. Prints a table; writes
bench/results/disagg.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

for _sub in ("tests", "src"):  # the checkout's code, as the tests run it
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", _sub))
from helpers import free_port, terminate, wait_until  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from server_util import start_server  # noqa: E402

ARGS = ["--max-model-len", "1024", "--disable-log-stats", "--block-size", "16"]
VOCAB = 49152


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def pinned(cores: set[int], threads: int, *args: str):
    """A server whose processes run on `cores` (inherited from this process at start)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        return start_server(*args, env={"OMP_NUM_THREADS": str(threads)})
    finally:
        os.sched_setaffinity(0, before)


def stream_times(url: str, ids: list[int], max_tokens: int, out: list) -> None:
    times = []
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            print("decode stream refused:", r.status_code, r.read()[:300], file=sys.stderr)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    out.append(times)


def workload(url: str, args, seed: int) -> dict:
    rng = random.Random(seed)
    decodes = [prompt(rng, 32) for _ in range(args.decodes)]
    longs = [prompt(rng, args.long_tokens) for _ in range(args.long)]
    streams: list = []
    ttft: list = []
    threads = [threading.Thread(target=stream_times, args=(url, p, args.decode_tokens, streams)) for p in decodes]
    start = time.perf_counter()
    for t in threads:
        t.start()

    def long_request(ids):
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                     "ignore_eos": True}, timeout=600)
        assert r.status_code == 200, r.text
        ttft.append(time.perf_counter() - t0)

    longs_t = []
    for i, ids in enumerate(longs):
        time.sleep(max(0.0, start + 1.0 + i - time.perf_counter()))
        th = threading.Thread(target=long_request, args=(ids,))
        th.start()
        longs_t.append(th)
    for th in threads + longs_t:
        th.join(900)
    gaps = sorted(b - a for times in streams for a, b in zip(times, times[1:]))
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1e3  # noqa: E731
    return {"itl_p50_ms": q(0.50), "itl_p99_ms": q(0.99), "itl_max_ms": gaps[-1] * 1e3,
            "long_latency_mean_s": statistics.mean(ttft), "wall_s": time.perf_counter() - start,
            "decode_tokens": sum(len(t) for t in streams)}


def timed(url: str, ids: list[int], **extra) -> tuple[float, dict]:
    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0, **extra},
                   timeout=600)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t, r.json()


def transfer_cost(producer, consumer, args) -> dict:
    rng = random.Random(7)
    export, load = [], []
    for _ in range(args.reps):
        plain, with_kv = prompt(rng, args.long_tokens), prompt(rng, args.long_tokens)
        t_plain, _ = timed(producer.url, plain)
        t_export, body = timed(producer.url, with_kv, kv_transfer_params={"do_remote_decode": True})
        params = body["kv_transfer_params"]
        n = params["remote_num_tokens"]
        t_load, _ = timed(consumer.url, with_kv, kv_transfer_params=params)
        t_pool, _ = timed(consumer.url, with_kv)  # now in the decode server's own pool
        export.append((t_export - t_plain) / n * 1e6)
        load.append((t_load - t_pool) / n * 1e6)
    return {"write_us_per_token": statistics.median(export), "read_us_per_token": statistics.median(load),
            "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = ap.parse_args()
    model = [args.model] if args.model else []
    results: dict = {"machine": platform.processor() or platform.machine(), "args": vars(args)}

    one = pinned({0, 1}, 2, *model, *ARGS)
    try:
        workload(one.url, args, seed=99)  # warm-up
        results["one"] = workload(one.url, args, seed=1)
    finally:
        one.stop()

    with RedisServer() as redis:
        tier = ["--kv-redis-url", redis.url]
        cfg = lambda role: ["--kv-transfer-config", json.dumps({"kv_connector": "RedisConnector", "kv_role": role})]  # noqa: E731
        producer = pinned({0}, 1, *model, *ARGS, *tier, *cfg("kv_producer"))
        consumer = None
        router = None
        try:
            consumer = pinned({1}, 1, *model, *ARGS, *tier, *cfg("kv_consumer"))
            port = free_port()
            log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)
            router = subprocess.Popen(
                [shutil.which("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                 "--prefill", producer.url, "--decode", consumer.url, "--policy", "round_robin",
                 "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"],
                stdout=log, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: _healthy(url), 60, 0.2, "vllm-router")
            workload(url, args, seed=99)
            results["pd"] = workload(url, args, seed=1)
            results["pd"]["recomputed_tokens"] = consumer.metric("kvserve:kv_transfer_recomputed_tokens_total")
            results["transfer"] = transfer_cost(producer, consumer, args)
        finally:
            terminate(router)
            for s in (consumer, producer):
                if s is not None:
                    s.stop()

    print(f"{'':6} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ITL max ms':>11} {'long req s':>11} {'wall s':>8}")
    for name in ("one", "pd"):
        r = results[name]
        print(f"{name:6} {r['itl_p50_ms']:11.1f} {r['itl_p99_ms']:11.1f} {r['itl_max_ms']:11.1f} "
              f"{r['long_latency_mean_s']:11.2f} {r['wall_s']:8.1f}")
    t = results["transfer"]
    print(f"KV through Redis, per prompt token ({t['tokens']} tokens): write {t['write_us_per_token']:.1f} us "
          f"(prefill server), read {t['read_us_per_token']:.1f} us (decode server)")
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "disagg.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print("wrote", path)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
