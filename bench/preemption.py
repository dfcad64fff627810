"""Swap vs recompute preemption, same prompts, same pool, same tokens out.

Every prompt fits the device pool at admission but the outputs do not, so running requests are
preempted repeatedly; `swap` moves their blocks to the host tier, `recompute` frees them and
prefills again on resume (hitting whatever prefix blocks survived in the cache). The measurement
itself is bench/tiers.py's `preemption` section; this runs it alone at a chosen size.

    python bench/preemption.py bfloat16 32 192     # dtype, requests, output tokens each
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiers import preemption  # noqa: E402

if __name__ == "__main__":
    dtype, num_reqs, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    preemption(num_reqs, prompt_len=256, gen=gen, dtype=dtype)
    print("identical tokens: yes (asserted)")
