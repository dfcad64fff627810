"""Decode step cost, for A/B comparisons of engine changes on a shared, noisy machine.

    python bench/decode_step.py                         # batch 1, 256 in, 64 out, 1 thread
    python bench/decode_step.py --batch 64 --prompt-len 256 --decode 32
    python bench/decode_step.py --threads 2             # batch-1 decode on both cores

Steps the engine directly. Prefill steps are excluded: the clock starts once every request has its
first token. Reports CPU time per decode step (time.process_time: what the change costs, not what
other tenants of the machine cost) and wall time. Where a step's time goes (model vs bookkeeping,
attention vs linear layers): bench/step_profile.py.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvserve import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, batch: int, prompt_len: int, decode: int, seed: int, tag: str):
    rng = random.Random(seed)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True)
    rids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        engine.add_request(rid, [rng.randrange(49152) for _ in range(prompt_len)], params)
        rids.append(rid)
    counts = dict.fromkeys(rids, 0)
    cpu_steps, wall_steps, tokens = [], [], 0
    decoding = False
    while engine.has_unfinished_requests():
        c0, w0 = time.process_time(), time.perf_counter()
        outs = engine.step()
        c1, w1 = time.process_time(), time.perf_counter()
        produced = 0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            produced += n - counts[out.request_id]
            counts[out.request_id] = n
        if decoding:
            cpu_steps.append(c1 - c0)
            wall_steps.append(w1 - w0)
            tokens += produced
        elif all(counts.values()):
            decoding = True
    return cpu_steps, wall_steps, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default=None, help="write a cProfile of the last repeat here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    llm = LLM(None, dtype=args.dtype, enable_prefix_caching=False, max_model_len=4096,
              max_num_seqs=max(args.batch, 1), kv_cache_memory="2GiB")
    run(llm, 1, 32, 4, 99, "warm")
    for r in range(args.repeats):
        prof = None
        if args.profile and r == args.repeats - 1:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        cpu, wall, tokens = run(llm, args.batch, args.prompt_len, args.decode, r, f"r{r}")
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile)
        n = len(cpu)
        print(f"batch {args.batch} ctx {args.prompt_len} threads {args.threads}: {n} decode steps, "
              f"CPU {1e3 * sum(cpu) / n:.2f} ms/step (median {1e3 * statistics.median(cpu):.2f}), "
              f"wall {1e3 * sum(wall) / n:.2f} ms/step (median {1e3 * statistics.median(wall):.2f}), "
              f"{tokens / sum(wall):.1f} tok/s wall, {tokens / sum(cpu):.1f} tok/CPU-s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
