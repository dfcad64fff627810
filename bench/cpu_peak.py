"""How close the linear layers run to this CPU's arithmetic peak, and what that leaves of the
1.5x-vLLM target.

    python bench/cpu_peak.py
    python bench/cpu_peak.py --threads 1,2 --rows 1,64,2048

Three measurements, all in this process:
1. The instruction peak: a register-resident loop of independent VDPBF16PS (bf16 pairs into
   float32, 64 FLOP each) and of float32 FMAs, compiled with the system g++ (-march=native), per
   thread count. Nothing can run a bf16 GEMM faster than the first figure.
2. The engine's rate on SmolLM2-135M's own projections (qkv, o, gate_up, down, lm_head) through
   `kvserve.model.linear.Linear` (AMX tiles, AVX512-BF16 dot products or oneDNN, whichever this
   CPU gets; the table names it), 30 distinct layers so
   the weights stream from DRAM as in a real step, at prefill (2,048 rows), decode-batch (64) and
   batch-1 row counts.
3. The floor those rates put under the comparison workloads (bench/compare.py): the linear
   layers' FLOPs of `random` and `shared` (prefix cached), divided by the peak and by the
   measured rates, beside the time 1.5x the best vLLM run in bench/results/compare.json allows.

Prints tables and writes bench/results/cpu_peak.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvserve.model.gguf import config_from_gguf, read_gguf  # noqa: E402
from kvserve.model.linear import Linear  # noqa: E402
from kvserve.model.loader import embedded_model_path  # noqa: E402

PEAK_SRC = r"""
#include <immintrin.h>
#include <omp.h>
// 16 independent accumulators: at least latency x throughput of either instruction (12 ran 7 %
// slower for VDPBF16PS here; 32 spill), so the loop is bound by issue rate alone. Returns the
// FLOPs done (64 per VDPBF16PS, 32 per FMA).
extern "C" double bf16_dot_loop(long iters, int threads) {
    double flops = 0;
    #pragma omp parallel num_threads(threads) reduction(+:flops)
    {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
        const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x00010001);
        for (long it = 0; it < iters; ++it) {
            #pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
        }
        __m512 s = a[0];
        for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, a[i]);
        flops += 64.0 * 16 * iters + 0 * _mm512_reduce_add_ps(s);
    }
    return flops;
}
extern "C" double fp32_fma_loop(long iters, int threads) {
    double flops = 0;
    #pragma omp parallel num_threads(threads) reduction(+:flops)
    {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
        const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
        for (long it = 0; it < iters; ++it) {
            #pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
        }
        __m512 s = a[0];
        for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, a[i]);
        flops += 32.0 * 16 * iters + 0 * _mm512_reduce_add_ps(s);
    }
    return flops;
}
"""


def build_peak_library(workdir: Path) -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("g++")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if compiler is None or "avx512_bf16" not in flags:
        return None
    src, lib = workdir / "peak.cpp", workdir / "peak.so"
    src.write_text(PEAK_SRC)
    subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    cdll = ctypes.CDLL(str(lib))
    for fn in (cdll.bf16_dot_loop, cdll.fp32_fma_loop):
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
    return cdll


def instruction_peak(fn, threads: int, seconds: float = 0.4, tries: int = 3) -> float:
    """TFLOP/s, best of `tries` runs of about `seconds` each."""
    iters = 1 << 16
    while True:  # size the loop once
        t = time.perf_counter()
        fn(iters, threads)
        if time.perf_counter() - t > seconds / 4:
            break
        iters *= 2
    best = 0.0
    for _ in range(tries):
        t = time.perf_counter()
        flops = fn(iters, threads)
        best = max(best, flops / (time.perf_counter() - t) / 1e12)
    return best


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv": (cfg.num_attention_heads * cfg.head_dim + 2 * kv, h), "o": (h, cfg.num_attention_heads * cfg.head_dim),
            "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size)}


def onednn_rate(cfg, rows: int, tries: int = 3) -> dict:
    """TFLOP/s of one pass over every layer's four projections (distinct packed weights per layer,
    so they come from DRAM as in a step) at `rows` rows, and of lm_head at the same rows."""
    shapes = projection_shapes(cfg)
    layers = [{name: Linear(torch.randn(o, i, dtype=torch.bfloat16) * 0.02) for name, (o, i) in shapes.items()}
              for _ in range(cfg.num_hidden_layers)]
    lm_head = Linear(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16) * 0.02)
    xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for _, i in shapes.values()}
    layer_flops = 2 * rows * cfg.num_hidden_layers * sum(o * i for o, i in shapes.values())
    head_flops = 2 * rows * cfg.vocab_size * cfg.hidden_size

    def layers_pass():
        for layer in layers:
            for name, (_, i) in shapes.items():
                layer[name](xs[i])

    def head_pass():
        lm_head(xs[cfg.hidden_size])

    out = {}
    for key, fn, flops in (("layers", layers_pass, layer_flops), ("lm_head", head_pass, head_flops)):
        fn()
        best = float("inf")
        for _ in range(tries):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[key] = {"ms": best * 1e3, "tflop_s": flops / best / 1e12}
    return out


def workload_flops(cfg) -> dict[str, dict]:
    """Linear-layer FLOPs of bench/compare.py's `random` and `shared` (prefix cached) workloads,
    from its own generator (64 requests, seed 0): prefill rows run the layers only (logits for
    the last position alone), decode rows the layers and lm_head. With caching, `shared` computes
    the common prefix once and each prompt's own tokens."""
    sys.path.insert(0, str(ROOT / "bench"))
    from compare import make_workloads
    per_tok = 2 * cfg.num_hidden_layers * sum(o * i for o, i in projection_shapes(cfg).values())
    head = 2 * cfg.vocab_size * cfg.hidden_size
    rand, shared = make_workloads(["random", "shared"], 64, cfg.vocab_size, 0)
    common = len(os.path.commonprefix([tuple(p) for p in shared.prompts]))
    work = {"random": {"requests": len(rand.prompts), "prefill_tokens": sum(map(len, rand.prompts)),
                       "out_per_request": rand.max_tokens},
            "shared": {"requests": len(shared.prompts), "out_per_request": shared.max_tokens,
                       "prefill_tokens": common + sum(len(p) - common for p in shared.prompts)}}
    for w in work.values():
        decode_rows = w["requests"] * (w["out_per_request"] - 1)
        w["output_tokens"] = w["requests"] * w["out_per_request"]
        w["prefill_tflop"] = (w["prefill_tokens"] * per_tok + w["requests"] * head) / 1e12
        w["decode_tflop"] = decode_rows * (per_tok + head) / 1e12
    return work


def best_vllm(path: Path) -> dict[str, float]:
    """Best vLLM output tok/s per workload in a compare.py result, {} when there is none."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    out = {}
    for w in data.get("systems", {}).get("vllm", {}).get("workloads", []):
        rates = [r["output_tokens"] / r["seconds"] for r in w.get("runs", []) if r.get("seconds")]
        if rates:
            out[w["name"]] = max(rates)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="thread counts for the peak loops")
    ap.add_argument("--rows", default="1,64,2048", help="row counts for the oneDNN projections")
    ap.add_argument("--compare-json", default=str(ROOT / "bench" / "results" / "compare.json"))
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "cpu_peak.json"))
    args = ap.parse_args(argv)
    threads = sorted({int(t) for t in args.threads.split(",")})
    rows = [int(r) for r in args.rows.split(",")]
    cfg = config_from_gguf(read_gguf(embedded_model_path()))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(["python bench/cpu_peak.py", *sys.argv[1:]]),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "peak": {}, "onednn": {}}

    with tempfile.TemporaryDirectory() as tmp:
        lib = build_peak_library(Path(tmp))
        if lib is None:
            print("no g++ or no AVX512-BF16 on this CPU: instruction peak not measured")
        else:
            print("\nInstruction peak (register-resident loop), TFLOP/s")
            print(f"{'threads':>7} {'bf16 VDPBF16PS':>15} {'fp32 FMA':>9}")
            for t in threads:
                bf16, fp32 = instruction_peak(lib.bf16_dot_loop, t), instruction_peak(lib.fp32_fma_loop, t)
                result["peak"][t] = {"bf16_dot_tflop_s": bf16, "fp32_fma_tflop_s": fp32}
                print(f"{t:>7} {bf16:>15.3f} {fp32:>9.3f}")

    peak = result["peak"].get(torch.get_num_threads(), {}).get("bf16_dot_tflop_s")
    probe = Linear(torch.zeros(64, 64, dtype=torch.bfloat16))
    kernel = ("oneDNN" if probe.gemm is None else
              "AMX tiles" if probe.gemm[0].__name__ == "gemm_bf16_amx" else "AVX512-BF16 dot products")
    result["kernel"] = kernel
    print(f"\nbf16 projections of {cfg.num_hidden_layers} layers (distinct weights) and lm_head through {kernel}, "
          f"{torch.get_num_threads()} threads (\"of peak\": of the VDPBF16PS peak above)")
    print(f"{'rows':>5} {'layers ms':>10} {'TFLOP/s':>8} {'of peak':>8} {'lm_head ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        o = onednn_rate(cfg, r)
        result["onednn"][r] = o
        frac = f"{o['layers']['tflop_s'] / peak:.0%}" if peak else "-"
        print(f"{r:>5} {o['layers']['ms']:>10.1f} {o['layers']['tflop_s']:>8.3f} {frac:>8} "
              f"{o['lm_head']['ms']:>11.2f} {o['lm_head']['tflop_s']:>8.3f}")

    work, vllm = workload_flops(cfg), best_vllm(Path(args.compare_json))
    pre_rate = result["onednn"].get(max(rows), {}).get("layers", {}).get("tflop_s")
    dec_rate = result["onednn"].get(64, {}).get("layers", {}).get("tflop_s")
    print("\nLinear layers alone (no attention, norms or bookkeeping), seconds")
    print(f"{'workload':<8} {'TFLOP':>6} {'at peak':>8} {'measured':>10} {'1.5x vLLM budget':>17}")
    for name, w in work.items():
        total = w["prefill_tflop"] + w["decode_tflop"]
        w["seconds_at_peak"] = total / peak if peak else None
        w["seconds_at_onednn"] = (w["prefill_tflop"] / pre_rate + w["decode_tflop"] / dec_rate
                                  if pre_rate and dec_rate else None)
        w["vllm_best_tok_s"] = vllm.get(name)
        w["budget_for_1_5x_s"] = w["output_tokens"] / (1.5 * vllm[name]) if name in vllm else None
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{name:<8} {total:>6.2f} {fmt(w['seconds_at_peak']):>8} {fmt(w['seconds_at_onednn']):>10} "
              f"{fmt(w['budget_for_1_5x_s']):>17}")
    result["workloads"] = work
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
