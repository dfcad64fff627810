"""Tensor parallelism on this machine: TP=1 against TP=2 (one core per rank) at the embedded model's size.

    python bench/tensor_parallel.py [--out bench/results/tensor_parallel.json] [--decode-batch 8] [--backend mp|ray|both]

--backend ray (or both) runs the TP=2 row with rank 1 a Ray actor: it needs a running cluster whose
workers import this checkout, e.g. `PYTHONPATH=src ray start --head --port 6390 --node-ip-address
127.0.0.1 --num-cpus 2 --include-dashboard=false --disable-usage-stats` and RAY_ADDRESS=127.0.0.1:6390.

The embedded SmolLM2-135M has 9 query / 3 KV heads, which do not split in two, so the model is a
random bf16 checkpoint of its shapes with 8 query / 2 KV heads of 64 (bench/random_checkpoint.py;
a step's cost depends on the shapes, not the values). Rows: TP=1 (the compiled layer loop), TP=1
with the Python layer loop (what each rank runs: the loop has no point to call an all-reduce
from), and TP=2. Columns:
prefill tok/s (4 prompts of 512 tokens, one output token), decode tok/s (a batch of
--decode-batch, 64-token prompts, 128 tokens out, prefill excluded), and for TP=2 the time rank 0
spent in all-reduces per decode step and per call (two per layer). Then the step dispatch: a
pickled SchedulerOutput of the decode batch sent to rank 1 over a pipe, over a TCP
multiprocessing.connection (what a Ray actor is sent on), and by torch.distributed's
broadcast_object_list, per step. Last, bench/throughput.py's standard offline workloads (random and
shared, --workload-requests each, prefix caching on) at TP=1 on one core, on two, and TP=2.
Prints the tables, writes JSON.

    python bench/tensor_parallel.py --gguf [--out bench/results/tensor_parallel_gguf.json]

--gguf: the embedded SmolLM2-135M Q4_1 GGUF itself (TP=3: one of its 3 KV heads a rank), each rank
reading its share of the Q4_1 codes (--quantization gguf) against its dequantized bf16 shard
(--quantization none), at TP=1 and TP=3; the three ranks share the CPUs in turn (0|1|0 on two).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PREFILL_PROMPTS, PREFILL_LEN = 4, 512
DECODE_PROMPT, DECODE_OUT = 64, 128


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def checkpoint(directory: str) -> str:
    """SmolLM2-135M's shapes with heads that split in two, random bf16 weights (made once)."""
    from pathlib import Path

    import random_checkpoint
    d = Path(directory)
    if not (d / "model.safetensors").exists():
        random_checkpoint.write_skeleton(d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(num_attention_heads=8, num_key_value_heads=2, head_dim=64)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        random_checkpoint.write_weights(d, seed=0)
    return str(d)


@contextlib.contextmanager
def _engine(model: str | None, label: str, tp: int, **kw):
    """The LLM a row measures, bf16; a TP=1 "one core" row runs on one core (as one rank of TP=2
    does). The engine is closed and this process's CPUs and threads restored after."""
    import torch

    from kvserve import LLM
    affinity, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if tp == 1 and "one core" in label:
        os.sched_setaffinity(0, affinity[:1])
        torch.set_num_threads(1)
    llm = None
    try:
        llm = LLM(model, dtype="bfloat16", tensor_parallel_size=tp, **kw)
        yield llm
    finally:
        if llm is not None:
            llm.engine.close()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def measure(model: str, label: str, tp: int, decode_batch: int, **kw) -> dict:
    from kvserve import SamplingParams
    with _engine(model, label, tp, kv_cache_memory=256 << 20, max_model_len=1024, enable_prefix_caching=False,
                 max_num_seqs=max(decode_batch, PREFILL_PROMPTS), **kw) as llm:
        eng = llm.engine
        if "Python loop" in label:
            eng.runner.model.use_compiled_decoder = False
        vocab = eng.model_config.vocab_size
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate(_prompts(2, 64, vocab, 99), one, use_tqdm=False)  # warm
        t = time.perf_counter()
        llm.generate(_prompts(PREFILL_PROMPTS, PREFILL_LEN, vocab, 1), one, use_tqdm=False)
        prefill = PREFILL_PROMPTS * PREFILL_LEN / (time.perf_counter() - t)
        # Decode: admit the batch (its prefill and first token), then time the steps that follow.
        params = SamplingParams(temperature=0, max_tokens=DECODE_OUT, ignore_eos=True)
        for i, p in enumerate(_prompts(decode_batch, DECODE_PROMPT, vocab, 2)):
            eng.add_request(f"d{i}", p, params)
        eng.step()
        before = eng.runner.all_reduce_stats() if tp > 1 else None
        steps, t = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        elapsed = time.perf_counter() - t
        row = {"label": label, "tp": tp, "prefill_tok_s": round(prefill, 1),
               "decode_tok_s": round(decode_batch * (DECODE_OUT - 1) / elapsed, 1),
               "decode_step_ms": round(1e3 * elapsed / steps, 2)}
        if before is not None:
            after = eng.runner.all_reduce_stats()
            calls = after[0][0] - before[0][0]
            seconds = after[0][1] - before[0][1]
            row.update(all_reduce_ms_per_step=round(1e3 * seconds / steps, 2),
                       all_reduce_us_per_call=round(1e6 * seconds / calls, 1), all_reduce_calls_per_step=calls // steps,
                       all_reduce_share=round(seconds / elapsed, 3))
        return row


def measure_workloads(model: str, label: str, tp: int, num_requests: int) -> dict:
    """bench/throughput.py's standard offline workloads (random: prompts of 128-512 tokens, 128
    out; shared: a 1,024-token prefix + 32 unique tokens, 32 out), prefix caching on: output tok/s."""
    import throughput
    with _engine(model, label, tp, kv_cache_memory=512 << 20, max_model_len=2048, max_num_seqs=num_requests) as llm:
        workloads = throughput.make_workloads(num_requests, llm.engine.model_config.vocab_size)
        throughput.run_kvserve(llm, workloads["random"][0][:4], 4)  # warm
        row = {"label": label, "tp": tp}
        for name, (prompts, out_len) in workloads.items():
            r = throughput.run_kvserve(llm, prompts, out_len)
            row[f"{name}_out_tok_s"] = round(r["output_tok_per_s"], 1)
            row[f"{name}_seconds"] = round(r["seconds"], 2)
        return row


def _dispatch_rank1(port: int, conn, address, authkey: bytes, iters: int) -> None:
    from multiprocessing.connection import Client

    import torch
    import torch.distributed as dist
    os.sched_setaffinity(0, [1 % os.cpu_count()])
    torch.set_num_threads(1)
    tcp = Client(address, authkey=authkey)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    token = torch.zeros(1)
    for _ in range(iters):  # pipe
        pickle.loads(conn.recv_bytes())
        dist.all_reduce(token)
    for _ in range(iters):  # TCP connection
        pickle.loads(tcp.recv_bytes())
        dist.all_reduce(token)
    for _ in range(iters):  # broadcast_object_list
        box = [None]
        dist.broadcast_object_list(box, src=0)
        dist.all_reduce(token)
    for _ in range(iters):  # the all-reduce alone: subtracted from both
        dist.all_reduce(token)
    dist.destroy_process_group()


def measure_dispatch(decode_batch: int, iters: int = 300) -> dict:
    """Per step, what handing rank 1 the step costs rank 0, each way: send, then one tiny
    all-reduce (the step's first collective, where rank 1 must have it), less that all-reduce alone."""
    import multiprocessing as mp

    import torch
    import torch.distributed as dist

    from kvserve.core.request import Request
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.core.step import ScheduledRequest, SchedulerOutput
    from kvserve.runner.distributed import free_port
    reqs = [Request(f"r{i}", list(range(DECODE_PROMPT + 64)), SamplingParams(max_tokens=DECODE_OUT))
            for i in range(decode_batch)]
    out = SchedulerOutput([ScheduledRequest(r, DECODE_PROMPT + 63, 1, list(range(9)), True) for r in reqs])
    size = len(pickle.dumps(("execute", (out,)), protocol=pickle.HIGHEST_PROTOCOL))
    from multiprocessing.connection import Listener
    port = free_port()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    authkey = os.urandom(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    proc = ctx.Process(target=_dispatch_rank1, args=(port, theirs, listener.address, authkey, iters), daemon=True)
    proc.start()
    tcp = listener.accept()
    os.sched_setaffinity(0, [0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    token = torch.zeros(1)
    times = {}
    t = time.perf_counter()
    for _ in range(iters):
        mine.send_bytes(pickle.dumps(("execute", (out,)), protocol=pickle.HIGHEST_PROTOCOL))
        dist.all_reduce(token)
    times["pipe"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(iters):
        tcp.send_bytes(pickle.dumps(("execute", (out,)), protocol=pickle.HIGHEST_PROTOCOL))
        dist.all_reduce(token)
    times["tcp"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(iters):
        dist.broadcast_object_list([("execute", (out,))], src=0)
        dist.all_reduce(token)
    times["broadcast"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(token)
    times["base"] = time.perf_counter() - t
    dist.destroy_process_group()
    proc.join(30)
    tcp.close()
    listener.close()
    base = times["base"] / iters
    return {"pickled_bytes": size, "pipe_us_per_step": round(1e6 * (times["pipe"] / iters - base), 1),
            "tcp_connection_us_per_step": round(1e6 * (times["tcp"] / iters - base), 1),
            "broadcast_object_list_us_per_step": round(1e6 * (times["broadcast"] / iters - base), 1),
            "tiny_all_reduce_us": round(1e6 * base, 1)}


def _shared_cpus(ranks: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


def main_gguf(args) -> None:
    """Codes against bf16 shards on the embedded model (module docstring)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _shared_cpus(3)
    rows = [measure(None, f"TP={tp}, {what}", tp, args.decode_batch, quantization=q)
            for tp in (1, 3) for what, q in (("Q4_1 codes", "gguf"), ("bf16 shards" if tp > 1 else "bf16", "none"))]
    print(f"{'configuration':24} {'prefill tok/s':>13} {'decode tok/s':>12} {'step ms':>8} {'all-reduce ms/step':>18}")
    for r in rows:
        print(f"{r['label']:24} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.1f} {r['decode_step_ms']:8.2f} "
              f"{r.get('all_reduce_ms_per_step', float('nan')):18.2f}")
    result = {"machine": platform.processor() or platform.machine(), "cpus": sorted(os.sched_getaffinity(0)),
              "binding": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "decode_batch": args.decode_batch, "rows": rows}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tensor_parallel_gguf.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/tensor_parallel.json, "
                                                "tensor_parallel_gguf.json with --gguf)")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench-tp-checkpoint")
    ap.add_argument("--workload-requests", type=int, default=16,
                    help="requests per standard workload (bench/throughput.py's random and shared); 0 skips them")
    ap.add_argument("--backend", choices=("mp", "ray", "both"), default="mp",
                    help="--distributed-executor-backend of the TP=2 row (ray: a cluster must be running)")
    ap.add_argument("--gguf", action="store_true", help="the embedded GGUF model: Q4_1 codes against bf16 shards")
    args = ap.parse_args()
    if args.gguf:
        return main_gguf(args)
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tensor_parallel.json")
    affinity = sorted(os.sched_getaffinity(0))
    dispatch = measure_dispatch(args.decode_batch)
    os.sched_setaffinity(0, affinity)
    model = checkpoint(args.model_dir)
    rows = [measure(model, "TP=1, one core", 1, args.decode_batch),
            measure(model, "TP=1, one core, Python loop", 1, args.decode_batch),
            measure(model, "TP=1, two cores", 1, args.decode_batch),
            *[measure(model, f"TP=2, one core per rank, {b}", 2, args.decode_batch, distributed_executor_backend=b)
              for b in (("mp", "ray") if args.backend == "both" else (args.backend,))]]
    print(f"{'configuration':44} {'prefill tok/s':>13} {'decode tok/s':>12} {'step ms':>8} "
          f"{'all-reduce ms/step':>18} {'us/call':>8} {'share':>6}")
    for r in rows:
        print(f"{r['label']:44} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.1f} {r['decode_step_ms']:8.2f} "
              f"{r.get('all_reduce_ms_per_step', float('nan')):18.2f} {r.get('all_reduce_us_per_call', float('nan')):8.1f} "
              f"{r.get('all_reduce_share', float('nan')):6.3f}")
    print(f"step dispatch ({dispatch['pickled_bytes']} pickled bytes, decode batch {args.decode_batch}): pipe "
          f"{dispatch['pipe_us_per_step']} us, TCP connection {dispatch['tcp_connection_us_per_step']} us, "
          f"broadcast_object_list {dispatch['broadcast_object_list_us_per_step']} us "
          f"per step (a 1-element all-reduce alone: {dispatch['tiny_all_reduce_us']} us)")
    loads = []
    if args.workload_requests:
        loads = [measure_workloads(model, label, tp, args.workload_requests)
                 for label, tp in (("TP=1, one core", 1), ("TP=1, two cores", 1), ("TP=2, one core per rank", 2))]
        print(f"\nstandard workloads, {args.workload_requests} requests each, prefix caching on (output tok/s):")
        print(f"{'configuration':44} {'random':>8} {'shared':>8}")
        for r in loads:
            print(f"{r['label']:44} {r['random_out_tok_s']:8.1f} {r['shared_out_tok_s']:8.1f}")
    result = {"machine": platform.processor() or platform.machine(), "cpus": affinity,
              "decode_batch": args.decode_batch, "backend": args.backend, "rows": rows, "dispatch": dispatch,
              "workloads": loads}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
