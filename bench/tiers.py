"""What the offload tiers buy on the embedded SmolLM2-135M: restore vs recompute, and TTFT.

1. Restore vs recompute of a 2,000-token prefix (125 blocks of 16): a prompt is computed cold
   (recompute time = its TTFT), pushed out of a device pool that holds barely one such prompt by a
   second prompt, and asked again: its prefix then comes back from the one tier configured
   (host RAM, local disk, Redis) and only the last tokens are computed. Reported: TTFT cold vs
   restored, and the engine's own restore time (tier reads + writes into the pool).
2. Multi-turn chats under a device pool too small for the working set: several conversations take
   turns; each turn resends the history. TTFT of turns 2+ with tiers off vs host / disk / Redis.
3. Preemption: a batch that overflows the pool, recompute vs swap (same tokens, total time).

    python bench/tiers.py                 # full run; writes bench/results/tiers.json
    python bench/tiers.py --quick         # smaller prefix and fewer turns
    python bench/tiers.py --redis-url redis://127.0.0.1:6379/0   # else a temp redis-server is started

Disk figures are with the file data in the page cache (no cache dropping on a shared machine):
they measure the read + checksum + copy path, not a cold SSD.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/redis_server.py: a throwaway redis-server

BLOCK = 16


def one_token():
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(llm, prompt, params=None):
    start = time.perf_counter()
    out = llm.generate([prompt], params or one_token(), use_tqdm=False)[0]
    return time.perf_counter() - start, out


def make_llm(tier_kwargs, pool_blocks, max_model_len, dtype="float32", **extra):
    return LLM(None, dtype=dtype, block_size=BLOCK, num_gpu_blocks_override=pool_blocks,
               max_model_len=max_model_len, max_num_batched_tokens=2048, **tier_kwargs, **extra)


def restore_vs_recompute(tiers: dict, prefix_len: int, repeats: int) -> list[dict]:
    rng = random.Random(0)
    vocab = 49152
    pool = prefix_len // BLOCK + 2  # one prompt fits; a second one evicts all of it
    rows = []
    for name, kwargs in tiers.items():
        llm = make_llm(kwargs, pool, pool * BLOCK)
        cold, restored, restore_s = [], [], []
        try:
            for r in range(repeats):
                prompt = [rng.randrange(vocab) for _ in range(prefix_len + 1)]
                other = [rng.randrange(vocab) for _ in range(prefix_len + 1)]
                t_cold, first = ttft(llm, prompt)
                ttft(llm, other)  # evicts `prompt`'s blocks: written down to the tier
                if llm.engine.kv_tiers is not None:
                    llm.engine.kv_tiers.flush(60)
                before = llm.engine.get_stats()
                t_again, again = ttft(llm, prompt)
                after = llm.engine.get_stats()
                assert again.outputs[0].token_ids == first.outputs[0].token_ids
                cold.append(t_cold)
                restored.append(t_again)
                restore_s.append(after.kv_restore_seconds - before.kv_restore_seconds)
                hit = after.tier_hits.get(name, 0) - before.tier_hits.get(name, 0)
                if name != "none":
                    assert hit >= prefix_len - 2 * BLOCK, f"{name}: only {hit} tokens restored"
        finally:
            llm.engine.close()
        row = {"tier": name, "prefix_tokens": prefix_len, "recompute_s": statistics.median(cold),
               "ttft_again_s": statistics.median(restored),
               "restore_s": statistics.median(restore_s) if name != "none" else None}
        row["speedup"] = row["recompute_s"] / row["ttft_again_s"]
        rows.append(row)
        print(f"  {name:6s} recompute {row['recompute_s']*1000:8.1f} ms   again {row['ttft_again_s']*1000:8.1f} ms"
              + (f"   (restore {row['restore_s']*1000:.1f} ms)" if row["restore_s"] is not None else ""),
              flush=True)
    return rows


def multi_turn(tiers: dict, num_chats: int, turns: int, first_len: int, pool_blocks: int) -> list[dict]:
    rows = []
    for name, kwargs in tiers.items():
        rng = random.Random(1)
        histories = [[rng.randrange(49152) for _ in range(first_len)] for _ in range(num_chats)]
        llm = make_llm(kwargs, pool_blocks, pool_blocks * BLOCK)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        later, outputs = [], []
        try:
            for turn in range(turns):
                for c in range(num_chats):  # users take turns: a chat comes back after the others
                    t, out = ttft(llm, histories[c], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                    if turn > 0:
                        later.append(t)
                    answer = llm.generate([histories[c]], params, use_tqdm=False)[0].outputs[0].token_ids
                    outputs.append(answer)
                    histories[c] = histories[c] + answer + [rng.randrange(49152) for _ in range(60)]
            s = llm.engine.get_stats()
        finally:
            llm.engine.close()
        working_set = sum(len(h) for h in histories)
        row = {"tier": name, "chats": num_chats, "turns": turns, "pool_tokens": pool_blocks * BLOCK,
               "working_set_tokens": working_set, "ttft_mean_s": statistics.mean(later),
               "ttft_p50_s": statistics.median(later), "tier_hits": dict(s.tier_hits),
               "outputs_digest": hash(tuple(map(tuple, outputs)))}
        rows.append(row)
        print(f"  {name:6s} TTFT turns 2+: mean {row['ttft_mean_s']*1000:7.1f} ms  p50 {row['ttft_p50_s']*1000:7.1f} ms"
              f"   hits {row['tier_hits']}", flush=True)
    digests = {r["outputs_digest"] for r in rows}
    assert len(digests) == 1, "tiers changed the generated tokens"
    for r in rows:
        del r["outputs_digest"]
    return rows


def preemption(num_reqs: int, prompt_len: int, gen: int, dtype: str = "float32") -> list[dict]:
    rng = random.Random(2)
    prompts = [[rng.randrange(49152) for _ in range(prompt_len)] for _ in range(num_reqs)]
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    # Every prompt fits at admission, their outputs do not: running requests get preempted.
    pool = num_reqs * (prompt_len // BLOCK + 1) + 2
    rows, tokens = [], {}
    for mode in ("recompute", "swap"):
        llm = make_llm({"swap_space": 1.0}, pool, prompt_len + gen + BLOCK, dtype, preemption_mode=mode)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        s = llm.engine.get_stats()
        llm.engine.close()
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        rows.append({"mode": mode, "seconds": elapsed, "preemptions": s.num_preemptions,
                     "swapped": s.num_swapped_preemptions, "fallbacks": s.num_swap_fallbacks,
                     "requests": num_reqs, "dtype": dtype,
                     "prompt_tokens": prompt_len, "output_tokens": gen})
        print(f"  {dtype} {mode:9s} {elapsed:7.2f} s  {num_reqs * gen / elapsed:6.1f} out tok/s  "
              f"preemptions {s.num_preemptions}  swapped {s.num_swapped_preemptions}  "
              f"fallbacks {s.num_swap_fallbacks}", flush=True)
    assert tokens["recompute"] == tokens["swap"], "swap changed the generated tokens"
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--repeats", type=int, default=1, help="restore runs per tier (median reported)")
    ap.add_argument("--out", default=str(HERE / "results" / "tiers.json"))
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    server = None
    redis_url = a.redis_url
    if redis_url is None:
        from redis_server import RedisServer
        server = RedisServer().start()
        redis_url = server.url
    workdir = tempfile.mkdtemp(prefix="kvserve-bench-tiers-")
    tiers_for = lambda tag: {  # noqa: E731 - fresh disk directory per section
        "none": {},
        "host": {"swap_space": 2.0},
        "disk": {"kv_disk_path": f"{workdir}/{tag}", "kv_disk_size": "4GiB"},
        "redis": {"kv_redis_url": redis_url},
    }
    prefix = 512 if a.quick else 2000
    try:
        print(f"1. restore vs recompute, {prefix}-token prefix", flush=True)
        restore = restore_vs_recompute(tiers_for("restore"), prefix, a.repeats)
        print("2. multi-turn TTFT, device pool smaller than the working set", flush=True)
        chats = multi_turn(tiers_for("chat"), num_chats=4 if a.quick else 5, turns=2 if a.quick else 3,
                           first_len=200 if a.quick else 300, pool_blocks=32 if a.quick else 48)
        print("3. preemption: recompute vs swap", flush=True)
        preempt = preemption(num_reqs=4 if a.quick else 6, prompt_len=256, gen=32 if a.quick else 64)
    finally:
        if server is not None:
            server.close()
    result = {"device": "cpu", "threads": torch.get_num_threads(), "restore_vs_recompute": restore,
              "multi_turn": chats, "preemption": preempt}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {a.out}")
    return 0


def print_table(r: dict) -> None:
    print("\n| tier | recompute 2k prefix | TTFT when restored | restore only | speedup |")
    print("|---|---|---|---|---|")
    for row in r["restore_vs_recompute"]:
        restore = "-" if row["restore_s"] is None else f"{row['restore_s']*1000:.0f} ms"
        print(f"| {row['tier']} | {row['recompute_s']*1000:.0f} ms | {row['ttft_again_s']*1000:.0f} ms | "
              f"{restore} | {row['speedup']:.1f}x |")
    print("\n| tiers | mean TTFT (turns 2+) | p50 | prompt tokens by source |")
    print("|---|---|---|---|")
    for row in r["multi_turn"]:
        print(f"| {row['tier']} | {row['ttft_mean_s']*1000:.0f} ms | {row['ttft_p50_s']*1000:.0f} ms | "
              f"{row['tier_hits']} |")
    print("\n| preemption | total time | preemptions | swapped |")
    print("|---|---|---|---|")
    for row in r["preemption"]:
        print(f"| {row['mode']} | {row['seconds']:.2f} s | {row['preemptions']} | {row['swapped']} |")


if __name__ == "__main__":
    sys.exit(main())
