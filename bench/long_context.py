"""Long contexts in bounded memory: what releasing blocks saves, and what compression costs.

    python bench/long_context.py memory       # peak held blocks vs length, 16K tokens, tiny random models
    python bench/long_context.py perplexity   # SmolLM2 on Python's Functional Programming HOWTO, budgets 256-2048
    python bench/long_context.py needle       # a number hidden at 3 depths of ~4K tokens, asked at the end
    python bench/long_context.py capacity     # concurrent 8K requests in a fixed pool, with and without
    python bench/long_context.py overhead     # decode-step time of a batch with one compressed request in it

Everything runs through the engine (LLM), so releases happen where they happen in serving. Each
mode prints a table and writes bench/results/long_context_<mode>.json.

memory: one 16,384-token sequence (a 15,872-token prompt in 512-token chunks, then 512 decoded
tokens) on a random 2-layer model with 32K positions; the KV blocks the sequence holds after every
step. Full cache, a sliding-window twin of the model (window 1024), streaming (4 sinks + 1024) and
h2o (512 heavy + 512 recent).

perplexity: the text (a Debian package's documentation: python3.11-doc's
howto/functional.rst.txt, the Functional Programming HOWTO; `apt-get install python3.11-doc`) scored as a prompt with
prompt_logprobs, in 64-token chunks so that each query attends to at most budget + 64 + a block of
keys; perplexity over all tokens and over the tokens past the first 2,048 (where every budget
bites). snapkv votes at token 2,048 (its observation window: the 32 tokens before it), as if the
prompt ended there, and keeps what it chose for the rest of the text: its price is the second
column.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from kvserve import LLM, SamplingParams  # noqa: E402

RESULTS = HERE / "results"
TEXT = Path("/usr/share/doc/python3.11/html/_sources/howto/functional.rst.txt")
BS = 16


def write_json(name: str, payload: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"long_context_{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def tiny_checkpoint(directory: Path, sliding_window: int | None, head_dim: int = 32) -> str:
    """A random 2-layer Llama (or Mistral with a window) with 32K positions: shapes, not quality.
    head_dim 64 has the bf16 CPU kernels (and the compiled layer loop)."""
    import torch
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=128 // head_dim, num_key_value_heads=64 // head_dim,
                  max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, head_dim=head_dim)
    if sliding_window:
        cfg = transformers.MistralConfig(sliding_window=sliding_window, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(directory)
    smollm2_tokenizer().save_pretrained(directory)  # any tokenizer.json the loader accepts
    return str(directory)


def smollm2_tokenizer():
    import torch

    from kvserve.model.loader import load_model
    return load_model(None, dtype=torch.bfloat16).tokenizer


def held_blocks_run(llm: LLM, prompt: list[int], params: SamplingParams) -> list[tuple[int, int]]:
    """(tokens computed by the end of the step, blocks allocated during it) for every step of one
    sequence: the pool's used blocks right after scheduling, when the step's new blocks are in
    and nothing is released yet (releases happen when the step commits)."""
    eng = llm.engine
    sched = eng.scheduler
    during = []
    schedule = sched.schedule

    def counting_schedule():
        out = schedule()
        during.append(eng.kv.pool.num_used_blocks)
        return out
    sched.schedule = counting_schedule
    eng.add_request("seq", prompt, params)
    trace = []
    while eng.has_unfinished_requests():
        eng.step()
        req = eng.scheduler.requests.get("seq")
        trace.append((req.num_computed_tokens if req is not None else len(prompt) + params.max_tokens - 1,
                      during[-1]))
    eng.kv.check_integrity()
    assert eng.kv.pool.num_used_blocks == 0
    return trace


def mode_memory(args) -> None:
    total, decode = 16384, 512
    prompt_len = total - decode
    chunk = 512
    window = 1024
    prompt = [(7 * i + 3) % 4000 + 10 for i in range(prompt_len)]
    configs = [
        ("full", None, None),
        ("sliding window 1024", window, None),
        ("streaming 4 + 1024", None, {"method": "streaming", "sink_tokens": 4, "window": window}),
        ("h2o 512 + 512", None, {"method": "h2o", "heavy_tokens": 512, "window": 512}),
        ("snapkv 4 + 496 + 512", None, {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 496, "window": 512}),
    ]
    marks = [1024, 2048, 4096, 8192, 12288, 16383]
    rows, traces = [], {}  # every step's (length, blocks) for the plot; the JSON keeps every 8th
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for label, sw, comp in configs:
            key = sw or 0
            if key not in paths:
                paths[key] = tiny_checkpoint(Path(tmp) / f"m{key}", sw)
            llm = LLM(paths[key], dtype="float32", block_size=BS, max_num_batched_tokens=chunk,
                      max_model_len=total + 1, kv_cache_memory=256 * 2**20, enable_prefix_caching=False)
            t0 = time.perf_counter()
            trace = held_blocks_run(llm, prompt, SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True,
                                                                kv_compression=comp))
            secs = time.perf_counter() - t0
            at = {}
            for m in marks:
                at[m] = max((b for n, b in trace if n <= m), default=0)
            prefill_peak = max(b for n, b in trace if n <= prompt_len)
            decode_peak = max((b for n, b in trace if n > prompt_len), default=0)
            released = dict(llm.engine.kv.num_released)
            rows.append({"config": label, "peak_blocks_up_to": at, "prefill_peak_blocks": prefill_peak,
                         "decode_peak_blocks": decode_peak, "released_blocks": released, "seconds": secs,
                         "trace": trace[::8]})
            traces[label] = trace
            print(f"{label}: decode peak {decode_peak} blocks, prefill peak {prefill_peak}, {secs:.0f} s", flush=True)
            del llm
    print()
    print("peak blocks allocated to the sequence while a step runs, by the length it has reached")
    print("| config | " + " | ".join(f"<= {m}" for m in marks) + " | prefill peak | decode peak | decode bound |")
    print("|---|" + "---:|" * (len(marks) + 3))
    # window + sinks + one block (a decode step's new block comes after the last step's releases)
    bounds = {"full": "-", "sliding window 1024": f"{window // BS + 1}",
              "streaming 4 + 1024": f"{1 + window // BS + 1}", "h2o 512 + 512": f"{512 // BS + 512 // BS + 1}",
              "snapkv 4 + 496 + 512": f"{1 + 496 // BS + 512 // BS + 1}"}
    for r in rows:
        print(f"| {r['config']} | " + " | ".join(str(r["peak_blocks_up_to"][m]) for m in marks)
              + f" | {r['prefill_peak_blocks']} | {r['decode_peak_blocks']} | {bounds[r['config']]} |")
    plot_memory(traces, HERE.parent / "docs" / "long-context-memory.png")
    write_json("memory", {"total_tokens": total, "prompt_tokens": prompt_len, "chunk": chunk, "block_size": BS,
                          "model": "random Llama/Mistral, 2 layers, 4 heads, 2 KV heads, head_dim 32, 32K positions",
                          "rows": rows})


def plot_memory(traces: dict[str, list], path: Path) -> None:
    """Blocks held by the sequence against the length it has reached, one line per config."""
    from kvserve.tools.plotting import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, trace in traces.items():
        xs, ys = zip(*trace)
        ax.plot(xs, ys, label=label, linewidth=1.4)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(f"KV blocks held ({BS} tokens each)")
    ax.set_yscale("log")
    ax.set_title("KV held by one 16K-token sequence (prefill in 512-token chunks, then decode)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def text_ids(max_tokens: int) -> list[int]:
    if not TEXT.exists():
        sys.exit(f"{TEXT} is missing: it comes with Debian's python3.11-doc (apt-get install python3.11-doc)")
    return smollm2_tokenizer().encode(TEXT.read_text())[:max_tokens]


def budget_configs(budgets: list[int]) -> list[tuple[str, int | None, dict | None]]:
    out = [("full", None, None)]
    for b in budgets:
        out.append((f"streaming {b}", b, {"method": "streaming", "sink_tokens": 4, "window": b - BS}))
        out.append((f"h2o {b}", b, {"method": "h2o", "heavy_tokens": b // 2, "window": b // 2}))
        out.append((f"snapkv {b}", b, {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": b // 2 - BS,
                                       "window": b // 2}))
    return out


def snapkv_votes_at(pos: int) -> None:
    """Make snapkv vote at position `pos` of a longer prompt, as if the prompt ended there: the
    perplexity text is one prompt, and snapkv otherwise compresses only once it has run."""
    from kvserve.kv.compression.snapkv import SnapKV
    release, rows = SnapKV.blocks_to_release, SnapKV.score_rows
    SnapKV.blocks_to_release = lambda self, logical, nxt, bs, prompt_len, scores: release(
        self, logical, nxt, bs, min(prompt_len, pos), scores)
    SnapKV.score_rows = lambda self, start, n, prompt_len: rows(self, start, n, min(prompt_len, pos))


def mode_perplexity(args) -> None:
    ids = text_ids(args.max_tokens)
    chunk = 64
    llm = LLM(None, block_size=BS, max_num_batched_tokens=chunk, max_model_len=8192,
              enable_prefix_caching=False)
    print(f"text: {TEXT} ({len(ids)} SmolLM2 tokens); chunks of {chunk}", flush=True)
    rows = []
    split = 2048
    snapkv_votes_at(split)  # its price shows after the split
    for label, budget, comp in budget_configs(args.budgets):
        t0 = time.perf_counter()
        p = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, kv_compression=comp)
        out = llm.generate([ids], p, use_tqdm=False)[0]
        lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        nll = [-x for x in lps]
        ppl = math.exp(sum(nll) / len(nll))
        tail = nll[split - 1:]
        ppl_tail = math.exp(sum(tail) / len(tail)) if tail else float("nan")
        secs = time.perf_counter() - t0
        rows.append({"config": label, "budget": budget, "kv_compression": comp, "perplexity": ppl,
                     f"perplexity_after_{split}": ppl_tail, "seconds": secs,
                     "attended_tokens": out.outputs[0].num_attended_tokens})
        print(f"{label}: ppl {ppl:.3f}, after {split}: {ppl_tail:.3f} ({secs:.0f} s)", flush=True)
    full = rows[0]
    print()
    print(f"| config | perplexity | vs full | perplexity after {split} tokens | vs full |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        a, b = r["perplexity"], r[f"perplexity_after_{split}"]
        print(f"| {r['config']} | {a:.3f} | {a / full['perplexity'] - 1:+.1%} | {b:.3f} | "
              f"{b / full[f'perplexity_after_{split}'] - 1:+.1%} |")
    write_json("perplexity", {"text": str(TEXT), "package": "python3.11-doc (Debian)", "text_tokens": len(ids),
                              "model": "SmolLM2-135M-Instruct (embedded GGUF, bf16)", "chunk": chunk,
                              "block_size": BS, "rows": rows})


NEEDLE = " Remember this: the magic number of the archive is 73914. "
QUESTION = "\n\nQuestion: what is the magic number of the archive?\nAnswer: the magic number of the archive is"


def mode_needle(args) -> None:
    tok = smollm2_tokenizer()
    hay = text_ids(args.context)
    needle, question = tok.encode(NEEDLE), tok.encode(QUESTION)
    depths = [0.1, 0.5, 0.9]
    prompts = [hay[:int(d * len(hay))] + needle + hay[int(d * len(hay)):] + question for d in depths]
    llm = LLM(None, block_size=BS, max_num_batched_tokens=64, max_model_len=8192, enable_prefix_caching=False)
    rows = []
    for label, budget, comp in budget_configs(args.budgets):
        p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_compression=comp)
        outs = llm.generate(prompts, p, use_tqdm=False)
        found = ["73914" in o.outputs[0].text for o in outs]
        rows.append({"config": label, "budget": budget, "found": dict(zip(map(str, depths), found)),
                     "answers": [o.outputs[0].text for o in outs], "success": sum(found) / len(found)})
        print(f"{label}: {found} {[o.outputs[0].text for o in outs]}", flush=True)
    print()
    print("| config | " + " | ".join(f"depth {d:.0%}" for d in depths) + " | success |")
    print("|---|" + ":---:|" * len(depths) + "---:|")
    for r in rows:
        print(f"| {r['config']} | " + " | ".join("yes" if r["found"][str(d)] else "no" for d in depths)
              + f" | {r['success']:.0%} |")
    write_json("needle", {"context_tokens": len(prompts[0]), "needle": NEEDLE, "question": QUESTION,
                          "depths": depths, "rows": rows})


def mode_capacity(args) -> None:
    """N requests of 8K tokens (7,936 prompt + 256 out) at once in a pool of 2,048 blocks
    (32K tokens): how many run together, and output tokens per second. bf16 on the random model
    with head_dim 64: the compiled layer loop, where h2o's scores are computed."""
    n, prompt_len, out_len = args.requests, 7936, 256
    blocks = 2048
    configs = [("full", None), ("streaming 4 + 1024", {"method": "streaming", "sink_tokens": 4, "window": 1024}),
               ("h2o 512 + 512", {"method": "h2o", "heavy_tokens": 512, "window": 512}),
               ("snapkv 4 + 496 + 512", {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 496, "window": 512})]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(Path(tmp) / "m", None, head_dim=64)
        for label, comp in configs:
            llm = LLM(path, dtype="bfloat16", block_size=BS, max_num_batched_tokens=2048, max_model_len=8192,
                      num_gpu_blocks_override=blocks, enable_prefix_caching=False)
            eng = llm.engine
            for i in range(n):
                eng.add_request(str(i), [(13 * i + 7 * j) % 4000 + 10 for j in range(prompt_len)],
                                SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, kv_compression=comp))
            peak_running, decode_tokens, decode_secs = 0, 0, 0.0
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                t = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t
                running = eng.scheduler.num_running
                peak_running = max(peak_running, running)
                if eng.last_step_tokens and eng.last_step_tokens == running:  # a decode-only step
                    decode_tokens += running
                    decode_secs += dt
            total = time.perf_counter() - t0
            rows.append({"config": label, "peak_concurrent": peak_running,
                         "preemptions": eng.scheduler.num_preemptions, "seconds": total,
                         "output_tokens_per_s": n * out_len / total,
                         "decode_tokens_per_s": decode_tokens / decode_secs if decode_secs else None})
            print(rows[-1], flush=True)
            del llm, eng
    print()
    print(f"| config ({n} x 8K requests, {blocks} blocks) | peak concurrent | preemptions | output tok/s (whole run) "
          "| decode-only steps tok/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['peak_concurrent']} | {r['preemptions']} | {r['output_tokens_per_s']:.0f} | "
              f"{r['decode_tokens_per_s'] or 0:.0f} |")
    write_json("capacity", {"requests": n, "prompt_tokens": prompt_len, "output_tokens": out_len, "blocks": blocks,
                            "block_size": BS, "rows": rows})


def mode_overhead(args) -> None:
    """What one compressed request costs the batch it joins: decode-step time of 8 plain requests
    (SmolLM2, bf16, 512-token prompts) alone, beside a ninth plain one, and beside one streaming
    or one compressed request instead (the ninth request's own share of the step is the 9 plain
    row); and the time of the steps that prefill the prompts (in the batch's first steps)."""
    llm = LLM(None, block_size=BS, max_model_len=4096, enable_prefix_caching=False)
    eng = llm.engine
    prompts = [[(31 * i + 17 * j) % 40000 + 100 for j in range(512)] for i in range(9)]
    configs = [("8 plain", None), ("9 plain", "none"),
               ("8 plain + 1 streaming", {"method": "streaming", "sink_tokens": 4, "window": 256}),
               ("8 plain + 1 h2o", {"method": "h2o", "heavy_tokens": 128, "window": 128}),
               ("8 plain + 1 snapkv", {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 128, "window": 128})]
    rows = []
    for rep in range(2):  # alternate, as the machine drifts
        for label, comp in configs:
            n = 8 if comp is None else 9
            for i in range(n):
                eng.add_request(f"{label}-{rep}-{i}", prompts[i], SamplingParams(
                    temperature=0, max_tokens=96, ignore_eos=True,
                    kv_compression=comp if i == 8 and comp != "none" else None))
            times, prefill = [], 0.0
            while eng.has_unfinished_requests():
                t = time.perf_counter()
                eng.step()
                if eng.last_step_tokens == eng.scheduler.num_running == n:
                    times.append(time.perf_counter() - t)
                elif not times:  # the prompts' chunks, before every request decodes
                    prefill += time.perf_counter() - t
            times.sort()
            rows.append({"config": label, "rep": rep, "median_decode_step_ms": 1000 * times[len(times) // 2],
                         "steps": len(times), "prefill_ms": 1000 * prefill})
            print(rows[-1], flush=True)
    print()
    print("| batch | median decode step (ms), run 1 | run 2 | prefill of the prompts (ms), run 1 | run 2 |")
    print("|---|---:|---:|---:|---:|")
    for label, _ in configs:
        ms = [r["median_decode_step_ms"] for r in rows if r["config"] == label]
        pf = [r["prefill_ms"] for r in rows if r["config"] == label]
        print(f"| {label} | {ms[0]:.1f} | {ms[1]:.1f} | {pf[0]:.0f} | {pf[1]:.0f} |")
    write_json("overhead", {"model": "SmolLM2-135M-Instruct (embedded GGUF, bf16)", "prompt_tokens": 512,
                            "rows": rows})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["memory", "perplexity", "needle", "capacity", "overhead"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--max-tokens", type=int, default=8000, help="perplexity: text tokens scored (SmolLM2 has 8,192 positions)")
    ap.add_argument("--context", type=int, default=4096, help="needle: haystack tokens")
    ap.add_argument("--requests", type=int, default=16, help="capacity: concurrent 8K requests")
    args = ap.parse_args(argv)
    {"memory": mode_memory, "perplexity": mode_perplexity, "needle": mode_needle,
     "capacity": mode_capacity, "overhead": mode_overhead}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
