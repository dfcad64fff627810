"""The cost of `kvserve stats`' live view: parsing one /metrics scrape and drawing one frame (which
re-summarizes the whole window) at 10, 600 and 3,600 kept scrapes (3,600: the cap under
`--samples 0`).

    curl -s http://127.0.0.1:8000/metrics > metrics.txt    # a server with its tiers configured
    python bench/stats_frame_cost.py --metrics metrics.txt [--repeat 20]

Prints a table; writes bench/results/stats_frame_cost.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

from rich.console import Console

from kvserve.tools.stats import Scrape, parse_scrape
from kvserve.tools.stats_live import live_figures, render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", required=True, help="a saved /metrics text")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    text = open(args.metrics, encoding="utf-8").read()
    t0 = time.perf_counter()
    for _ in range(args.repeat):
        samples, tiers = parse_scrape(text)
    parse_ms = (time.perf_counter() - t0) / args.repeat * 1e3
    rows = []
    with open(os.devnull, "w") as sink:
        console = Console(file=sink, width=110, force_terminal=True)
        for n in (10, 600, 3600):
            scrapes = [Scrape(float(i), dict(samples), dict(tiers)) for i in range(n)]
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                console.print(render("u", live_figures("u", scrapes), 0, 1.0))
            rows.append({"scrapes": n, "frame_ms": (time.perf_counter() - t0) / args.repeat * 1e3})
    print(f"parse one /metrics ({len(text):,} bytes): {parse_ms:.1f} ms")
    print(f"{'scrapes kept':>12} {'frame ms':>9}")
    for r in rows:
        print(f"{r['scrapes']:>12,} {r['frame_ms']:>9.1f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "stats_frame_cost.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "metrics_bytes": len(text),
                   "parse_ms": parse_ms, "frames": rows}, f, indent=2)


if __name__ == "__main__":
    main()
