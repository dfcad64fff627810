"""Summaries, the text report and the optional PNG plot of a `kvserve bench serve` run."""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvserve.tools.plotting import pyplot


@dataclass
class Latency:
    """Milliseconds; percentiles interpolate linearly (numpy's default, as vLLM's benchmark)."""
    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float


def latency(values_s: list[float]) -> Latency | None:
    if not values_s:
        return None
    a = np.asarray(values_s, dtype=float) * 1000
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return Latency(len(a), float(a.mean()), float(p50), float(p95), float(p99), float(a.max()))


@dataclass
class BenchReport:
    url: str
    model: str
    workload: str
    load: str                  # "closed loop, concurrency N" | "open loop, Poisson R/s"
    duration_s: float
    completed: int
    errors: int
    error_examples: list[str]  # most frequent messages, with counts
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float   # output tokens / s
    total_token_throughput: float
    ttft_ms: Latency | None
    tpot_ms: Latency | None
    itl_ms: Latency | None
    e2e_ms: Latency | None
    output_tokens_per_second_over_time: list[float] = field(default_factory=list)  # 1 s bins from the start
    notes: list[str] = field(default_factory=list)
    request_rate: float | None = None  # open loop: the offered conversations/s


def summarize(records, duration_s: float, *, url: str, model: str, workload: str, load: str,
              notes: list[str], request_rate: float | None = None) -> BenchReport:
    ok = [r for r in records if r.error is None]
    bad = [r for r in records if r.error is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    bins = [0.0] * max(1, math.ceil(duration_s))
    for r in ok:
        for t, n in zip(r.chunk_times, r.chunk_tokens):
            bins[min(int(t), len(bins) - 1)] += n
    d = max(duration_s, 1e-9)
    examples = [f"{n} x {msg}" for msg, n in Counter(r.error for r in bad).most_common(3)]
    return BenchReport(
        url=url, model=model, workload=workload, load=load, duration_s=duration_s, completed=len(ok), errors=len(bad),
        error_examples=examples, input_tokens=in_tokens, output_tokens=out_tokens, request_throughput=len(ok) / d,
        output_throughput=out_tokens / d, total_token_throughput=(in_tokens + out_tokens) / d,
        ttft_ms=latency([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=latency([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=latency([x for r in ok for x in r.itl]),
        e2e_ms=latency([r.e2e for r in ok if r.e2e is not None]),
        output_tokens_per_second_over_time=bins, notes=list(notes), request_rate=request_rate)


def format_report(r: BenchReport) -> str:
    lines = [f"kvserve bench serve: {r.url} ({r.model})", f"  workload   {r.workload}", f"  load       {r.load}", "",
             f"  duration            {r.duration_s:10.2f} s",
             f"  completed requests  {r.completed:10,}",
             f"  failed requests     {r.errors:10,}",
             f"  input tokens        {r.input_tokens:10,}",
             f"  output tokens       {r.output_tokens:10,}",
             f"  request throughput  {r.request_throughput:10.2f} req/s",
             f"  output throughput   {r.output_throughput:10.1f} tok/s",
             f"  total throughput    {r.total_token_throughput:10.1f} tok/s", "",
             f"  {'ms':<6}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}"]
    for name, s in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E", r.e2e_ms)):
        if s is None:
            lines.append(f"  {name:<6}{'n/a':>10}")
        else:
            lines.append(f"  {name:<6}{s.mean:>10.1f}{s.p50:>10.1f}{s.p95:>10.1f}{s.p99:>10.1f}{s.max:>10.1f}")
    if r.error_examples:
        lines += ["", "Errors:"] + [f"  {e}" for e in r.error_examples]
    lines += [""] + [f"NOTE: {n}" for n in r.notes]
    return "\n".join(lines).rstrip()


def format_sweep(reports: list[BenchReport]) -> str:
    """One line per offered rate: what came out, and what waiting for it cost."""
    def p(s: Latency | None, q: str) -> str:
        return f"{getattr(s, q):>9.1f}" if s is not None else f"{'n/a':>9}"

    lines = ["Sweep over --request-rate (conversations/s)",
             f"  {'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} "
             f"{'ITL p99':>9} {'E2E p99':>9} {'failed':>7}"]
    for r in reports:
        lines.append(f"  {r.request_rate:>6g} {r.request_throughput:>7.2f} {r.output_throughput:>10.1f} "
                     f"{p(r.ttft_ms, 'p50')} {p(r.ttft_ms, 'p99')} {p(r.itl_ms, 'p50')} {p(r.itl_ms, 'p99')} "
                     f"{p(r.e2e_ms, 'p99')} {r.errors:>7}")
    return "\n".join(lines)


def plot_sweep(reports: list[BenchReport], path: str) -> list[tuple[str, list, list]]:
    """Per-rate curves: throughput and latency percentiles against the offered rate; returns what
    was drawn, (label, rates, values) per line."""
    plt = pyplot()
    import matplotlib.ticker

    rates = [r.request_rate for r in reports]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(rates, [r.output_throughput for r in reports], marker="o", label="output tok/s")
    for r in reports:  # with fixed output lengths a req/s line would only retrace this one
        left.annotate(f"{r.request_throughput:.2f} req/s", (r.request_rate, r.output_throughput),
                      xytext=(6, -4), textcoords="offset points", fontsize=8, color="gray", va="top")
    left.margins(x=0.2, y=0.1)
    left.set(xlabel="offered rate (conversations/s)", ylabel="output tokens / s", title="Throughput")
    left.grid(True, alpha=0.3)
    for name, attr in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        for q, style in (("p50", "-"), ("p99", ":")):
            values = [getattr(getattr(r, attr), q) if getattr(r, attr) else float("nan") for r in reports]
            right.plot(rates, values, marker="o", linestyle=style, label=f"{name} {q}",
                       color={"TTFT": "C0", "ITL": "C2", "E2E": "C3"}[name])
    right.set(yscale="log", xlabel="offered rate (conversations/s)", ylabel="latency (ms)", title="Latency")
    if max(rates) >= 8 * min(rates):  # a geometric sweep reads best on a log axis
        for ax in (left, right):
            ax.set_xscale("log")
            ax.set_xticks(rates, [f"{x:g}" for x in rates])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8, ncol=3)
    first = reports[0]
    workload = re.sub(r", Poisson [^,]*", "", first.workload)  # each run's own rate; the x axis has them
    fig.suptitle(f"{first.model}: {workload}; {sum(r.completed for r in reports)} requests, "
                 f"{sum(r.errors for r in reports)} errors", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    drawn = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
             for ax in (left, right) for line in ax.get_lines()]
    plt.close(fig)
    return drawn


def plot(report: BenchReport, records, path: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and output tokens/s over time, one PNG."""
    plt = pyplot()
    import matplotlib.ticker

    ok = [r for r in records if r.error is None]
    series = {"TTFT": [r.ttft for r in ok if r.ttft is not None], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [x for r in ok for x in r.itl], "E2E": [r.e2e for r in ok if r.e2e is not None]}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in series.items():
        if values:
            v = np.sort(np.asarray(values) * 1000)
            axes[0].plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{name} (p99 {np.percentile(v, 99):.0f} ms)")
    axes[0].set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests / gaps", title="Latency CDF")
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # log-axis minor labels collide
    axes[0].grid(True, which="both", alpha=0.3)
    if axes[0].get_lines():  # none when every request failed
        axes[0].legend()
    bins = report.output_tokens_per_second_over_time
    axes[1].plot(np.arange(len(bins)) + 0.5, bins, drawstyle="steps-mid")
    axes[1].axhline(report.output_throughput, linestyle="--", color="gray",
                    label=f"mean {report.output_throughput:.0f} tok/s")
    axes[1].set(xlabel="time since start (s)", ylabel="output tokens / s", title="Throughput over time")
    axes[1].grid(True, alpha=0.3)
    axes[1].legend()
    fig.suptitle(f"{report.model}: {report.load}; {report.completed} requests, {report.errors} errors", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
