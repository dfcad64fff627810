"""Where a decode step's time goes at batch 64: the model forward vs everything else (the target:
scheduling and bookkeeping under 10 % of step time).

Runs the random workload's 64 requests (prompts 128-512 tokens; --workload shared: a 1,024-token
shared prefix + 32) until all of them are decoding,
then times --steps engine steps. "Model" is `LlamaModel.forward` plus `compute_logits`; the rest
(scheduler, KV cache manager, step metadata, sampler, detokenizer, output objects) is everything
`LLMEngine.step` does around them. `--breakdown` splits the model time into attention (the
backend's forward: cache write + attention), linear layers and the rest (norms, rotary, activations,
embedding); it runs the Python layer loop, whose calls can be timed one by one, where a bf16 CPU
model otherwise runs its layers as one compiled call (model/cpu_decoder.py), ~1.5-2.5 ms a step
faster. `--cprofile` adds the top functions by own time (cProfile
inflates the Python side, so its percentages overstate bookkeeping).

    python bench/step_profile.py
    python bench/step_profile.py --steps 50 --cprofile
    python bench/step_profile.py --breakdown
    python bench/step_profile.py --breakdown --kv-cache-dtype int8
    python bench/step_profile.py --device cuda --model DIR [--enforce-eager]

On CUDA the model time runs from the call until the device is done (a synchronize after the
forward, or after the decode graph's replay, and after the logits): what the step waits for.
Prints a table and writes bench/results/step_profile.json.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402
from throughput import make_workloads  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.linear import Linear  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), int8, fp8, int4")
    ap.add_argument("--workload", default="random", choices=("random", "shared"),
                    help="random: prompts of 128-512 tokens; shared: a 1,024-token prefix + 32 each")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="time attention and linear layers inside the model")
    ap.add_argument("--kernels", action="store_true", help="CUDA: the device kernels by total time (torch.profiler)")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    ap.add_argument("--json", default=str(HERE / "results" / "step_profile.json"))
    args = ap.parse_args(argv)

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="4GiB", max_model_len=2048, max_num_seqs=64,
              kv_cache_dtype=args.kv_cache_dtype, device=args.device, enforce_eager=args.enforce_eager)
    engine, model = llm.engine, llm.engine.runner.model
    cuda = model.device.type == "cuda"
    prompts, _ = make_workloads(64, 49152)[args.workload]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while not (len(engine.scheduler.running) == 64
               and all(len(r.output_token_ids) >= 2 for r in engine.scheduler.running)):
        engine.step()

    spent = {"model": 0.0, "attention": 0.0, "linears": 0.0, "kv_seal": 0.0}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                spent[key] += time.perf_counter() - t
        return wrapper

    model.forward, model.compute_logits = timed(model.forward, "model"), timed(model.compute_logits, "model")
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.run = timed(graphs.run, "model")
    kv_cache = engine.runner.kv_cache
    # Quantized caches seal (quantize) the blocks that filled up after the forward: KV cache work
    # that would sit inside a GPU engine's cache-write kernel, reported on its own line.
    kv_cache.finish_step = timed(kv_cache.finish_step, "kv_seal")
    if args.breakdown:
        model.use_compiled_decoder = False  # the compiled loop's kernel calls cannot be timed from Python
        model.attn.forward = timed(model.attn.forward, "attention")
        Linear.__call__ = timed(Linear.__call__, "linears")  # decode inputs are 2-D: no nested calls
    prof = cProfile.Profile() if args.cprofile else None
    kernels = None
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile
        kernels = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    batch = []
    t = time.perf_counter()
    if prof:
        prof.enable()
    with kernels or contextlib.nullcontext():
        for _ in range(args.steps):
            batch.append(len(engine.scheduler.running))
            engine.step()
    if prof:
        prof.disable()
    total = time.perf_counter() - t
    rest = total - spent["model"] - spent["kv_seal"]
    result = {"steps": args.steps, "workload": args.workload, "kv_cache_dtype": args.kv_cache_dtype, "mean_batch": sum(batch) / len(batch), "ms_per_step": total / args.steps * 1e3,
              "model_ms_per_step": spent["model"] / args.steps * 1e3, "other_ms_per_step": rest / args.steps * 1e3,
              "kv_seal_ms_per_step": spent["kv_seal"] / args.steps * 1e3,
              "other_share": rest / total, "token_occupancy": engine.get_stats().token_occupancy,
              "cprofile": bool(prof)}
    if args.breakdown:
        result.update({f"{k}_ms_per_step": spent[k] / args.steps * 1e3 for k in ("attention", "linears")})
        result["model_rest_ms_per_step"] = (spent["model"] - spent["attention"] - spent["linears"]) / args.steps * 1e3
    compiled = model.compiled_decoder(kv_cache) is not None
    result.update(device=str(model.device), decode_graphs=graphs is not None, compiled_decoder=compiled)
    print(f"\n{args.steps} decode steps ({args.workload}), mean batch {result['mean_batch']:.1f}, {args.dtype}, "
          f"{model.device}{', decode graphs' if graphs is not None else ''}"
          f"{', compiled layer loop' if compiled else ''}"
          f"{' (under cProfile)' if prof else ''}")
    print(f"{'step ms':>8} {'model ms':>9} {'KV seal ms':>11} {'other ms':>9} {'other share':>12} {'KV occupancy':>13}")
    print(f"{result['ms_per_step']:>8.1f} {result['model_ms_per_step']:>9.1f} {result['kv_seal_ms_per_step']:>11.2f} "
          f"{result['other_ms_per_step']:>9.2f} {result['other_share'] * 100:>11.1f}% {result['token_occupancy']:>13.3f}")
    if args.breakdown:
        print(f"model: attention {result['attention_ms_per_step']:.1f} ms, linear layers "
              f"{result['linears_ms_per_step']:.1f} ms, rest {result['model_rest_ms_per_step']:.1f} ms per step")
    if kernels is not None:
        print(kernels.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
