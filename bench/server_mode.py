"""Server mode vs offline: the same token-id workloads through `kvserve serve`'s HTTP API and
through the offline `LLM` API, same engine settings, same run (the target: within 15 %).

The server is a real `kvserve serve` subprocess on 127.0.0.1; all requests of a workload are sent
at once (one HTTP connection each, non-streaming /v1/completions with `prompt` as token ids,
greedy, `ignore_eos`), and the clock runs from the first send to the last response. The prefix
cache is reset before every run on both sides, so cached-token counts compare too. Offline and
server runs alternate, best of --repeat each.

    python bench/server_mode.py                       # random + shared, 64 requests, bf16
    python bench/server_mode.py --workloads random --num-requests 16
    python bench/server_mode.py --device cuda --model DIR      # a GPU
    python bench/server_mode.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
Prints a table and writes bench/results/server_mode.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/server_util.py: `kvserve serve` on 127.0.0.1

from server_util import start_server  # noqa: E402
from throughput import make_workloads, run_kvserve  # noqa: E402

from kvserve import LLM  # noqa: E402
from kvserve.tools.bench_serve import ClientLanes  # noqa: E402


async def run_http(url: str, model: str, prompts: list[list[int]], out_len: int) -> dict:
    # A client per request (ClientLanes): one shared httpx client spent 5.6 ms of CPU per request
    # at 64 in flight, on its own connection pool, which on GPU runs was most of the difference.
    lanes = ClientLanes(base_url=url, timeout=httpx.Timeout(1800))
    try:
        async with lanes.lane() as client:
            (await client.post("/reset_prefix_cache")).raise_for_status()

        async def one(p: list[int]) -> dict:
            async with lanes.lane() as client:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": p, "max_tokens": out_len, "temperature": 0.0,
                    "ignore_eos": True})
            r.raise_for_status()
            return r.json()

        t = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t
    finally:
        await lanes.aclose()
    gen = sum(o["usage"]["completion_tokens"] for o in outs)
    cached = sum(((o["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for o in outs)
    return {"seconds": dt, "output_tokens": gen, "output_tok_per_s": gen / dt,
            "cached_prompt_tokens": cached}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--workloads", default="random,shared")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved offline/server runs; best of each")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--speculative-config", default=None,
                    help="vLLM's --speculative-config JSON, given to both sides, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}'")
    ap.add_argument("--json", default=str(HERE / "results" / "server_mode.json"))
    args = ap.parse_args(argv)

    settings = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_model_len=2048,
                    max_num_seqs=args.num_requests, device=args.device)
    flags = ["--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048",
             "--max-num-seqs", str(args.num_requests), "--device", args.device]
    if args.model:
        flags += ["--model", args.model]
    if args.speculative_config:
        settings["speculative_config"] = args.speculative_config
        flags += ["--speculative-config", args.speculative_config]
    workloads = make_workloads(args.num_requests, 49152)
    names = args.workloads.split(",")
    results: dict = {"settings": settings, "num_requests": args.num_requests, "workloads": {}}

    # Interleaved (offline, server, offline, server, ...): this VM's speed drifts by +-30 % over
    # minutes, so only runs taken side by side compare; best of --repeat each.
    server = start_server(*flags)
    try:
        url = server.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        llm = LLM(args.model, **settings)
        for name in names:  # warm-up: allocator, kernels (and on CUDA their JIT-compiled variants)
            asyncio.run(run_http(url, model, *workloads[name]))
            run_kvserve(llm, *workloads[name])
        for name in names:
            prompts, out_len = workloads[name]
            runs = results["workloads"][name] = {"offline_runs": [], "server_runs": []}
            for _ in range(args.repeat):
                runs["offline_runs"].append(run_kvserve(llm, prompts, out_len))
                runs["server_runs"].append(asyncio.run(run_http(url, model, prompts, out_len)))
            runs["offline"] = max(runs["offline_runs"], key=lambda r: r["output_tok_per_s"])
            runs["server"] = max(runs["server_runs"], key=lambda r: r["output_tok_per_s"])
    finally:
        server.stop()

    spec = f", speculative {args.speculative_config}" if args.speculative_config else ""
    print(f"\nServer mode vs offline, {args.num_requests} requests, {args.dtype}, {os.cpu_count()} CPUs{spec}")
    print(f"{'workload':<8} {'offline s (each)':>18} {'offline tok/s':>14} {'server s (each)':>18} {'server tok/s':>13} "
          f"{'server/offline':>15} {'cached off/srv':>15}")
    for name in names:
        off, srv = results["workloads"][name]["offline"], results["workloads"][name]["server"]
        ratio = srv["output_tok_per_s"] / off["output_tok_per_s"]
        results["workloads"][name]["server_over_offline"] = ratio
        each = {side: " / ".join(f"{r['seconds']:.2f}" for r in results["workloads"][name][f"{side}_runs"])
                for side in ("offline", "server")}
        print(f"{name:<8} {each['offline']:>18} {off['output_tok_per_s']:>14.1f} {each['server']:>18} "
              f"{srv['output_tok_per_s']:>13.1f} {ratio:>14.2f}x "
              f"{off['cached_prompt_tokens']:>7}/{srv['cached_prompt_tokens']:<7}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
