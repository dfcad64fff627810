"""`kvserve stats --url URL`: sample a server's /metrics and judge its KV cache.

Works on kvserve and on vLLM: it reads vLLM's metric names, which kvserve also exports.
Counters are turned into rates over the sampling window (resets, e.g. a restart, are handled
the Prometheus way: a drop means the counter started again from zero).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvserve.tools.analyze import percentile

# First name present wins: vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (both are 0..1).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_COUNTERS = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),       # V1
                   ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"))  # 0.7-0.9
PREFIX_HIT_RATE_GAUGE = "vllm:gpu_prefix_cache_hit_rate"  # V0
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"

EVICTION_PRESSURE_USAGE = 0.8
LOW_HIT_RATE = 0.5


class StatsError(RuntimeError):
    """The server could not be sampled; the message names the URL and what to check."""


@dataclass
class Scrape:
    time: float                       # monotonic seconds
    samples: dict[str, list[float]]  # sample name -> one value per label set
    tiers: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # sample name -> tier -> one value per label set


def metrics_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def parse_metrics(text: str) -> dict[str, list[float]]:
    return parse_scrape(text)[0]


def parse_scrape(text: str) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """Values by sample name, and those with a `tier` label (kvserve's offload tiers) by tier too
    (several values where several engines report: data-parallel replicas)."""
    out: dict[str, list[float]] = {}
    tiers: dict[str, dict[str, list[float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(float(s.value))
            if "tier" in s.labels:
                tiers.setdefault(s.name, {}).setdefault(s.labels["tier"], []).append(float(s.value))
    return out, tiers


def scrape(url: str, timeout: float) -> Scrape:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise StatsError(f"{url} answered HTTP {e.code}; is --url the server's base URL (e.g. http://127.0.0.1:8000)?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatsError(f"cannot reach {url} ({reason}); is the server running and --url right?") from None
    try:
        return Scrape(time.monotonic(), *parse_scrape(text))
    except ValueError as e:
        raise StatsError(f"{url} did not return Prometheus text ({e})") from None


@dataclass
class SeriesStats:
    mean: float
    p95: float
    max: float
    last: float


def series_stats(values: list[float]) -> SeriesStats | None:
    if not values:
        return None
    return SeriesStats(sum(values) / len(values), percentile(sorted(values), 95), max(values), values[-1])


def counter_increase(values: list[float]) -> float:
    """Increase over the window, treating a drop as a reset to zero (as Prometheus' increase())."""
    inc = 0.0
    for prev, cur in zip(values, values[1:]):
        inc += cur - prev if cur >= prev else cur
    return inc


@dataclass
class Verdict:
    level: str  # "warn" | "ok" | "info"
    message: str


@dataclass
class StatsReport:
    url: str
    samples: int
    failed_samples: int
    window_s: float
    kv_usage_metric: str | None
    kv_usage: SeriesStats | None
    prefix_hit_rate: float | None
    prefix_hit_rate_source: str | None  # "window" | "since start" | "gauge"
    prefix_queries_in_window: float | None
    preemptions_in_window: float | None
    preemptions_per_min: float | None
    running: SeriesStats | None
    waiting: SeriesStats | None
    verdicts: list[Verdict] = field(default_factory=list)


def series_values(scrapes: list[Scrape], name: str, combine=sum) -> list[float]:
    return [combine(s.samples[name]) for s in scrapes if s.samples.get(name)]


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(url: str, scrapes: list[Scrape], failed: int = 0, shared_prefix: bool = False) -> StatsReport:
    window = scrapes[-1].time - scrapes[0].time if len(scrapes) > 1 else 0.0
    usage_name = next((n for n in KV_USAGE if any(n in s.samples for s in scrapes)), None)
    # Several label sets (e.g. one per engine under data parallelism): usage is a fraction, so average.
    usage = series_stats(series_values(scrapes, usage_name, mean_of)) if usage_name else None
    hit_rate = source = queries = None
    for hits_name, queries_name in PREFIX_COUNTERS:
        hits, qs = series_values(scrapes, hits_name), series_values(scrapes, queries_name)
        if hits and qs and len(hits) == len(qs):
            queries = counter_increase(qs)
            if queries > 0:
                hit_rate, source = counter_increase(hits) / queries, "window"
            elif qs[-1] > 0:
                hit_rate, source = hits[-1] / qs[-1], "since start"
            break
    if hit_rate is None and (gauge := series_values(scrapes, PREFIX_HIT_RATE_GAUGE, mean_of)):
        hit_rate, source = mean_of(gauge), "gauge"
    pre = series_values(scrapes, PREEMPTIONS)
    pre_inc = counter_increase(pre) if pre else None
    report = StatsReport(
        url=url, samples=len(scrapes), failed_samples=failed, window_s=window, kv_usage_metric=usage_name,
        kv_usage=usage, prefix_hit_rate=hit_rate, prefix_hit_rate_source=source, prefix_queries_in_window=queries,
        preemptions_in_window=pre_inc,
        preemptions_per_min=(pre_inc * 60 / window) if (pre_inc is not None and window > 0) else None,
        running=series_stats(series_values(scrapes, RUNNING)), waiting=series_stats(series_values(scrapes, WAITING)))
    report.verdicts = verdicts(report, shared_prefix)
    return report


def verdicts(r: StatsReport, shared_prefix: bool) -> list[Verdict]:
    out = []
    if r.kv_usage is None:
        out.append(Verdict("info", f"no KV usage metric ({' / '.join(KV_USAGE)}) in /metrics"))
    elif r.kv_usage.p95 > EVICTION_PRESSURE_USAGE:
        out.append(Verdict("warn", f"eviction pressure: P95 KV usage {r.kv_usage.p95:.0%} > "
                                   f"{EVICTION_PRESSURE_USAGE:.0%}; cached prefixes are evicted early and new requests "
                                   "wait for blocks. Give the cache more memory (--gpu-memory-utilization, "
                                   "--kv-cache-memory), use --kv-cache-dtype fp8, or lower --max-model-len"))
    else:
        out.append(Verdict("ok", f"KV usage P95 {r.kv_usage.p95:.0%}: no eviction pressure"))
    if r.preemptions_in_window:
        out.append(Verdict("warn", f"preemptions rising: {r.preemptions_in_window:.0f} in {r.window_s:.1f} s "
                                   f"({r.preemptions_per_min:.1f}/min); --max-num-seqs admits more sequences than the "
                                   "KV cache can grow, so running requests are evicted and recomputed. Lower "
                                   "--max-num-seqs or give the cache more memory"))
    elif r.preemptions_in_window == 0:
        out.append(Verdict("ok", "no preemptions in the window"))
    if r.prefix_hit_rate is not None and r.prefix_hit_rate < LOW_HIT_RATE:
        advice = ("put the shared part (system prompt, tools, few-shot examples, documents) first and anything "
                  "that varies per request (dates, ids, user text) after it; one changed token ends the shared prefix")
        if shared_prefix:
            out.append(Verdict("warn", f"prefix hit rate {r.prefix_hit_rate:.0%} < {LOW_HIT_RATE:.0%} on a "
                                       f"shared-prompt workload: check prompt layout: {advice}"))
        else:
            out.append(Verdict("info", f"prefix hit rate {r.prefix_hit_rate:.0%}; if requests share prompts "
                                       f"(say so with --shared-prefix), check prompt layout: {advice}"))
    elif r.prefix_hit_rate is not None:
        out.append(Verdict("ok", f"prefix hit rate {r.prefix_hit_rate:.0%}"))
    return out


MAX_KEPT_SCRAPES = 3600  # --samples 0 runs until Ctrl-C; the window is then the last hour at 1 s


def sample(url: str, samples: int, interval: float, timeout: float, progress: bool = False,
           on_scrape=None) -> tuple[list[Scrape], int]:
    """Scrape `samples` times (0: until Ctrl-C), `interval` seconds apart. A failing first scrape
    aborts (wrong URL); later failures are counted and skipped (a busy server may miss one).
    `on_scrape(scrapes, failed, i)` runs after each attempt (the live view)."""
    scrapes: deque[Scrape] = deque(maxlen=MAX_KEPT_SCRAPES)
    failed = 0
    start = time.monotonic()
    i = 0
    try:
        while samples == 0 or i < samples:
            try:
                scrapes.append(scrape(url, timeout))
            except StatsError:
                if not scrapes:
                    raise
                failed += 1
            if progress:
                print(f"\rsampling {url}: {i + 1}/{samples or 'until Ctrl-C'}", end="", file=sys.stderr, flush=True)
            if on_scrape is not None:
                on_scrape(list(scrapes), failed, i)
            i += 1
            if samples == 0 or i < samples:
                time.sleep(max(0.0, start + i * interval - time.monotonic()))
    except KeyboardInterrupt:
        if not scrapes:
            raise
    if progress:
        print(file=sys.stderr)
    return list(scrapes), failed


def _fmt(s: SeriesStats | None, pct: bool) -> str:
    if s is None:
        return "n/a"
    f = (lambda v: f"{v:.1%}") if pct else (lambda v: f"{v:.1f}")
    return f"mean {f(s.mean)}  p95 {f(s.p95)}  max {f(s.max)}"


def format_report(r: StatsReport) -> str:
    hit = "n/a" if r.prefix_hit_rate is None else f"{r.prefix_hit_rate:.1%} ({r.prefix_hit_rate_source})"
    pre = ("n/a" if r.preemptions_in_window is None else
           f"{r.preemptions_in_window:.0f} in window" + (f", {r.preemptions_per_min:.1f}/min" if r.preemptions_per_min is not None else ""))
    lines = [f"kvserve stats: {r.url}: {r.samples} samples over {r.window_s:.1f} s"
             + (f" ({r.failed_samples} failed)" if r.failed_samples else ""),
             f"  KV usage          {_fmt(r.kv_usage, True)}" + (f"  [{r.kv_usage_metric}]" if r.kv_usage_metric else ""),
             f"  prefix hit rate   {hit}",
             f"  preemptions       {pre}",
             f"  running           {_fmt(r.running, False)}",
             f"  waiting           {_fmt(r.waiting, False)}", ""]
    lines += [f"  [{v.level}] {v.message}" for v in r.verdicts]
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("stats", help="sample a server's /metrics and judge its KV cache",
                              description="Poll /metrics of a kvserve or vLLM server and report KV usage, prefix "
                                          "hit rate, preemptions and queue depth, with verdicts.")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (/metrics is added; default: %(default)s, kvserve serve's own)")
    p.add_argument("--samples", type=int, default=10, help="scrapes to take (0: until Ctrl-C)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for one scrape")
    p.add_argument("--shared-prefix", action="store_true",
                   help="the workload shares prompt prefixes: a hit rate under 50%% becomes a warning")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-live", action="store_true", help="no live view on a terminal: the plain report only "
                   "(what a pipe or file gets anyway)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any verdict is a warning")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.samples < 0 or args.interval < 0 or args.timeout <= 0:
        print(f"kvserve stats: error: need --samples >= 0 (0: until Ctrl-C), --interval >= 0 and --timeout > 0 "
              f"(got {args.samples}, {args.interval}, {args.timeout})", file=sys.stderr)
        return 2
    url = metrics_url(args.url)
    # A terminal gets the live view; a pipe or file keeps the plain report, line for line.
    live = not args.json and not args.no_live and sys.stdout.isatty()
    try:
        if live:
            from kvserve.tools.stats_live import sample_live
            scrapes, failed = sample_live(url, args.samples, args.interval, args.timeout)
        else:
            scrapes, failed = sample(url, args.samples, args.interval, args.timeout,
                                     progress=not args.json and sys.stderr.isatty())
    except StatsError as e:
        print(f"kvserve stats: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    report = summarize(url, scrapes, failed, args.shared_prefix)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(format_report(report))
    return 1 if args.strict and any(v.level == "warn" for v in report.verdicts) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers())
    return run(parser.parse_args(["stats", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
