"""GGUF codes against bf16 weights in the AMX projections (model/weight_codes.py, csrc/weight_tiles.h).

Kernel level: the embedded SmolLM2's 30 layers of projections (q/k/v with its rotary epilogue, o,
gate/up with SiLU, down) and its lm_head, built as the engine builds them, once over the packed
bf16 weights (`--quantization none`) and once over the GGUF codes (Q4_1 layers, Q8_0 lm_head: the
default, at every row count), at several row counts.
Every round first streams 512 MB through the caches, so the weights come from DRAM as in a decode
step; min of --repeat rounds, the two forms alternating. The outputs of the two forms are checked
bit-equal at every size.

    python bench/weight_codes.py
    python bench/weight_codes.py --rows 1 64 256 512 2048 --repeat 7
Prints a table and writes bench/results/weight_codes.json. Needs a CPU with AMX.
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

from kvserve.model.llama import LlamaModel  # noqa: E402
from kvserve.model.loader import load_model  # noqa: E402
from kvserve.ops import cpu_kernels as cpu_kernel  # noqa: E402
from kvserve.ops.host_alloc import tune_malloc_for_inference  # noqa: E402


def projections(model: LlamaModel):
    """(name, Linear, input width, needs rotary tables) of every projection, in the order a step runs them."""
    c = model.config
    q = c.num_attention_heads * c.head_dim
    for L in model.layers:
        yield "qkv", L.qkv_proj, c.hidden_size, True
        yield "o", L.o_proj, q, False
        yield "gate_up", L.gate_up_proj, c.hidden_size, False
        yield "down", L.down_proj, L.gate_up_proj.out_features // 2, False


def run(model: LlamaModel, rows: int, junk: torch.Tensor) -> tuple[float, float, list[torch.Tensor]]:
    """(layers s, lm_head s, outputs) of one model's projections."""
    g = torch.Generator().manual_seed(rows)
    c = model.config
    cos, sin = model.rope_cos_sin(torch.randint(0, 4096, (rows,), generator=g))
    cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
    inputs = {w: torch.randn(rows, w, generator=g).bfloat16() for w in (c.hidden_size, 576, 1536)}
    outs = []
    junk.add_(1)
    t0 = time.perf_counter()
    for _, lin, width, rope in projections(model):
        outs.append(lin(inputs[width], cos, sin) if rope else lin(inputs[width]))
    t1 = time.perf_counter()
    outs.append(model.lm_head(inputs[c.hidden_size]))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 512, 2048])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "weight_codes.json"))
    args = ap.parse_args()
    if cpu_kernel.gemm_codes_kernel("Q4_1") is None:
        sys.exit("the codes kernels need a CPU with AMX (and a C++ compiler); nothing to measure here")
    tune_malloc_for_inference()
    loaded = load_model(None, torch.bfloat16)
    models = {codes: LlamaModel(loaded.config, loaded.weights, torch.bfloat16,
                                weight_codes=loaded.codes if codes else None) for codes in (False, True)}
    assert all(lin.codes for _, lin, _, _ in projections(models[True])) and models[True].lm_head.codes
    code_bytes = sum(lin.gemm[1].numel() for _, lin, _, _ in projections(models[True]))
    dense_bytes = sum(lin.gemm[1].numel() * 2 for _, lin, _, _ in projections(models[False]))
    junk = torch.zeros(512 << 20, dtype=torch.uint8)
    results = []
    for rows in args.rows:
        best = {False: [1e9, 1e9], True: [1e9, 1e9]}
        for _ in range(args.repeat):
            outs = {}
            for codes in (False, True):
                layers_s, head_s, outs[codes] = run(models[codes], rows, junk)
                best[codes] = [min(best[codes][0], layers_s), min(best[codes][1], head_s)]
            if not all(torch.equal(a, b) for a, b in zip(outs[False], outs[True])):
                sys.exit(f"codes and bf16 outputs differ at {rows} rows")
        results.append({"rows": rows, "bf16_layers_ms": best[False][0] * 1e3, "codes_layers_ms": best[True][0] * 1e3,
                        "bf16_lm_head_ms": best[False][1] * 1e3, "codes_lm_head_ms": best[True][1] * 1e3})
    print(f"SmolLM2-135M projections, 30 layers: bf16 {dense_bytes / 1e6:.0f} MB, codes {code_bytes / 1e6:.0f} MB; "
          f"min of {args.repeat}, weights from DRAM, outputs bit-equal")
    print(f"{'rows':>6} {'bf16 ms':>9} {'codes ms':>9} {'ratio':>6} | {'lm_head bf16':>12} {'codes':>7}")
    for r in results:
        print(f"{r['rows']:>6} {r['bf16_layers_ms']:>9.2f} {r['codes_layers_ms']:>9.2f} "
              f"{r['bf16_layers_ms'] / r['codes_layers_ms']:>5.2f}x | {r['bf16_lm_head_ms']:>12.2f} "
              f"{r['codes_lm_head_ms']:>7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bf16_bytes": dense_bytes, "codes_bytes": code_bytes, "rows": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
