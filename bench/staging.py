"""The staging pass of quantized KV caches on CPU: one layer's blocks dequantized into the bf16
"pairs" scratch the varlen kernel reads (attention/staging.py), per format.

The shapes are a batch-64 decode step of the `random` workload on SmolLM2-135M: 64 sequences of
416 tokens (1,664 blocks of 16, 3 K/V heads, head_dim 64), in shuffled blocks as a long-running
pool holds them, taken in the engine's parts of STAGE_BYTES. "cold" flushes the last-level cache
before each pass (the engine's other 29 layers and the weights pass through it between two
visits of a layer); "warm" repeats the first part. Best and median of --repeat.

    python bench/staging.py
    python bench/staging.py --formats int8 --repeat 30
Prints a table and writes bench/results/staging.json.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from kvserve.attention.base import build_attention_metadata  # noqa: E402
from kvserve.attention.staging import STAGE_BYTES, StageScratch  # noqa: E402
from kvserve.cache.fp8 import Fp8PagedKVCache  # noqa: E402
from kvserve.cache.kivi import IntPagedKVCache  # noqa: E402
from kvserve.config import ModelConfig  # noqa: E402
from kvserve.ops.cpu_kernels import stage_quantized_kernel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BS = 9, 3, 64, 16


def filled_cache(fmt: str, seqs: int, tokens: int, seed: int = 0):
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=HEADS * HEAD_DIM, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, max_position_embeddings=4096)
    per_seq = -(-tokens // BS)
    kw = dict(num_blocks=seqs * per_seq + 64, block_size=BS, dtype=torch.bfloat16,
              num_residual_blocks=seqs + 1, seal_at_step_end=True)
    cache = (Fp8PagedKVCache(cfg, kv_cache_dtype=fmt, **kw) if fmt.startswith("fp8")
             else IntPagedKVCache(cfg, kv_cache_dtype=fmt, **kw))
    ids = list(range(cache.num_blocks))
    random.Random(seed).shuffle(ids)
    torch.manual_seed(seed)
    tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(seqs)]
    for table in tables:  # one prefill per sequence; keys off zero as real keys are
        meta = build_attention_metadata([0], [tokens], [table], BS)
        k = (torch.randn(tokens, KV_HEADS, HEAD_DIM) * 2 + 1.5).bfloat16()
        cache.write(0, meta.slot_mapping, k, torch.randn(tokens, KV_HEADS, HEAD_DIM).bfloat16())
    cache.finish_step()
    return cache, sorted({b for t in tables for b in t})


def timed(fn, repeat: int, before=None) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[0] * 1e3, times[len(times) // 2] * 1e3


def case(fmt: str, seqs: int, tokens: int, repeat: int) -> dict:
    cache, blocks = filled_cache(fmt, seqs, tokens)
    per_part = max(1, STAGE_BYTES // (2 * KV_HEADS * HEAD_DIM * BS * 2))
    parts = [torch.tensor(blocks[i:i + per_part]) for i in range(0, len(blocks), per_part)]
    scratch = StageScratch()
    flush = torch.empty(96 << 20, dtype=torch.uint8)

    def all_parts():
        for p in parts:
            scratch.fill(cache, 0, p)

    all_parts()  # grows the scratch
    cold_best, cold_median = timed(all_parts, repeat, before=lambda: flush.add_(1))
    warm_best, warm_median = timed(lambda: scratch.fill(cache, 0, parts[0]), repeat)
    out_bytes = len(blocks) * 2 * KV_HEADS * HEAD_DIM * BS * 2
    return {"format": fmt, "blocks": len(blocks), "parts": len(parts), "cold_best_ms": cold_best,
            "cold_median_ms": cold_median, "warm_part_best_ms": warm_best, "warm_part_median_ms": warm_median,
            "bf16_out_gb_per_s": out_bytes / cold_best / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int8,int4,fp8_e4m3")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=416)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", default=str(HERE / "results" / "staging.json"))
    args = ap.parse_args(argv)
    if stage_quantized_kernel() is None:
        print("the compiled staging pass is not available here (needs AVX512-BF16 and a C++ compiler)")
        return 1
    rows = [case(f, args.seqs, args.tokens, args.repeat) for f in args.formats.split(",")]
    print(f"\nStaging one layer: {args.seqs} sequences x {args.tokens} tokens, {KV_HEADS} K/V heads, "
          f"d {HEAD_DIM}, block {BS}; {torch.get_num_threads()} threads")
    print(f"{'format':>9} {'blocks':>6} {'parts':>5} {'cold ms best/med':>17} {'warm part ms best/med':>22} "
          f"{'bf16 out GB/s':>13}")
    for r in rows:
        print(f"{r['format']:>9} {r['blocks']:>6} {r['parts']:>5} "
              f"{r['cold_best_ms']:>8.3f}/{r['cold_median_ms']:<8.3f} "
              f"{r['warm_part_best_ms']:>11.3f}/{r['warm_part_median_ms']:<10.3f} {r['bf16_out_gb_per_s']:>13.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
