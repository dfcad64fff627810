"""`kvserve stats` on a terminal: one compact frame redrawn after every scrape (rich), instead of
waiting for the report. The figures come from the same scrapes the report summarizes."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.tools.stats import (KV_USAGE, RUNNING, WAITING, Scrape, counter_increase, mean_of, sample, series_values,
                                 summarize)

CACHED_USAGE = "kvserve:kv_cached_usage_perc"  # device blocks held only by the prefix cache (evictable)
TIER_USAGE, TIER_USED_BYTES = "kvserve:kv_tier_usage_perc", "kvserve:kv_tier_used_bytes"
PROMPT_TOKENS, GENERATION_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
TIER_ORDER = ("host", "disk", "redis")
BAR_WIDTH = 28
WARN_USAGE, ALERT_USAGE = 0.8, 0.9  # stats' eviction-pressure verdict; the shipped alert rule's threshold


@dataclass
class TierFigure:
    name: str
    usage: float | None            # 0..1 of capacity (None: not exported)
    used_bytes: float | None = None
    cached: float | None = None    # device only: the evictable share of `usage`'s pool


@dataclass
class LiveFigures:
    samples: int
    failed: int
    window_s: float
    tiers: list[TierFigure] = field(default_factory=list)
    hit_rate: float | None = None           # over the window
    hit_rate_last: float | None = None      # over the last interval
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None        # in the window
    preemptions_per_min: float | None = None
    generation_tps: float | None = None     # output tokens/s over the last interval
    prompt_tps: float | None = None


def _last(scrapes: list[Scrape], name: str, combine=sum) -> float | None:
    values = series_values(scrapes, name, combine)
    return values[-1] if values else None


def _rate_last(scrapes: list[Scrape], name: str) -> float | None:
    """Per second between the last two scrapes that have the counter."""
    have = [s for s in scrapes if s.samples.get(name)]
    if len(have) < 2 or have[-1].time <= have[-2].time:
        return None
    return counter_increase([sum(have[-2].samples[name]), sum(have[-1].samples[name])]) / (have[-1].time - have[-2].time)


def live_figures(url: str, scrapes: list[Scrape], failed: int = 0) -> LiveFigures:
    report = summarize(url, scrapes, failed)
    usage_name = report.kv_usage_metric or KV_USAGE[0]
    tiers = [TierFigure("device", _last(scrapes, usage_name, mean_of), cached=_last(scrapes, CACHED_USAGE, mean_of))]
    last = scrapes[-1] if scrapes else None
    if last is not None:
        usage, used = last.tiers.get(TIER_USAGE, {}), last.tiers.get(TIER_USED_BYTES, {})
        # Several engines: usage is a fraction of each one's tier, so average; bytes add up.
        for name in sorted(usage, key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER), t)):
            tiers.append(TierFigure(name, mean_of(usage[name]), sum(used[name]) if name in used else None))
    hit_last = None
    hits, queries = (_rate_last(scrapes, "vllm:prefix_cache_hits_total"),
                     _rate_last(scrapes, "vllm:prefix_cache_queries_total"))
    if hits is not None and queries:
        hit_last = hits / queries
    return LiveFigures(samples=report.samples, failed=failed, window_s=report.window_s, tiers=tiers,
                       hit_rate=report.prefix_hit_rate, hit_rate_last=hit_last, running=_last(scrapes, RUNNING),
                       waiting=_last(scrapes, WAITING), preemptions=report.preemptions_in_window,
                       preemptions_per_min=report.preemptions_per_min,
                       generation_tps=_rate_last(scrapes, GENERATION_TOKENS),
                       prompt_tps=_rate_last(scrapes, PROMPT_TOKENS))


def _bar(frac: float, cached: float | None = None):
    """A fixed-width bar: in use (coloured by the verdict thresholds), then cached, then free."""
    from rich.text import Text

    frac = min(max(frac, 0.0), 1.0)
    used = round(frac * BAR_WIDTH)
    held = min(BAR_WIDTH - used, round(min(max(cached or 0.0, 0.0), 1.0) * BAR_WIDTH))
    colour = "red" if frac >= ALERT_USAGE else "yellow" if frac >= WARN_USAGE else "green"
    return Text.assemble(("█" * used, colour), ("▒" * held, "cyan"), ("·" * (BAR_WIDTH - used - held), "grey50"))


def _bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _num(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def render(url: str, f: LiveFigures, samples_asked: int, interval: float):
    """One frame: KV usage per tier with bars, then hit rate, queue, preemptions and throughput."""
    from rich.panel import Panel
    from rich.table import Table

    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold", min_width=16)
    t.add_column()
    t.add_column(justify="right", min_width=7)
    t.add_column(style="grey50", min_width=28)  # a steady frame width as figures change
    for tier in f.tiers:
        if tier.usage is None:
            t.add_row(f"KV {tier.name}", "", "n/a", "")
            continue
        note = _bytes(tier.used_bytes)
        if tier.cached is not None:
            note = f"+ {tier.cached:.1%} cached (evictable)"
        t.add_row(f"KV {tier.name}", _bar(tier.usage, tier.cached), f"{tier.usage:.1%}", note)
    t.add_row("", "", "", "")
    hit = _pct(f.hit_rate) + (f"  (last {interval:g} s: {_pct(f.hit_rate_last)})" if f.hit_rate_last is not None else "")
    t.add_row("prefix hit rate", hit, "", "")
    t.add_row("running/waiting", f"{_num(f.running)} / {_num(f.waiting)}", "", "")
    pre = _num(f.preemptions) + (f" in window, {f.preemptions_per_min:.1f}/min"
                                 if f.preemptions_per_min is not None else "")
    t.add_row("preemptions", pre, "", "")
    t.add_row("throughput", f"{_num(f.generation_tps, '{:,.1f}')} output tok/s, "
                            f"{_num(f.prompt_tps, '{:,.1f}')} prompt tok/s", "", "")
    of = f"/{samples_asked}" if samples_asked else " (Ctrl-C ends)"
    failed = f", {f.failed} failed" if f.failed else ""
    return Panel(t, title=f"kvserve stats: {url}", title_align="left",
                 subtitle=f"sample {f.samples}{of} over {f.window_s:.1f} s{failed}", subtitle_align="right",
                 expand=False)


def sample_live(url: str, samples: int, interval: float, timeout: float, console=None) -> tuple[list[Scrape], int]:
    """stats.sample with a frame redrawn after each scrape; the last frame stays on screen."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    with Live(console=console, auto_refresh=False, transient=False) as live:
        def show(scrapes, failed, _i):
            if scrapes:
                live.update(render(url, live_figures(url, scrapes, failed), samples, interval), refresh=True)

        return sample(url, samples, interval, timeout, on_scrape=show)
