"""Multi-LoRA throughput: 64 requests over 8 adapters of rank 16 on all seven projections, against
the same workload on the base model alone (target: >= 80 %), offline, on the embedded
SmolLM2-135M-Instruct (bf16). With --vllm, vLLM's CPU backend (/work/venvs/vllm) runs the same
workload with its LoRA support, in its own process.

    python bench/lora.py                     # kvserve: base vs 8 adapters
    python bench/lora.py --vllm              # and vLLM's CPU backend side by side

Random prompts (--prompt-len tokens, fixed seed), --max-tokens greedy output tokens each
(ignore_eos), all submitted at once; each configuration runs once to warm up and then
--repeats times, the best kept. Adapters are random PEFT directories (lora_A and lora_B drawn
at a scale that changes the output) written to a temporary folder. Prints a table; writes
bench/results/lora.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF_EXPORT = "/work/venvs/smollm2-hf-bfloat16"
VLLM_PYTHON = "/work/venvs/vllm/bin/python"


def write_adapters(directory: Path, n: int, rank: int, seed: int = 0) -> list[str]:
    """n random PEFT adapters of SmolLM2 (rank `rank`, all seven projections)."""
    import torch
    from safetensors.torch import save_file
    q, kv, h, i, layers = 576, 192, 576, 1536, 30
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i)}
    paths = []
    for a in range(n):
        gen = torch.Generator().manual_seed(seed + a)
        tensors = {}
        for layer in range(layers):
            for m, (n_out, n_in) in shapes.items():
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in ** 0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.02).bfloat16()
        d = directory / f"adapter{a}"
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
            "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": HF_EXPORT, "task_type": "CAUSAL_LM"}))
        paths.append(str(d))
    return paths


def prompts_for(n: int, length: int, seed: int = 1) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def run_kvserve(args, adapters: list[str]) -> list[dict]:
    sys.path.insert(0, str(ROOT / "src"))
    from kvserve import LLM, LoRARequest, SamplingParams
    llm = LLM(dtype="bfloat16", enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
              max_num_seqs=args.requests, enable_prefix_caching=False, lora_dtype=args.lora_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = prompts_for(args.requests, args.prompt_len)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    rows = []
    for label, lora in (("base", None), (f"{len(adapters)} adapters", [loras[i % len(loras)]
                                                                        for i in range(args.requests)])):
        best = None
        for _ in range(args.repeats + 1):  # the first run warms up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            wall = time.perf_counter() - start
            best = wall if best is None else min(best, wall)
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"engine": "kvserve", "workload": label, "seconds": best,
                     "output_tok_s": out_tokens / best,
                     "total_tok_s": (out_tokens + args.requests * args.prompt_len) / best})
    return rows


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="bfloat16", enable_lora=True, max_loras=len(args["adapters"]),
          max_lora_rank=args["rank"], max_num_seqs=args["requests"], enable_prefix_caching=False,
          max_model_len=2048)
params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(args["adapters"])]
rows = []
for label, lora in (("base", None), (f"{len(loras)} adapters", [loras[i % len(loras)] for i in range(len(prompts))])):
    best = None
    for _ in range(args["repeats"] + 1):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        wall = time.perf_counter() - start
        best = wall if best is None else min(best, wall)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append({"engine": "vllm", "workload": label, "seconds": best, "output_tok_s": n / best,
                 "total_tok_s": (n + len(prompts) * len(args["prompts"][0])) / best})
print("ROWS" + json.dumps(rows))
"""


def run_vllm(args, adapters: list[str]) -> list[dict] | str:
    if not os.path.exists(VLLM_PYTHON):
        return f"{VLLM_PYTHON} not found"
    payload = json.dumps({"model": HF_EXPORT, "adapters": adapters, "rank": args.rank, "requests": args.requests,
                          "max_tokens": args.max_tokens, "repeats": args.repeats,
                          "prompts": prompts_for(args.requests, args.prompt_len)})
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": ""}
    proc = subprocess.run([VLLM_PYTHON, "-c", VLLM_SCRIPT, payload], capture_output=True, text=True,
                          env=env, timeout=args.vllm_timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS"):
            return json.loads(line[4:])
    return f"vLLM failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lora-dtype", default="auto", help="kvserve's --lora-dtype")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU backend")
    ap.add_argument("--vllm-timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = write_adapters(Path(tmp), args.adapters, args.rank)
        rows = run_kvserve(args, adapters)
        vllm = run_vllm(args, adapters) if args.vllm else None
    if isinstance(vllm, list):
        rows += vllm
    print(f"{args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} output tokens; "
          f"{args.adapters} adapters of rank {args.rank} on {', '.join(TARGETS)}; {platform.processor() or ''} "
          f"{os.cpu_count()} CPUs")
    print(f"{'engine':8} {'workload':12} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12} {'vs base':>8}")
    base = {r["engine"]: r["output_tok_s"] for r in rows if r["workload"] == "base"}
    for r in rows:
        r["vs_base"] = r["output_tok_s"] / base[r["engine"]]
        print(f"{r['engine']:8} {r['workload']:12} {r['seconds']:8.2f} {r['output_tok_s']:10.1f} "
              f"{r['total_tok_s']:12.1f} {r['vs_base']:8.1%}")
    lora_rows = {r["engine"]: r for r in rows if r["workload"] != "base"}
    if "vllm" in lora_rows:
        print(f"kvserve / vLLM with adapters: {lora_rows['kvserve']['output_tok_s'] / lora_rows['vllm']['output_tok_s']:.2f}x")
    elif vllm is not None:
        print(f"vLLM: {vllm}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows,
                                          "vllm_error": vllm if isinstance(vllm, str) else None}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
