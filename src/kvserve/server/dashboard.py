"""GET /dashboard: a live page of the KV cache, served by kvserve itself (one static HTML file, no
build step, nothing loaded from elsewhere), and GET /dashboard/data, the JSON it polls.

Two sources, so that nobody watching costs nothing: per-step figures (usage per tier, hit rate,
preemptions, queue) are sampled here from the step events the metrics already receive, at most
every SAMPLE_S seconds into a ring buffer; what only the engine core knows (the block map, the
prefix tree, the request rows) is asked for with one `kv_snapshot` call per poll, between steps.
"""
from __future__ import annotations

import time
from collections import deque
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse

from kvserve.engine.outputs import sum_stats
from kvserve.server.auth import effective_cache_salt
from kvserve.server.protocol import APIError

SAMPLE_S = 0.5
WINDOW_S = 600.0
# query parameter -> (minimum, maximum, default)
PARAMS = {"since": (0.0, float("inf"), 0.0), "cells": (16, 16384, 1024), "top": (1, 32, 8), "engine": (0, 1, 1)}


class DashboardSeries:
    """Step listener: one sample of the step's stats every SAMPLE_S seconds at most (a comparison
    per step otherwise), the last WINDOW_S seconds kept."""

    def __init__(self, sample_s: float = SAMPLE_S, window_s: float = WINDOW_S):
        self.sample_s = sample_s
        self.samples: deque = deque(maxlen=int(window_s / sample_s))
        self._next = 0.0
        self._by_rank: dict[int, object] = {}  # each data-parallel replica's latest stats

    def __call__(self, event) -> None:
        if event.stats is not None:
            self._by_rank[event.rank] = event.stats
        if event.now < self._next or not self._by_rank:
            return
        self._next = event.now + self.sample_s
        s = sum_stats(list(self._by_rank.values()))
        tiers = dict(getattr(s, "tier_usage", {}) or {})
        self.samples.append((round(time.time(), 3), s.kv_usage, s.cached_usage, tiers, s.num_running, s.num_waiting,
                             s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions,
                             s.num_cached_block_evictions))

    def since(self, t: float) -> dict:
        """The samples after wall time `t`, as columns; hit rate and preemptions per interval."""
        rows = list(self.samples)
        out: dict = {"t": [], "device": [], "cached": [], "tiers": {}, "running": [], "waiting": [],
                     "hit_rate": [], "preemptions": [], "evictions": []}
        prev = None
        for row in rows:
            if row[0] > t:
                wall, usage, cached, tiers, running, waiting, q, h, pre, ev = row
                out["t"].append(wall)
                out["device"].append(usage)
                out["cached"].append(cached)
                for name in tiers:
                    out["tiers"].setdefault(name, [None] * (len(out["t"]) - 1))
                for name, col in out["tiers"].items():
                    col.append(tiers.get(name))
                out["running"].append(running)
                out["waiting"].append(waiting)
                dq = q - prev[6] if prev else 0
                out["hit_rate"].append((h - prev[7]) / dq if prev and dq > 0 else None)
                out["preemptions"].append(pre - prev[8] if prev else 0)
                out["evictions"].append(ev - prev[9] if prev else 0)
            prev = row
        return out


def parse_params(query) -> dict:
    """The validated query parameters; a 400 naming the parameter for anything else."""
    unknown = sorted(set(query) - set(PARAMS))
    if unknown:
        raise APIError(f"unknown query parameter `{unknown[0]}`; /dashboard/data takes {', '.join(PARAMS)}",
                       param=unknown[0])
    out = {}
    for name, (lo, hi, default) in PARAMS.items():
        raw = query.get(name)
        if raw is None:
            out[name] = default
            continue
        kind = float if isinstance(default, float) else int
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or value != value or not lo <= value <= hi:
            bounds = f"{lo}..{hi}" if hi != float("inf") else f">= {lo}"
            raise APIError(f"`{name}` must be {'a number' if kind is float else 'an integer'} in {bounds}; "
                           f"got {raw!r}", param=name)
        out[name] = value
    return out


def _page() -> str:
    return resources.files("kvserve.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def add_dashboard(app: FastAPI, llm, series: DashboardSeries, tenant, tokenizer) -> None:
    """Register GET /dashboard and GET /dashboard/data. `tenant` is the app's API-key dependency:
    the data is behind it; the page itself holds no data (it asks for a key when the data says 401)."""
    page = _page()

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request, who: str | None = Depends(tenant)):
        p = parse_params(request.query_params)
        s = llm.latest_stats
        lookups = s.prefix_cache_queries
        out = {"time": time.time(), "sample_s": series.sample_s, "window_s": series.sample_s * series.samples.maxlen,
               "now": {"kv_usage": s.kv_usage, "cached_usage": s.cached_usage, "blocks_total": s.num_blocks_total,
                       "blocks_used": s.num_blocks_used, "blocks_cached": s.num_blocks_cached,
                       "blocks_pinned": s.num_pinned_blocks,
                       "blocks_free": s.num_blocks_free, "running": s.num_running, "waiting": s.num_waiting,
                       "hit_rate": s.prefix_cache_hits / lookups if lookups else None,
                       "preemptions": s.num_preemptions, "evictions": s.num_cached_block_evictions,
                       "token_occupancy": s.token_occupancy, "tiers": dict(getattr(s, "tier_usage", {}) or {}),
                       "tier_used_bytes": dict(getattr(s, "tier_used_bytes", {}) or {})},
               "series": series.since(p["since"]), "engine": None}
        if p["engine"]:
            salt = effective_cache_salt(who, None)
            snap = await llm.acall("kv_snapshot", p["cells"], p["top"], salt)
            tree = snap.get("prefix_tree")
            if tree:
                stack = list(tree["prefixes"])
                while stack:
                    node = stack.pop()
                    node["text"] = tokenizer.decode(node.pop("token_ids"))
                    stack.extend(node["children"])
            out["engine"] = snap
        return out
