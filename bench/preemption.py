"""Swap vs recompute preemption, same prompts, same pool, same tokens out.

Every prompt fits the device pool at admission but the outputs do not, so running requests are
preempted repeatedly; `swap` moves their blocks to the host tier, `recompute` frees them and
prefills again on resume (hitting whatever prefix blocks survived in the cache).

    python bench/preemption.py bfloat16 32 192     # dtype, requests, output tokens each
"""
import random, sys, time
from kvserve import LLM, SamplingParams
BLOCK = 16
def run(dtype, num_reqs=24, prompt_len=256, gen=128):
    rng = random.Random(2)
    prompts = [[rng.randrange(49152) for _ in range(prompt_len)] for _ in range(num_reqs)]
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    # Every prompt fits at admission, not the outputs: running requests are preempted repeatedly.
    pool = num_reqs * (prompt_len // BLOCK + 1) + 2
    toks = {}
    for mode in ("recompute", "swap"):
        llm = LLM(None, dtype=dtype, block_size=BLOCK, num_gpu_blocks_override=pool,
                  max_model_len=prompt_len + gen + BLOCK, max_num_batched_tokens=2048,
                  swap_space=2.0, preemption_mode=mode)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        s = llm.engine.get_stats()
        llm.engine.close()
        toks[mode] = [o.outputs[0].token_ids for o in outs]
        print(f"{dtype} {mode:9s} {dt:7.2f} s  {num_reqs*gen/dt:6.1f} out tok/s  preemptions {s.num_preemptions}  swapped {s.num_swapped_preemptions}  fallbacks {s.num_swap_fallbacks}", flush=True)
    print("identical tokens:", toks["recompute"] == toks["swap"])
run(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", int(sys.argv[2]), 256, int(sys.argv[3]))
