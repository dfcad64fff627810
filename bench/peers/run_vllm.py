"""vLLM side of bench/compare.py; runs INSIDE bench/.venvs/vllm (see setup_vllm.sh).

    bench/.venvs/vllm/bin/python bench/peers/run_vllm.py JOB.json
compare.py sets the environment vLLM's CPU docs recommend: VLLM_CPU_OMP_THREADS_BIND (both cores),
VLLM_CPU_KVCACHE_SPACE (GiB, from the job) and LD_PRELOAD of tcmalloc + Intel OpenMP.
The model is the HF directory written by export_hf.py from the same GGUF kvserve serves.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocol import Run, RunnerResult, by_prefix_caching, clock, emit, read_job, timed_runs  # noqa: E402


def main(job_path: str) -> int:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = read_job(job_path)
    model = job.options["model"]
    settings = dict(model=model, dtype=job.dtype, max_model_len=job.max_model_len,
                    max_num_seqs=job.max_num_seqs, **job.options.get("engine", {}))

    def generate(llm, w) -> Run:
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w.prompts]
        t = clock()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = clock() - t
        cached = [getattr(o, "num_cached_tokens", None) for o in outs]
        return Run(seconds=dt, output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                   prompt_tokens=sum(len(p) for p in w.prompts),
                   cached_prompt_tokens=None if None in cached else sum(cached))

    results, load = [], 0.0
    for caching, workloads in by_prefix_caching(job.workloads).items():
        t = clock()
        llm = LLM(enable_prefix_caching=caching, **settings)
        load += clock() - t
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=w.prompts[0][:64]) for w in workloads], warm, use_tqdm=False)
        for w in workloads:
            results.append(timed_runs(lambda w: generate(llm, w), llm.reset_prefix_cache, w, job.repeat))
        del llm
    import torch
    emit(RunnerResult(system="vllm", version=vllm.__version__,
                      settings=settings | {"torch": torch.__version__, "threads": torch.get_num_threads()},
                      load_seconds=load, workloads=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
