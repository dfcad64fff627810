"""The offload tiers under two tenants: does the premium prefix survive below the device, and what
does writing down the free tier's blocks cost?

    python bench/tier_retention.py [--rounds 6] [--burst 4] [--host-blocks 160] [--disk-blocks 320]

Torch-free: the scheduler and KV manager run with the cost-model runner; each block the device
pool evicts is written, as a payload of the real size of one SmolLM2-135M bf16 block (16 tokens
x 30 layers x K,V x 3 heads x 64 x 2 bytes = 368,640 bytes), into a real host tier and, through
the AsyncWriter, a real disk tier in a temp directory. Premium: a 1,500-token system prompt plus
a unique question, one request per round; free: a burst of unique 1,000-token prompts per round,
running together, so the device pool (--device-blocks) cannot keep the premium prefix even at a
higher priority. Three configurations:
  lru          no request gives a retention (the tiers order by recency only);
  priority     premium at priority 90, free at 10, --kv-offload-min-priority 0;
  priority+gate  the same with --kv-offload-min-priority 50: free blocks are dropped, not written.
Per configuration: premium's prefix hit rate (tokens from the device or a tier / prompt tokens,
first round excluded), blocks put into host and disk, bytes written to disk, and the engine
thread's host-put time. Prints a table; writes bench/results/tier_retention.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from kvserve.config import SchedulerConfig  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.kv.manager import KVCacheManager  # noqa: E402
from kvserve.kv.tiers import AsyncWriter, DiskTier, EngineFingerprint, HostTier  # noqa: E402
from kvserve.kv.tiers.base import frame_size  # noqa: E402
from kvserve.kv.tiers.chain import TierChain  # noqa: E402
from kvserve.kv.tiers.order import Retention  # noqa: E402
from kvserve.sched.scheduler import Scheduler  # noqa: E402
from kvserve.tools.cost_model import CostModelRunner  # noqa: E402

BS = 16
BLOCK_BYTES = BS * 30 * 2 * 3 * 64 * 2
FP = EngineFingerprint(model="bench", kv_cache_dtype="bfloat16", block_size=BS, num_layers=30, num_kv_heads=3,
                       head_dim=64)
CONFIGS = {"lru": (None, None, 0), "priority": (90, 10, 0), "priority+gate": (90, 10, 50)}


class Transfer:
    """What the runner's KVOffloader does with an evicted block, minus the device read."""

    def __init__(self, chain: TierChain) -> None:
        self.chain = chain
        self.host_seconds = 0.0
        self.payload = bytearray(BLOCK_BYTES)
        chain.decode = lambda p: (tuple(int.from_bytes(p[i:i + 4], "little") for i in range(0, 4 * BS, 4)), p)

    def apply(self, out) -> None:
        for o in out.kv_offloads:
            payload = bytearray(self.payload)
            payload[:4 * BS] = b"".join(t.to_bytes(4, "little") for t in o.token_ids)
            retention = Retention(o.priority, o.expires)
            t0 = time.perf_counter()
            if not self.chain.host.contains(o.key):
                self.chain.host.put(o.key, payload, o.token_ids, retention)
                self.chain.writer.submit(o.key, payload, o.token_ids, retention)
            else:
                self.chain.host.retain(o.key, retention)
            self.host_seconds += time.perf_counter() - t0


def run_config(name: str, args, tmp: str) -> dict:
    hi, lo, gate = CONFIGS[name]
    rng = random.Random(args.seed)
    host = HostTier(FP, args.host_blocks * frame_size(b"k" * 32, BLOCK_BYTES))
    disk = DiskTier(FP, os.path.join(tmp, name), args.disk_blocks * frame_size(b"k" * 32, BLOCK_BYTES))
    writer = AsyncWriter([disk])
    chain = TierChain(host, [disk], writer)
    kv = KVCacheManager(args.device_blocks, BS, enable_caching=True, tiers=chain, offload_min_priority=gate)
    sched = Scheduler(SchedulerConfig(max_num_seqs=args.burst + 1, max_num_batched_tokens=2048,
                                      max_model_len=4096), kv)
    runner, transfer = CostModelRunner(vocab_size=49152), Transfer(chain)
    system = [rng.randrange(1000, 49000) for _ in range(1500)]
    hit_tokens = prompt_tokens = 0
    start = time.perf_counter()
    for r in range(args.rounds):
        ret = lambda p: None if p is None else {"priority": p}  # noqa: E731
        prem = Request(f"p{r}", system + [rng.randrange(1000, 49000) for _ in range(20)],
                       SamplingParams(max_tokens=4, ignore_eos=True, cache_retention=ret(hi)))
        burst = [Request(f"f{r}.{i}", [rng.randrange(1000, 49000) for _ in range(1000)],
                         SamplingParams(max_tokens=4, ignore_eos=True, cache_retention=ret(lo)))
                 for i in range(args.burst)]
        for group in ([prem], burst):
            for req in group:
                sched.add_request(req)
            while sched.has_unfinished_requests():
                step(sched, runner, transfer)
            writer.flush(30)
        if r:
            hit_tokens += prem.num_cached_tokens
            prompt_tokens += len(system)
    wall = time.perf_counter() - start
    writer.flush(30)
    out = {
        "config": name, "premium_hit_rate": hit_tokens / prompt_tokens,
        "restored_blocks": dict(chain.stats.restored_blocks),
        "host_puts": host.stats().puts, "host_evictions": host.stats().evictions,
        "disk_puts": disk.stats().puts, "disk_bytes_written": disk.stats().bytes_written,
        "disk_write_seconds": round(disk.stats().write_seconds, 3),
        "not_written_below_priority": chain.stats.offload_below_priority,
        "host_put_seconds": round(transfer.host_seconds, 3), "wall_seconds": round(wall, 2),
    }
    chain.close()
    return out


def step(sched, runner, transfer) -> None:
    out = sched.schedule()
    transfer.apply(out)
    sched.update_from_output(out, runner.execute(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--burst", type=int, default=4, help="free prompts per round, running together")
    p.add_argument("--device-blocks", type=int, default=240)
    p.add_argument("--host-blocks", type=int, default=160)
    p.add_argument("--disk-blocks", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_config(name, args, tmp) for name in CONFIGS]
    print(f"device {args.device_blocks} blocks, host {args.host_blocks}, disk {args.disk_blocks} "
          f"(blocks of {BLOCK_BYTES:,} bytes); {args.rounds} rounds of 1 premium + {args.burst} free")
    print(f"{'config':<15}{'premium hit':>12}{'restored h/d':>14}{'host puts':>11}{'disk puts':>11}"
          f"{'disk MiB':>10}{'dropped':>9}{'host put s':>12}")
    for r in rows:
        rb = r["restored_blocks"]
        print(f"{r['config']:<15}{r['premium_hit_rate']:>12.3f}{rb.get('host', 0):>7}/{rb.get('disk', 0):<6}"
              f"{r['host_puts']:>11}{r['disk_puts']:>11}{r['disk_bytes_written'] / 2**20:>10.0f}"
              f"{r['not_written_below_priority']:>9}{r['host_put_seconds']:>12.3f}")
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tier_retention.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "machine": platform.processor() or platform.machine(), "rows": rows}, f,
                  indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
