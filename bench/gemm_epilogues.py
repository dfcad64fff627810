"""The bf16 GEMM's epilogues (model/linear.py): SiLU(gate) * up and the rotary embedding done by the
projection itself, against the product followed by the separate compiled pass.

Kernel level: SmolLM2's 30 layers of gate/up (576 -> 2 x 1,536) and q/k/v (576 -> 960)
projections at decode and prompt sizes, min of --repeat alternating rounds. `--engine WORKLOAD`
also runs that offline workload (bench/throughput.py's) through two engines in one process, one
built with the epilogues and one without, alternating, and checks their greedy outputs agree.

    python bench/gemm_epilogues.py
    python bench/gemm_epilogues.py --engine random --rounds 4
Prints a table and writes bench/results/gemm_epilogues.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from kvserve.model import linear  # noqa: E402
from kvserve.model.fused import ElementwiseOps  # noqa: E402
from kvserve.model.linear import SILU_MUL, Linear, rope_epilogue  # noqa: E402
from kvserve.ops.host_alloc import tune_malloc_for_inference  # noqa: E402

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 30, 576, 1536, 9, 3, 64


def kernel_rows(rows: list[int], repeat: int) -> list[dict]:
    ops = ElementwiseOps(torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(0)
    qkv_out, rope_cols = (HEADS + 2 * KV_HEADS) * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
    gu_w = [(torch.randn(2 * INTER, HIDDEN, generator=g) * 0.05).bfloat16() for _ in range(LAYERS)]
    qkv_w = [(torch.randn(qkv_out, HIDDEN, generator=g) * 0.05).bfloat16() for _ in range(LAYERS)]
    gu_fused, gu_plain = [Linear(w, epilogue=SILU_MUL) for w in gu_w], [Linear(w) for w in gu_w]
    rope = rope_epilogue(HEAD_DIM, rope_cols)
    qkv_fused, qkv_plain = [Linear(w, epilogue=rope) for w in qkv_w], [Linear(w) for w in qkv_w]
    if gu_fused[0].epilogue is None:
        raise SystemExit("no fused epilogues here (no AVX512-BF16, an AMX CPU, or no compiler): nothing to compare")
    out = []
    for m in rows:
        x = torch.randn(m, HIDDEN, generator=g).bfloat16()
        ang = torch.randn(m, HEAD_DIM // 2, generator=g)
        cos = torch.cat((ang.cos(), ang.cos()), -1).bfloat16()[:, None, :]
        sin = torch.cat((-ang.sin(), ang.sin()), -1).bfloat16()[:, None, :]
        heads = HEADS + KV_HEADS
        cases = {
            "gate_up_separate": lambda: [ops.silu_mul(lin(x)) for lin in gu_plain],
            "gate_up_fused": lambda: [lin(x) for lin in gu_fused],
            "qkv_separate": lambda: [ops.rope(lin(x)[:, :rope_cols].view(m, heads, HEAD_DIM), cos, sin)
                                     for lin in qkv_plain],
            "qkv_fused": lambda: [lin(x, cos, sin) for lin in qkv_fused],
        }
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(repeat):
            for name, run in cases.items():
                t = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t)
        out.append({"rows": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()}})
    return out


def engine_ab(workload: str, rounds: int) -> dict:
    from throughput import make_workloads

    from kvserve import LLM, SamplingParams
    prompts, out_len = make_workloads(64, 49152)[workload]
    engines = {}
    order = linear._epilogue_order
    for name in ("fused", "separate"):
        linear._epilogue_order = order if name == "fused" else (lambda epi, n: None)
        try:
            engines[name] = LLM(None, enable_prefix_caching=True)
        finally:
            linear._epilogue_order = order
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:4], warm, use_tqdm=False)
    seconds: dict[str, list[float]] = {n: [] for n in engines}
    tokens = {}
    for r in range(rounds):
        for name in (("fused", "separate") if r % 2 == 0 else ("separate", "fused")):
            llm = engines[name]
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - t)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for a, b in zip(tokens["fused"], tokens["separate"]))
    return {"workload": workload, "seconds": seconds, "identical_outputs": same, "requests": len(prompts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64,2048")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engine", choices=["random", "shared"], help="also A/B this workload end to end")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=str(HERE / "results" / "gemm_epilogues.json"))
    args = ap.parse_args(argv)
    tune_malloc_for_inference()
    result = {"threads": torch.get_num_threads(), "layers": LAYERS,
              "kernel": kernel_rows([int(r) for r in args.rows.split(",")], args.repeat)}
    print(f"SmolLM2's {LAYERS} layers of projections, {result['threads']} threads, min of {args.repeat} (ms)")
    print(f"{'rows':>5} {'gate/up + SiLU pass':>20} {'SiLU epilogue':>14} {'q/k/v + rotary pass':>20} {'rotary epilogue':>16}")
    for r in result["kernel"]:
        print(f"{r['rows']:>5} {r['gate_up_separate_ms']:>20.2f} {r['gate_up_fused_ms']:>14.2f} "
              f"{r['qkv_separate_ms']:>20.2f} {r['qkv_fused_ms']:>16.2f}")
    if args.engine:
        sys.path.insert(0, str(HERE))
        e = result["engine"] = engine_ab(args.engine, args.rounds)
        print(f"\n{e['workload']}, seconds per run (alternating): "
              + "; ".join(f"{k} {', '.join(f'{s:.2f}' for s in v)} (min {min(v):.2f})" for k, v in e["seconds"].items())
              + f"; identical greedy outputs {e['identical_outputs']}/{e['requests']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
