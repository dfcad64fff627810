"""Data parallelism x tensor parallelism served on this machine: which layout of the same cores pays.

    python bench/dp_tp.py [--num-requests 32] [--prompt-len 128] [--max-tokens 64] [--repeat 2]

Each row is a real `kvserve serve` on 127.0.0.1 with one layout: DP=1 x TP=1 (one engine, every
core in its OpenMP team; and with one thread), DP=2 x TP=1 (two replicas, a core each), DP=1 x TP=2 (one engine, a
rank per core) and, where there are fewer than four CPUs, DP=2 x TP=2 with
VLLM_CPU_OMP_THREADS_BIND sharing the cores ("0|1|0|1": each replica's rank r on CPU r). The
model is SmolLM2-135M's shapes with 8 query / 2 KV heads (the embedded 9 / 3 do not split in two;
random bf16 weights, bench/tensor_parallel.py's checkpoint). All requests are sent at once
(random token-id prompts, greedy, ignore_eos, round-robin routing so the replicas share them
evenly), the clock runs from the first send to the last answer, after a warm-up; --repeat rounds
of every layout in turn, best of each. Prints a table (requests/s, output tok/s) and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from server_util import start_server  # noqa: E402
from tensor_parallel import checkpoint  # noqa: E402


async def run(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=len(prompts))) as c:
        async def one(p):
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t
    return {"seconds": dt, "requests_per_s": len(prompts) / dt, "output_tok_per_s": sum(tokens) / dt}


def layouts(cpus: int) -> list[tuple[str, list[str], dict]]:
    rows = [("DP=1 x TP=1", [], {}),
            ("DP=1 x TP=1, one thread", [], {"OMP_NUM_THREADS": "1"}),
            ("DP=2 x TP=1", ["-dp", "2", "--data-parallel-routing", "round_robin"], {}),
            ("DP=1 x TP=2", ["-tp", "2"], {})]
    shared = {} if cpus >= 4 else {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % cpus) for i in range(4))}
    rows.append(("DP=2 x TP=2" + (" (shared cores)" if shared else ""),
                 ["-dp", "2", "-tp", "2", "--data-parallel-routing", "round_robin"], shared))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated row numbers (0-based) to run")
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench-tp-checkpoint")
    ap.add_argument("--out", default=str(HERE / "results" / "dp_tp.json"))
    args = ap.parse_args(argv)

    model = checkpoint(args.model_dir)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    cpus = len(os.sched_getaffinity(0))
    rows = layouts(cpus)
    if args.only:
        rows = [rows[int(i)] for i in args.only.split(",")]  # e.g. --only 2,3: the DP=2 / TP=2 pair
    flags = ["--model", model, "--dtype", "bfloat16", "--kv-cache-memory", "256MiB", "--max-model-len", "1024",
             "--max-num-seqs", str(args.num_requests), "--disable-log-stats", "--no-enable-prefix-caching"]
    results = {"machine": platform.processor() or platform.machine(), "cpus": cpus, "settings": vars(args),
               "rows": []}
    # Rounds outermost (each layout's server started afresh per round): this VM's speed drifts
    # over minutes, so the layouts are compared round by round, best of the rounds each.
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in rows}
    for round_ in range(args.repeat):
        for label, extra, env in rows:
            server = start_server(*flags, *extra, env=env, timeout=600)
            try:
                asyncio.run(run(server.url, prompts[:4], 8))  # warm-up
                r = asyncio.run(run(server.url, prompts, args.max_tokens))
            finally:
                server.stop()
            runs[label].append(r)
            print(f"round {round_}: {label}: {r['requests_per_s']:.2f} req/s, {r['output_tok_per_s']:.0f} tok/s",
                  flush=True)
    for label, extra, env in rows:
        best = max(runs[label], key=lambda r: r["requests_per_s"])
        results["rows"].append({"layout": label, "flags": extra, "env": env, "runs": runs[label], **best})

    print(f"\n{args.num_requests} requests at once, {args.prompt_len}-token prompts, {args.max_tokens} tokens out, "
          f"bf16, {cpus} CPUs")
    print(f"{'layout':<28} {'req/s':>7} {'output tok/s':>13}  {'req/s each round':>18}")
    for r in results["rows"]:
        each = " / ".join(f"{x['requests_per_s']:.2f}" for x in r["runs"])
        print(f"{r['layout']:<28} {r['requests_per_s']:>7.2f} {r['output_tok_per_s']:>13.0f}  {each:>18}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
