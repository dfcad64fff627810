"""Offline throughput: kvserve (prefix caching on and off) vs transformers' generate, same run.

Workloads (token-id prompts, greedy, ignore_eos):
  random  64 requests, prompts 128-512 tokens, 128 output tokens
  shared  64 requests sharing a 1024-token prefix + 32 unique tokens, 32 output tokens
transformers runs static batches of 16 (left-padded) with the same weights and dtype.

    python bench/throughput.py                       # full run, embedded SmolLM2, dtype auto
    python bench/throughput.py --num-requests 16 --skip-hf   # quicker look
    python bench/throughput.py --skip-hf --workloads random --kv-cache-dtype int8   # quantized KV
    python bench/throughput.py --device cuda --model DIR [--enforce-eager]   # a GPU (DIR: an HF
                                         # checkpoint, e.g. bench/random_checkpoint.py's)
Prints a table and writes bench/results/throughput.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.loader import hf_config_dict, load_model, resolve_dtype  # noqa: E402
from kvserve.runner.build import resolve_device  # noqa: E402


def make_workloads(n: int, vocab: int, seed: int = 0) -> dict[str, tuple[list[list[int]], int]]:
    rng = random.Random(seed)
    rand = [[rng.randrange(vocab) for _ in range(rng.randint(128, 512))] for _ in range(n)]
    prefix = [rng.randrange(vocab) for _ in range(1024)]
    shared = [prefix + [rng.randrange(vocab) for _ in range(32)] for _ in range(n)]
    return {"random": (rand, 128), "shared": (shared, 32)}


def run_kvserve(llm: LLM, prompts, out_len) -> dict:
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"seconds": dt, "output_tokens": gen, "output_tok_per_s": gen / dt,
            "total_tok_per_s": (gen + prompt_tokens) / dt, "cached_prompt_tokens": cached,
            "preemptions": llm.engine.scheduler.num_preemptions}


def hf_model(dtype: torch.dtype, model: str | None = None, device: str = "cpu"):
    import transformers
    if model is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    loaded = load_model(None, dtype=torch.float32)
    cfg = transformers.LlamaConfig(**hf_config_dict(loaded.config))
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(loaded.weights, strict=False)
    model.tie_weights()
    return model.to(dtype).to(device).eval()


@torch.no_grad()
def run_hf(model, prompts, out_len, batch=16, pad_id=0) -> dict:
    t = time.perf_counter()
    gen = 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=out_len,
                             min_new_tokens=out_len, pad_token_id=pad_id)
        gen += (out.shape[1] - width) * len(chunk)
    dt = time.perf_counter() - t
    prompt_tokens = sum(len(p) for p in prompts)
    return {"seconds": dt, "output_tokens": gen, "output_tok_per_s": gen / dt,
            "total_tok_per_s": (gen + prompt_tokens) / dt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="kvserve's KV cache dtype (auto, fp8, int8, int4)")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--workloads", default="random,shared")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    ap.add_argument("--json", default="bench/results/throughput.json")
    args = ap.parse_args(argv)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device.type)
    results: dict = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                 "torch": torch.__version__, "threads": torch.get_num_threads(),
                                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
                     "dtype": str(dtype).replace("torch.", ""), "num_requests": args.num_requests,
                     "kv_cache_dtype": args.kv_cache_dtype, "workloads": {}}
    common = dict(dtype=results["dtype"], kv_cache_memory=args.kv_cache_memory, max_model_len=2048,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_dtype=args.kv_cache_dtype, device=device.type, enforce_eager=args.enforce_eager)
    workloads = make_workloads(args.num_requests, 49152)
    wanted = args.workloads.split(",")
    rows = []
    for caching in (True, False):
        llm = LLM(args.model, enable_prefix_caching=caching, **common)
        run_kvserve(llm, workloads["random"][0][:4], 4)  # warm-up (allocator, kernels)
        for name in wanted:
            prompts, out_len = workloads[name]
            if device.type == "cuda":  # first use JIT-compiles the Triton kernels' variants
                first = run_kvserve(llm, prompts, out_len)["seconds"]
                print(f"{name}: first (untimed) pass {first:.2f} s")
            r = run_kvserve(llm, prompts, out_len)
            key = f"kvserve prefix-caching {'on' if caching else 'off'}"
            results["workloads"].setdefault(name, {})[key] = r
            rows.append((name, key, r))
        del llm
    if not args.skip_hf:
        model = hf_model(dtype, args.model, device.type)
        for name in wanted:
            prompts, out_len = workloads[name]
            r = run_hf(model, prompts, out_len)
            results["workloads"][name]["transformers generate (batch 16)"] = r
            rows.append((name, "transformers generate (batch 16)", r))

    print(f"\nOffline throughput, {args.num_requests} requests, dtype {results['dtype']}, "
          f"kv cache {args.kv_cache_dtype}, "
          f"{results['machine']['device'] if device.type == 'cuda' else f'{os.cpu_count()} CPUs'}, "
          f"{'decode graphs off, ' if args.enforce_eager and device.type == 'cuda' else ''}torch {torch.__version__}")
    print(f"{'workload':<8} {'system':<36} {'seconds':>8} {'out tok/s':>10} {'cached tok':>10} {'vs HF':>7}")
    for name, key, r in rows:
        hf = results["workloads"][name].get("transformers generate (batch 16)")
        ratio = f"{r['output_tok_per_s'] / hf['output_tok_per_s']:.2f}x" if hf else "-"
        print(f"{name:<8} {key:<36} {r['seconds']:>8.1f} {r['output_tok_per_s']:>10.1f} "
              f"{r.get('cached_prompt_tokens', 0):>10} {ratio:>7}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
