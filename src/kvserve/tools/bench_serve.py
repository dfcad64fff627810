"""`kvserve bench serve`: a load generator for any OpenAI-compatible server (/v1/completions, streaming).

Closed loop (`--concurrency N`: N clients, each sends its next request when the last one ends)
or open loop (`--request-rate R`: conversations start as a Poisson process, whatever the server's
pace). Prompts are token ids, so lengths are exact and a shared prefix is shared token for token.
A multi-turn conversation sends prompt + answer + new user tokens each turn; the answer's ids come
from the server's /tokenize (vLLM and kvserve have it). The run always ends: at --num-requests,
at --duration, or at the hard timeout, whichever comes first.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import random
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx

from kvserve.config import ConfigError, check_writable
from kvserve.tools.workload import (DEFAULT_TOKEN_RANGE, Conversation, LengthDist, WorkloadSpec, describe,
                                    iter_conversations)


class ClientLanes:
    """An httpx client per request in flight, each holding one connection; idle ones are reused.

    One shared client is the obvious choice and a slow one: its connection pool re-scans every
    connection for every queued request on each event (httpcore's `_assign_requests_to_connections`,
    O(connections x requests)). With 64 requests in flight against kvserve on 127.0.0.1 that cost
    the client 5.6 ms of CPU per request, against 0.4 ms with a client per connection - and a load
    generator that slow measures itself, not the server (bench/NOTES.md, "The benchmark's
    HTTP client: one httpx client per request in flight").
    """

    def __init__(self, **client_kwargs) -> None:
        # One SSL context for all: building one per client costs milliseconds (certificates).
        client_kwargs.setdefault("verify", ssl.create_default_context())
        self._kwargs = dict(client_kwargs, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[httpx.AsyncClient]:
        client = self._idle.pop() if self._idle else None
        if client is None:
            client = httpx.AsyncClient(**self._kwargs)
            self._all.append(client)
        try:
            yield client
        finally:
            self._idle.append(client)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._all), return_exceptions=True)
        self._all, self._idle = [], []


@dataclass
class RequestRecord:
    conversation_id: str
    turn: int
    start: float  # seconds since the bench started
    prompt_len: int
    max_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    chunk_times: list[float] = field(default_factory=list, repr=False)  # absolute, for throughput over time
    chunk_tokens: list[int] = field(default_factory=list, repr=False)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class BenchConfig:
    url: str
    model: str
    workload: WorkloadSpec
    num_requests: int | None
    duration: float | None
    concurrency: int | None
    request_rate: float | None
    ignore_eos: bool = True
    hard_timeout: float = 600.0
    request_timeout: float = 300.0
    api_key: str | None = None
    progress: bool = True


class Bench:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.issued = 0
        self.tokenize_ok: bool | None = None
        self.notes: list[str] = []
        self._conversations = iter_conversations(cfg.workload)
        self._answer_rng = random.Random(cfg.workload.seed + 1)
        self._bar = None

    # -- stop rule ------------------------------------------------------------------------------
    def may_issue(self) -> bool:
        c = self.cfg
        if c.num_requests is not None and self.issued >= c.num_requests:
            return False
        return c.duration is None or time.monotonic() - self.t0 < c.duration

    # -- one request ----------------------------------------------------------------------------
    async def send(self, client: httpx.AsyncClient, conv: Conversation, turn: int, prompt: list[int]) -> tuple[RequestRecord, str]:
        c = self.cfg
        max_tokens = conv.turns[turn].output_len
        rec = RequestRecord(conv.conversation_id, turn, time.monotonic() - self.t0, len(prompt), max_tokens)
        body = {"model": c.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                "ignore_eos": c.ignore_eos, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        text, start = [], time.monotonic()
        last, seen_usage = None, 0
        try:
            async with client.stream("POST", f"{c.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
                    return rec, ""
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    usage = chunk.get("usage") or {}
                    new_text = "".join(ch.get("text", "") for ch in chunk.get("choices", []))
                    completion = usage.get("completion_tokens")
                    # Tokens in this chunk: from continuous usage when the server sends it, else one per chunk.
                    n = (completion - seen_usage) if completion is not None else (1 if new_text else 0)
                    if completion is not None:
                        seen_usage = completion
                    if n <= 0 and not new_text:
                        continue
                    now = time.monotonic()
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    text.append(new_text)
                    rec.chunk_times.append(now - self.t0)
                    rec.chunk_tokens.append(max(n, 0))
                rec.output_tokens = seen_usage or sum(rec.chunk_tokens)
                rec.e2e = time.monotonic() - start
                if rec.ttft is None:
                    rec.error = "the stream ended without a token"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            rec.error = f"{type(e).__name__}: {e}" or type(e).__name__
        return rec, "".join(text)

    async def answer_ids(self, client: httpx.AsyncClient, text: str, n_tokens: int) -> list[int]:
        """The answer's token ids for the next turn's prompt, via /tokenize; random ids of the same
        length if the server has no /tokenize (then answers are not reused from the cache)."""
        if self.tokenize_ok is not False:
            try:
                r = await client.post(f"{self.cfg.url}/tokenize", json={"model": self.cfg.model, "prompt": text,
                                                                        "add_special_tokens": False})
                if r.status_code == 200:
                    self.tokenize_ok = True
                    return list(r.json()["tokens"])
            except httpx.HTTPError:
                pass
            if self.tokenize_ok is None:
                self.tokenize_ok = False
                self.notes.append("the server has no working /tokenize: multi-turn prompts carry random tokens in "
                                  "place of each answer, so answer reuse is not measured")
        lo, hi = self.cfg.workload.token_range
        return [self._answer_rng.randrange(lo, hi) for _ in range(n_tokens)]

    async def conversation(self, client: httpx.AsyncClient, conv: Conversation) -> None:
        prompt: list[int] = []
        for k, turn in enumerate(conv.turns):
            if k and not self.may_issue():
                return
            self.issued += k > 0  # turn 0 was counted when the conversation was taken
            prompt = prompt + turn.user_token_ids
            rec, text = await self.send(client, conv, k, prompt)
            self.records.append(rec)
            if self._bar is not None:
                self._bar.update(1)
            if rec.error or k + 1 == len(conv.turns):
                return
            prompt = prompt + await self.answer_ids(client, text, rec.output_tokens)

    def take(self) -> Conversation | None:
        if not self.may_issue():
            return None
        self.issued += 1
        return next(self._conversations)

    # -- load shapes ------------------------------------------------------------------------------
    async def closed_loop(self, lanes: ClientLanes) -> None:
        async def worker() -> None:
            async with lanes.lane() as client:
                while (conv := self.take()) is not None:
                    await self.conversation(client, conv)
        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))

    async def open_loop(self, lanes: ClientLanes) -> None:
        async def on_lane(conv: Conversation) -> None:
            async with lanes.lane() as client:
                await self.conversation(client, conv)

        tasks = []
        while (conv := self.take()) is not None:
            if self.cfg.duration is not None and conv.arrival_time >= self.cfg.duration:
                break  # its start would fall after --duration
            delay = self.t0 + conv.arrival_time - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(on_lane(conv)))
        await asyncio.gather(*tasks)

    async def run(self) -> float:
        c = self.cfg
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        timeout = httpx.Timeout(c.request_timeout, connect=min(30.0, c.request_timeout))
        total = c.num_requests if c.num_requests is not None else None
        if c.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total, unit="req", desc="bench", file=sys.stderr, dynamic_ncols=True)
        self.t0 = time.monotonic()
        lanes = ClientLanes(headers=headers, timeout=timeout)
        try:
            shape = self.closed_loop(lanes) if c.concurrency else self.open_loop(lanes)
            try:
                await asyncio.wait_for(shape, c.hard_timeout)
            except asyncio.TimeoutError:
                self.notes.append(f"hard timeout: stopped after {c.hard_timeout:g} s; requests still running were "
                                  "cancelled and are not counted")
        finally:
            await lanes.aclose()
        if self._bar is not None:
            self._bar.close()
        return time.monotonic() - self.t0


def _error_message(raw: str) -> str:
    try:
        err = json.loads(raw)
        return err.get("error", {}).get("message") or err.get("message") or raw[:300]
    except (json.JSONDecodeError, AttributeError):
        return raw[:300]


def resolve_model(url: str, model: str | None, api_key: str | None) -> str:
    """--model, or the first model the server lists at /v1/models."""
    if model:
        return model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ConfigError(f"--url {url}: cannot reach the server ({type(e).__name__}: {e}); is it running?") from None
    if r.status_code != 200:
        raise ConfigError(f"--url {url}: GET /v1/models answered HTTP {r.status_code} ({_error_message(r.text)}); "
                          "pass --model (and --api-key if the server needs one)")
    data = r.json().get("data") or []
    if not data:
        raise ConfigError(f"--url {url}: the server lists no models; pass --model")
    return data[0]["id"]


# -- CLI ------------------------------------------------------------------------------------------
def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (bench serve: load-test a server)",
                                  description="Benchmarks. `kvserve bench serve --url URL` load-tests an "
                                              "OpenAI-compatible server.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(_bench_parser=bench)
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (/v1/completions, streaming)",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--url", "--base-url", dest="url", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (--base-url: vLLM's name)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    load = p.add_argument_group("load (one of)")
    load.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int,
                      help="closed loop: N clients back to back (default 8)")
    load.add_argument("--request-rate", type=parse_rates, help="open loop: Poisson arrivals, conversations per "
                      "second (inf, vLLM's default: every request at once); several, e.g. 1,2,4, run one after "
                      "another and are compared (the plot draws latency and throughput against the rate)")
    stop = p.add_argument_group("when to stop (the first reached; default --num-requests 100)")
    stop.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int,
                      help="requests to send (each turn counts)")
    stop.add_argument("--duration", type=float, help="seconds to keep sending")
    stop.add_argument("--hard-timeout", type=float, help="seconds after which everything is cancelled "
                      "(default: --duration + 60, or 600)")
    stop.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default 300)")
    w = p.add_argument_group("workload (prompts are token ids)")
    w.add_argument("--prompt-len", "--random-input-len", dest="prompt_len", default="256",
                   help="N, LO:HI or normal:MEAN,STD new tokens per turn (default %(default)s)")
    w.add_argument("--output-len", "--random-output-len", dest="output_len", default="64",
                   help="max_tokens: N, LO:HI or normal:MEAN,STD (default %(default)s)")
    w.add_argument("--random-range-ratio", type=float, default=None, metavar="R",
                   help="vLLM's: a fixed --prompt-len / --output-len N becomes uniform over "
                        "[N (1 - R), N (1 + R)]")
    w.add_argument("--random-prefix-len", type=int, default=None, metavar="N",
                   help="vLLM's: every prompt starts with one shared prefix of N tokens "
                        "(--prefix-len N --shared-prefix-fraction 1)")
    w.add_argument("--shared-prefix-fraction", type=float, default=0.0, help="fraction of conversations whose first "
                   "prompt starts with one shared prefix")
    w.add_argument("--prefix-len", type=int, default=0, help="shared prefix length in tokens")
    w.add_argument("--multi-turn", type=int, default=1, metavar="K", help="turns per conversation; turn k's prompt is "
                   "turn k-1's prompt + answer + new tokens")
    w.add_argument("--token-range", default=f"{DEFAULT_TOKEN_RANGE[0]}:{DEFAULT_TOKEN_RANGE[1]}",
                   help="token ids drawn for prompts, LO:HI (default %(default)s; must be inside the model's vocab)")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at EOS (default: ignore_eos, so outputs have the asked-for length)")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the report (and per-request records) as JSON")
    o.add_argument("--plot", metavar="PNG", help="latency CDFs and throughput over time (default with --json: the "
                   "JSON's path with .png)")
    o.add_argument("--no-plot", action="store_true", help="no PNG beside the --json report")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--save-result", action="store_true",
                   help="vLLM's: write the JSON report to --result-filename, or a dated name in --result-dir")
    o.add_argument("--result-filename", metavar="NAME", help="with --save-result: the report's file name")
    o.add_argument("--result-dir", metavar="DIR", default=".", help="with --save-result: where it goes")
    v = p.add_argument_group("vLLM `bench serve` flags with one meaning here (others are refused)")
    v.add_argument("--backend", default="vllm", help="vllm or openai: /v1/completions, streamed")
    v.add_argument("--endpoint", default="/v1/completions", help="only /v1/completions")
    v.add_argument("--dataset-name", default="random", help="only random (token-id prompts; see workload)")
    v.add_argument("--tokenizer", help="ignored: prompts are token ids, the server detokenizes")
    v.add_argument("--ignore-eos", action="store_true", help="ignored: EOS is ignored by default (--no-ignore-eos)")


DEFAULT_NUM_REQUESTS = 100  # when neither --num-requests nor --duration is given


def parse_rates(text: str) -> list[float]:
    """--request-rate: one rate, or several comma-separated for a sweep."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give conversations per second, e.g. 4, inf, or several "
                                         "for a sweep, e.g. 1,2,4") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be > 0")
    if len(rates) > 1 and any(r == float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: inf (everything at once) cannot be one step of a sweep; "
                                         "run it on its own")
    return rates


def apply_vllm_flags(args) -> None:
    """vLLM's `bench serve` spellings onto this tool's own flags (in place), refusing what it
    cannot mean here."""
    if args.backend not in ("vllm", "openai"):
        raise ConfigError(f"--backend {args.backend!r}: only vllm / openai (/v1/completions, streamed) are implemented")
    if args.endpoint.rstrip("/") != "/v1/completions":
        raise ConfigError(f"--endpoint {args.endpoint!r}: only /v1/completions is implemented")
    if args.dataset_name != "random":
        raise ConfigError(f"--dataset-name {args.dataset_name!r}: only random is implemented (token-id prompts "
                          f"of --prompt-len; shared prefixes with --prefix-len, --shared-prefix-fraction)")
    if args.request_rate == float("inf"):  # vLLM's default: everything at once, capped by --max-concurrency
        args.request_rate = None
        if args.concurrency is None:
            args.concurrency = args.num_requests or DEFAULT_NUM_REQUESTS
    if args.random_prefix_len is not None:
        args.prefix_len, args.shared_prefix_fraction = args.random_prefix_len, 1.0
    if args.random_range_ratio is not None:
        r = args.random_range_ratio
        if not 0 <= r < 1:
            raise ConfigError(f"--random-range-ratio must be in [0, 1) (got {r})")
        for name in ("prompt_len", "output_len"):
            flag = "--" + name.replace("_", "-")
            text = str(getattr(args, name)).strip()
            if not text.isdigit():
                raise ConfigError(f"--random-range-ratio needs a plain {flag} N (got {text!r})")
            n = int(text)
            setattr(args, name, f"{max(1, round(n * (1 - r)))}:{max(1, round(n * (1 + r)))}")
    if args.save_result and not args.json:
        name = args.result_filename or time.strftime("kvserve-bench-serve-%Y%m%d-%H%M%S.json")
        args.json = str(Path(args.result_dir) / name)


def config_from_args(args) -> BenchConfig:
    if isinstance(args.request_rate, list):  # one step of a sweep is one rate (run() splits them)
        if len(args.request_rate) > 1:
            raise ConfigError("several --request-rate values: one run each, so one config each")
        args.request_rate = args.request_rate[0]
    apply_vllm_flags(args)
    if args.concurrency is not None and args.request_rate is not None:
        raise ConfigError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    concurrency = args.concurrency if args.request_rate is None else None
    if concurrency is None and args.request_rate is None:
        concurrency = 8
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1 (got {concurrency})")
    if args.num_requests is not None and args.num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1 (got {args.num_requests})")
    if args.duration is not None and not args.duration > 0:
        raise ConfigError(f"--duration must be > 0 seconds (got {args.duration})")
    num_requests = DEFAULT_NUM_REQUESTS if args.num_requests is None and args.duration is None else args.num_requests
    hard = args.hard_timeout or ((args.duration + 60) if args.duration else 600.0)
    if hard <= 0 or args.request_timeout <= 0:
        raise ConfigError(f"--hard-timeout and --request-timeout must be > 0 (got {hard}, {args.request_timeout})")
    try:
        lo, hi = (int(x) for x in args.token_range.split(":"))
    except ValueError:
        raise ConfigError(f"--token-range {args.token_range!r}: write LO:HI, e.g. 1000:30000") from None
    spec = WorkloadSpec(num_conversations=num_requests or 1, prompt_len=LengthDist.parse(args.prompt_len, "--prompt-len"),
                        output_len=LengthDist.parse(args.output_len, "--output-len"),
                        shared_prefix_fraction=args.shared_prefix_fraction, prefix_len=args.prefix_len,
                        num_turns=args.multi_turn, request_rate=args.request_rate, seed=args.seed, token_range=(lo, hi))
    spec.validate()
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {args.url!r}: write the server's base URL, e.g. http://127.0.0.1:8000")
    return BenchConfig(url=url, model=args.model, workload=spec, num_requests=num_requests, duration=args.duration,
                       concurrency=concurrency, request_rate=args.request_rate, ignore_eos=args.ignore_eos,
                       hard_timeout=hard, request_timeout=args.request_timeout, api_key=args.api_key,
                       progress=not args.no_progress)


def run_bench(cfg: BenchConfig):
    """Run the benchmark; returns (BenchReport, records)."""
    from kvserve.tools.bench_report import summarize

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the progress bar
    cfg.model = resolve_model(cfg.url, cfg.model, cfg.api_key)
    bench = Bench(cfg)
    duration = asyncio.run(bench.run())
    load = (f"closed loop, concurrency {cfg.concurrency}" if cfg.concurrency
            else f"open loop, Poisson {cfg.request_rate:g} conversations/s")
    report = summarize(bench.records, duration, url=cfg.url, model=cfg.model, workload=describe(cfg.workload),
                       load=load, notes=bench.notes, request_rate=cfg.request_rate)
    return report, bench.records


def run(args: argparse.Namespace) -> int:
    from kvserve.tools.bench_report import format_report, format_sweep, plot, plot_sweep
    from kvserve.tools.plotting import PlotUnavailable

    if getattr(args, "bench_command", None) != "serve":
        args._bench_parser.print_help(sys.stderr)
        return 2
    rates = args.request_rate if isinstance(args.request_rate, list) else [args.request_rate]
    try:
        cfgs = []
        for rate in rates:  # every step's settings checked before the first one runs
            step = copy.copy(args)
            step.request_rate = rate
            cfgs.append(config_from_args(step))
        json_path = step.json  # --save-result names it in config_from_args
        check_writable(json_path, "--json")
        png = plot_path(args, json_path)
        check_writable(png, "--plot")
        runs = []
        for i, cfg in enumerate(cfgs):
            if i:
                print()
            runs.append(run_bench(cfg))
            print(format_report(runs[-1][0]))
    except ConfigError as e:
        print(f"kvserve bench serve: error: {e}", file=sys.stderr)
        return 2
    if len(runs) > 1:
        print("\n" + format_sweep([r for r, _ in runs]))
    if json_path:
        docs = [{**asdict(report), "requests": [{k: v for k, v in asdict(r).items()
                                                 if k not in ("chunk_times", "chunk_tokens")} for r in records]}
                for report, records in runs]
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(docs[0] if len(docs) == 1 else {"sweep": docs}, f, indent=2)
    if png:
        try:
            if len(runs) == 1:
                plot(*runs[0], png)
            else:
                plot_sweep([r for r, _ in runs], png)
        except PlotUnavailable as e:
            print(f"kvserve bench serve: {e}; the report above is complete (--no-plot skips the plot)",
                  file=sys.stderr)
            if args.plot:  # asked for by name; the implied one beside --json only warns
                return 1
        else:
            print(f"plot: {png}")
    return 0 if all(report.completed for report, _ in runs) else 1


def plot_path(args, json_path: str | None) -> str | None:
    """--plot, else the --json report's path with .png (a plot is what people look at first)."""
    if args.no_plot:
        if args.plot:
            raise ConfigError("--plot and --no-plot contradict each other; give one")
        return None
    if args.plot or not json_path:
        return args.plot
    return str(Path(json_path).with_suffix(".png"))
