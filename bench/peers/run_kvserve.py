"""kvserve side of bench/compare.py, run as a subprocess like the peers so that each system gets
a fresh process (no allocator, thread-pool or page-cache state carried over from another).

    python bench/peers/run_kvserve.py JOB.json     # prints one KVSERVE_BENCH_RESULT line
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

import torch  # noqa: E402
from protocol import Run, RunnerResult, by_prefix_caching, clock, emit, read_job, timed_runs  # noqa: E402

import kvserve  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def generate(llm: LLM, w) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    t = clock()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    dt = clock() - t
    return Run(seconds=dt, output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
               prompt_tokens=sum(len(p) for p in w.prompts),
               cached_prompt_tokens=sum(o.num_cached_tokens for o in outs))


def main(job_path: str) -> int:
    job = read_job(job_path)
    settings = dict(dtype=job.dtype, max_model_len=job.max_model_len, max_num_seqs=job.max_num_seqs,
                    kv_cache_memory=f"{job.kv_cache_gib}GiB", **job.options.get("engine", {}))
    results, load = [], 0.0
    for caching, workloads in by_prefix_caching(job.workloads).items():
        t = clock()
        llm = LLM(None, enable_prefix_caching=caching, **settings)
        load += clock() - t
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([w.prompts[0][:64] for w in workloads], warm, use_tqdm=False)
        for w in workloads:
            results.append(timed_runs(lambda w: generate(llm, w), llm.reset_prefix_cache, w, job.repeat))
        del llm
    emit(RunnerResult(system="kvserve", version=getattr(kvserve, "__version__", "dev"),
                      settings=settings | {"torch": torch.__version__, "threads": torch.get_num_threads()},
                      load_seconds=load, workloads=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
