"""Attention kernel microbenchmark: one layer of the bf16 varlen CPU kernel, decode batches over a
shared prefix, with cascade (shared-prefix) attention on and off.

The shapes are SmolLM2-135M's (9 query heads, 3 K/V heads, head_dim 64, block 16). Every decode
of a case owns `own` tokens after a prefix of `prefix` tokens that all of them share through the
same physical blocks (what prefix caching produces); `prefix 0` is the unshared control. On and
off runs alternate and the best of --repeat is kept (this VM's speed drifts between runs).

    python bench/attention.py                  # default cases, 1 and 2 threads
    python bench/attention.py --threads 1 --batch 64 --prefix 1024 --own 32
Prints a table and writes bench/results/attention.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from kvserve.attention.base import build_attention_metadata  # noqa: E402
from kvserve.attention.cpu import CPUAttentionBackend  # noqa: E402
from kvserve.cache.paged import PagedKVCache  # noqa: E402
from kvserve.config import ModelConfig  # noqa: E402
from kvserve.ops.cpu_kernels import varlen_kernel_for  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BS = 9, 3, 64, 16


def case(batch: int, prefix: int, own: int, threads: int, repeat: int, iters: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    shared = list(range(prefix // BS))
    next_block = len(shared)
    tables, seq_lens = [], []
    for _ in range(batch):
        n_own = -(-own // BS)
        tables.append(shared + list(range(next_block, next_block + n_own)))
        next_block += n_own
        seq_lens.append(prefix + own)
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=HEADS * HEAD_DIM, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, max_position_embeddings=1 << 16)
    cache = PagedKVCache(cfg, num_blocks=next_block, block_size=BS, dtype=torch.bfloat16, layout="pairs")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).bfloat16())
    meta = build_attention_metadata([n - 1 for n in seq_lens], [1] * batch, tables, BS)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()
    k_all, v_all = cache.gather(0, torch.arange(next_block))
    k, v = k_all[meta.slot_mapping], v_all[meta.slot_mapping]
    backends = {on: CPUAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, scale=HEAD_DIM ** -0.5, cascade=on)
                for on in (False, True)}
    best = {False: float("inf"), True: float("inf")}
    groups = 0
    for _ in range(repeat):
        for on, backend in backends.items():
            meta.backend_state.clear()
            backend.forward(0, q, k, v, cache, meta)  # plan (cached per step) + warm
            if on:
                groups = meta.backend_state["varlen"].groups.num_groups
            t = time.perf_counter()
            for _ in range(iters):
                backend.forward(0, q, k, v, cache, meta)
            best[on] = min(best[on], (time.perf_counter() - t) / iters)
    flops = 4 * batch * HEADS * HEAD_DIM * (prefix + own)
    return {"batch": batch, "prefix": prefix, "own": own, "threads": threads, "groups": groups,
            "plain_ms": best[False] * 1e3, "cascade_ms": best[True] * 1e3,
            "speedup": best[False] / best[True], "plain_gflops": flops / best[False] / 1e9,
            "cascade_gflops": flops / best[True] / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", default="8,64")
    ap.add_argument("--prefix", default="0,1024,4096")
    ap.add_argument("--own", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=str(HERE / "results" / "attention.json"))
    args = ap.parse_args(argv)
    if varlen_kernel_for(torch.bfloat16, HEAD_DIM, torch.device("cpu")) is None:
        print("the bf16 varlen kernel is not available here (needs AVX512-BF16 and a C++ compiler)")
        return 1
    rows = [case(b, p, args.own, t, args.repeat, args.iters)
            for t in map(int, args.threads.split(",")) for b in map(int, args.batch.split(","))
            for p in map(int, args.prefix.split(","))]
    print(f"\nOne layer of bf16 paged attention, {HEADS}/{KV_HEADS} heads, d {HEAD_DIM}, block {BS}, "
          f"decodes with {args.own} own tokens after a shared prefix; {os.cpu_count()} CPUs")
    print(f"{'threads':>7} {'batch':>5} {'prefix':>6} {'groups':>6} {'plain ms':>9} {'cascade ms':>10} "
          f"{'speedup':>8} {'plain GF/s':>10} {'cascade GF/s':>12}")
    for r in rows:
        print(f"{r['threads']:>7} {r['batch']:>5} {r['prefix']:>6} {r['groups']:>6} {r['plain_ms']:>9.3f} "
              f"{r['cascade_ms']:>10.3f} {r['speedup']:>7.2f}x {r['plain_gflops']:>10.1f} {r['cascade_gflops']:>12.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
