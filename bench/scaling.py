"""kvserve alone: decode throughput vs batch size and vs context length, beside the roofline.

    python bench/compare.py --scaling                          # same as: python bench/scaling.py
    python bench/scaling.py --batch-sizes 1,8,64 --contexts 256,2048 --decode-tokens 16
    python bench/scaling.py --device cuda --model DIR [--enforce-eager]   # a GPU, HBM roofline

On a GPU machine without the embedded model, DIR is a random checkpoint of the same shape
(bench/random_checkpoint.py): speed depends on the shapes, not on the weights' values.

Decode rate is timed inside one run: the engine is stepped directly, the clock for decode starts
once every request of the batch has its first token (prefill over) and stops when the last one
finishes, so decode tok/s = tokens produced after that point / time since (prefix caching off).
Roofline, per decode step (all weights read once, the tied embedding once as lm_head, plus every
sequence's K/V so far; the projections' and lm_head's bytes as the engine holds them: GGUF codes on
AMX CPUs, bf16 elsewhere), with bandwidth and matmul rate measured in this same process:
  memory bound  = batch * BW / (weight_bytes + batch * avg_context * kv_bytes_per_token)
                  ("dense mem": the same with every weight at the model dtype: the roofline)
  compute bound = batch * FLOPS / (2 * params + attention flops per token)
Writes bench/results/scaling.json (scaling_cuda.json on a GPU).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import ModelConfig  # noqa: E402
from kvserve.model.loader import embedded_model_path, model_config_from_hf, resolve_dtype  # noqa: E402
from kvserve.runner.build import resolve_device  # noqa: E402


@dataclass
class MachineRates:
    copy_bandwidth_gb_s: float   # (read + write) bytes / s of a large tensor copy
    matmul_tflop_s: float        # square matmul in the compute dtype


@dataclass
class ScalingPoint:
    sweep: str                   # "batch" | "context"
    batch: int
    prompt_len: int
    decode_tokens: int
    prefill_seconds: float       # until every request had its first token
    total_seconds: float         # prefill + D more tokens each
    decode_tok_per_s: float
    end_to_end_out_tok_per_s: float
    roofline_memory_tok_per_s: float
    roofline_compute_tok_per_s: float
    fraction_of_roofline: float  # decode / min(memory, compute)
    # the memory bound with every weight read at the model dtype (the bf16 roofline), and
    # decode / min(that, compute): equal to the two above unless projections are held as GGUF codes
    roofline_memory_dense_tok_per_s: float
    fraction_of_dense_roofline: float


def _best_time(fn, tries: int, device: torch.device) -> float:
    """Fastest of `tries` calls, waiting for the device each time."""
    fn()  # fault pages in / pick kernels before timing
    best = float("inf")
    for _ in range(tries):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(device: torch.device, mib: int = 512, tries: int = 5) -> float:
    if device.type == "cuda":
        mib, tries = 2048, 20
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), tries, device) / 1e9


def measure_matmul(dtype: torch.dtype, device: torch.device, tries: int = 3) -> float:
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / _best_time(lambda: a @ b, tries, device) / 1e12


def weight_params(c: ModelConfig) -> int:
    """Parameters read per decode step: the (tied) vocab matrix once, every layer, the final norm."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size \
        + 2 * c.hidden_size + ((q + 2 * kv) if c.attention_bias else 0)
    vocab = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return vocab + c.num_hidden_layers * layer + c.hidden_size


def weight_bytes(llm: LLM, c: ModelConfig, elem_bytes: int) -> int:
    """Bytes of weights a decode step reads: each projection's and the lm_head's operand as the
    engine holds it (GGUF codes on AMX CPUs, else packed bf16), else params x element size."""
    model = llm.engine.runner.model
    lins = [lin for L in model.layers for lin in L.projections().values()] + [model.lm_head]
    if any(lin.gemm is None for lin in lins):
        return weight_params(c) * elem_bytes
    in_operands = sum(lin.out_features * lin.in_features for lin in lins)
    return sum(lin.gemm[1].nbytes for lin in lins) + (weight_params(c) - in_operands) * elem_bytes


def roofline(c: ModelConfig, rates: MachineRates, elem_bytes: int, weights: int, batch: int,
             avg_ctx: float) -> tuple[float, float]:
    params = weight_params(c)
    step_bytes = weights + batch * avg_ctx * c.kv_bytes_per_token(elem_bytes)
    memory = batch * rates.copy_bandwidth_gb_s * 1e9 / step_bytes
    attn_flops = 4 * avg_ctx * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    compute = rates.matmul_tflop_s * 1e12 / (2 * params + attn_flops)
    return memory, compute


_ids = itertools.count()


@dataclass
class PhaseTimes:
    prefill_seconds: float   # until every request has its first token
    total_seconds: float
    decode_tokens: int       # tokens produced after the prefill phase


def run_phases(llm: LLM, prompts: list[list[int]], max_tokens: int) -> PhaseTimes:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    counts: dict[str, int] = {}
    for p in prompts:
        rid = f"scaling-{next(_ids)}"
        engine.add_request(rid, p, params)
        counts[rid] = 0
    t = time.perf_counter()
    prefill_end, decode_tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = len(out.outputs[0].token_ids) - counts[out.request_id]
            counts[out.request_id] += produced
            if prefill_end is not None:
                decode_tokens += produced
        if prefill_end is None and all(counts.values()):
            prefill_end = time.perf_counter()
    end = time.perf_counter()
    return PhaseTimes(prefill_end - t, end - t, decode_tokens)


def measure_point(llm, c, rates, elem_bytes, weights, sweep, batch, prompt_len, decode, rng) -> ScalingPoint:
    prompts = [[rng.randrange(c.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    ph = run_phases(llm, prompts, 1 + decode)
    decode_rate = ph.decode_tokens / max(ph.total_seconds - ph.prefill_seconds, 1e-9)
    mem, comp = roofline(c, rates, elem_bytes, weights, batch, prompt_len + 1 + decode / 2)
    dense, _ = roofline(c, rates, elem_bytes, weight_params(c) * elem_bytes, batch, prompt_len + 1 + decode / 2)
    return ScalingPoint(sweep, batch, prompt_len, decode, ph.prefill_seconds, ph.total_seconds, decode_rate,
                        batch * (1 + decode) / ph.total_seconds, mem, comp, decode_rate / min(mem, comp),
                        dense, decode_rate / min(dense, comp))


def ints(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return out


def print_points(points: list[ScalingPoint]) -> None:
    print(f"\n{'sweep':<8} {'batch':>5} {'prompt':>6} {'prefill s':>9} {'decode tok/s':>12} {'e2e out tok/s':>13} "
          f"{'roofline mem':>12} {'roofline flop':>13} {'of roofline':>11} {'dense mem':>9} {'of dense':>8}")
    for p in points:
        print(f"{p.sweep:<8} {p.batch:>5} {p.prompt_len:>6} {p.prefill_seconds:>9.2f} {p.decode_tok_per_s:>12.1f} "
              f"{p.end_to_end_out_tok_per_s:>13.1f} {p.roofline_memory_tok_per_s:>12.1f} "
              f"{p.roofline_compute_tok_per_s:>13.1f} {p.fraction_of_roofline:>10.0%} "
              f"{p.roofline_memory_dense_tok_per_s:>9.1f} {p.fraction_of_dense_roofline:>7.0%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    ap.add_argument("--batch-sizes", type=ints, default=ints("1,8,32,64,128,256"))
    ap.add_argument("--batch-prompt-len", type=int, default=128, help="prompt length for the batch sweep")
    ap.add_argument("--contexts", type=ints, default=ints("256,512,1024,2048,4096,8192"),
                    help="total context (prompt + decoded) at the end of each context-sweep request, batch 1")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's own choice, all cores); 1 on a shared machine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="default: bench/results/scaling.json, or scaling_cuda.json on a GPU")
    args = ap.parse_args(argv)
    if args.decode_tokens < 1:
        ap.error("--decode-tokens must be >= 1")
    short = [ctx for ctx in args.contexts if ctx <= args.decode_tokens + 1]
    if short:
        ap.error(f"--contexts {short} leave no room for a prompt before {args.decode_tokens} decoded tokens; "
                 f"use contexts above {args.decode_tokens + 1} or fewer --decode-tokens")

    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device.type)
    elem = torch.tensor([], dtype=dtype).element_size()
    if args.model:
        c = model_config_from_hf(json.loads((Path(args.model) / "config.json").read_text()), args.model)
    else:
        from kvserve.model.gguf import config_from_gguf, read_gguf
        c = config_from_gguf(read_gguf(embedded_model_path()))
    if args.json is None:
        args.json = ROOT / "bench" / "results" / ("scaling_cuda.json" if device.type == "cuda" else "scaling.json")
    if max(args.contexts) > c.max_position_embeddings:
        ap.error(f"--contexts go up to {max(args.contexts)} but the model's limit is {c.max_position_embeddings}")
    rates = MachineRates(measure_bandwidth(device), measure_matmul(dtype, device))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} thread(s)"
    rng = random.Random(args.seed)
    name = str(dtype).replace("torch.", "")
    points: list[ScalingPoint] = []
    common = dict(dtype=name, enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
                  device=device.type, enforce_eager=args.enforce_eager)
    llm = LLM(args.model, max_model_len=args.batch_prompt_len + 1 + args.decode_tokens,
              max_num_seqs=max(args.batch_sizes), **common)
    weights = weight_bytes(llm, c, elem)
    print(f"{where}; measured: copy bandwidth {rates.copy_bandwidth_gb_s:.1f} GB/s, {dtype} matmul "
          f"{rates.matmul_tflop_s:.2f} TFLOP/s; weights read per step {weights / 1e6:.0f} MB, "
          f"KV {c.kv_bytes_per_token(elem):.0f} B/token", flush=True)
    run_phases(llm, [[1] * 16], 2)  # warm-up
    for b in args.batch_sizes:
        points.append(measure_point(llm, c, rates, elem, weights, "batch", b, args.batch_prompt_len,
                                    args.decode_tokens, rng))
        print_points(points[-1:])
    del llm
    llm = LLM(args.model, max_model_len=max(args.contexts), max_num_seqs=1, **common)
    run_phases(llm, [[1] * 16], 2)
    for ctx in args.contexts:
        points.append(measure_point(llm, c, rates, elem, weights, "context", 1, ctx - 1 - args.decode_tokens,
                                    args.decode_tokens, rng))
        print_points(points[-1:])
    print_points(points)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "dtype": name,
                                     "device": where, "enforce_eager": args.enforce_eager,
                                     "threads": torch.get_num_threads(), "argv": sys.argv[1:] if argv is None else argv,
                                     "rates": asdict(rates), "weight_params": weight_params(c),
                                     "weight_bytes_per_step": weights,
                                     "points": [asdict(p) for p in points]}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
