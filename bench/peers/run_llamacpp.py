"""llama.cpp side of bench/compare.py; runs INSIDE bench/.venvs/llamacpp (see setup_llamacpp.sh).

    bench/.venvs/llamacpp/bin/python bench/peers/run_llamacpp.py JOB.json
Uses llama-cpp-python's Llama object, the engine behind its OpenAI server, directly: the server
holds one lock per model and runs requests one after another, so driving the object serially
measures what the server does, without HTTP in the way. The model is the GGUF file itself (Q4_1).
"Prefix caching on" is llama.cpp's own reuse of the longest common prefix with the previous
prompt; "off" clears the context before every request. EOS is ignored because Llama.generate
never stops by itself: we take exactly max_tokens tokens.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocol import Run, RunnerResult, by_prefix_caching, clock, emit, read_job, timed_runs  # noqa: E402


def generate_one(llm, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    """(tokens, seconds to first token, seconds for the rest) for one greedy request."""
    t0 = clock()
    first = None
    n = 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        n += 1
        if first is None:
            first = clock()
        if n == max_tokens:
            break
    end = clock()
    return n, first - t0, end - first


def main(job_path: str) -> int:
    import llama_cpp

    job = read_job(job_path)
    threads = int(job.options.get("threads", os.cpu_count() or 1))
    settings = dict(model_path=job.options["model"], n_ctx=job.max_model_len, n_batch=512, n_ubatch=512,
                    n_threads=threads, n_threads_batch=threads, verbose=False)

    def generate(llm, caching: bool, w) -> Run:
        t = clock()
        total, decode_tokens, decode_s = 0, 0, 0.0
        for p in w.prompts:
            if not caching:
                llm.reset()
            n, _, rest = generate_one(llm, p, w.max_tokens)
            total += n
            decode_tokens += n - 1
            decode_s += rest
        dt = clock() - t
        return Run(seconds=dt, output_tokens=total, prompt_tokens=sum(len(p) for p in w.prompts),
                   decode_tok_per_s=decode_tokens / decode_s if decode_s > 0 else None)

    results, load = [], 0.0
    for caching, workloads in by_prefix_caching(job.workloads).items():
        t = clock()
        llm = llama_cpp.Llama(**settings)
        load += clock() - t
        generate_one(llm, workloads[0].prompts[0][:64], 4)  # warm-up
        for w in workloads:
            results.append(timed_runs(lambda w: generate(llm, caching, w), llm.reset, w, job.repeat))
        llm.close()
    emit(RunnerResult(system="llama.cpp", version=llama_cpp.__version__,
                      settings=settings | {"weights": "Q4_1 GGUF", "requests": "one at a time (server lock)"},
                      load_seconds=load, workloads=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
