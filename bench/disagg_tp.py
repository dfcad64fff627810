"""Disaggregated decode at TP=2: a decode server's time to first token when it loads the prefill
server's KV from Redis, against computing the prompt itself (what it does when the KV is refused
or gone).

    python bench/disagg_tp.py [--out bench/results/disagg_tp.json] [--prompt-len 1024] [--prompts 3]

One in-process engine at TP=2 (one core per rank), kv_both on a redis-server this script starts on
127.0.0.1, SmolLM2-135M's shapes with 8 query / 2 KV heads (bench/tensor_parallel.py's random bf16
checkpoint: its 9 / 3 heads do not split in two). Per prompt: computed (no kv_transfer_params,
prefix cache empty: TTFT of the whole prefill at TP=2); exported (do_remote_decode, one token: the
prefill plus the write of every rank's heads of each full block to Redis); loaded
(do_remote_prefill after the pool's copy is dropped: the threaded Redis read, the restore into
both ranks and the last block's compute). TTFT is add_request to the first token out, one token
asked. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _redis() -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvserve-bench-redis-")
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             workdir, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0", workdir
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start within 20 s")


def _ttft(engine, rid: str, prompt: list[int], **transfer) -> tuple[float, list[int], int]:
    from kvserve import SamplingParams
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                    kv_transfer_params=transfer or None))
    deadline = start + 120
    while time.perf_counter() < deadline:
        for out in engine.step():
            if out.finished:
                return time.perf_counter() - start, list(out.outputs[0].token_ids), out.num_cached_tokens
    raise RuntimeError(f"request {rid} did not finish within 120 s")


def main() -> None:
    import tensor_parallel
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "disagg_tp.json"))
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench-tp-checkpoint")
    args = ap.parse_args()
    from kvserve import LLM
    model = tensor_parallel.checkpoint(args.model_dir)
    proc, url, workdir = _redis()
    try:
        engine = LLM(model, dtype="bfloat16", tensor_parallel_size=args.tp, max_model_len=args.prompt_len + 64,
                     kv_cache_memory=256 << 20, kv_redis_url=url,
                     kv_transfer_config={"kv_connector": "RedisConnector", "kv_role": "kv_both"}).llm_engine
        try:
            vocab = engine.model_config.vocab_size
            prompts = tensor_parallel._prompts(args.prompts + 1, args.prompt_len, vocab, seed=3)
            _ttft(engine, "warm", prompts.pop())  # first-call costs out of the figures
            rows = []
            for i, prompt in enumerate(prompts):
                engine.reset_prefix_cache()
                computed, want, _ = _ttft(engine, f"computed{i}", prompt)
                engine.reset_prefix_cache()
                exported, _, _ = _ttft(engine, f"exported{i}", prompt, do_remote_decode=True)
                engine.reset_prefix_cache()  # the decode side has only Redis's copy
                loaded, got, cached = _ttft(engine, f"loaded{i}", prompt, do_remote_prefill=True)
                assert got == want, (got, want)
                rows.append({"computed_s": computed, "exported_s": exported, "loaded_s": loaded,
                             "loaded_tokens": cached})
        finally:
            engine.close()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("computed_s", "exported_s", "loaded_s")}
    print(f"TP={args.tp}, {args.prompts} prompts of {args.prompt_len} tokens, bf16, SmolLM2-135M shapes (8/2 heads)")
    print(f"{'':28} {'median ms':>10}   per prompt (ms)")
    for k, label in (("computed_s", "TTFT, prompt computed"), ("exported_s", "prefill + export to Redis"),
                     ("loaded_s", "TTFT, KV loaded from Redis")):
        print(f"{label:28} {med[k] * 1e3:10.1f}   " + " ".join(f"{r[k] * 1e3:.1f}" for r in rows))
    print(f"loaded tokens per prompt: {rows[0]['loaded_tokens']}; loaded / computed TTFT: "
          f"{med['loaded_s'] / med['computed_s']:.2f}")
    result = {"machine": platform.processor() or platform.machine(), "cpus": sorted(os.sched_getaffinity(0)),
              "tp": args.tp, "prompt_len": args.prompt_len, "rows": rows, "median": med}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
