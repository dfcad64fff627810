"""deploy/grafana: vLLM's example layout plus the KV cache panels; every query names only metrics
kvserve exports and is PromQL a real Prometheus accepts."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from metric_names import exported_names, promql_metric_names
from prometheus_server import PrometheusServer

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "kvserve-dashboard.json"
# vLLM's examples/online_serving/prometheus_grafana/grafana.json panels, which this one keeps
VLLM_PANELS = {"E2E Request Latency", "Token Throughput", "Time Per Output Token Latency", "Scheduler State",
               "Time To First Token Latency", "Cache Utilization", "Request Prompt Length",
               "Request Generation Length", "Finish Reason", "Queue Time", "Requests Prefill and Decode Time",
               "Max Generation Token in Sequence Group"}


def _panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def _queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]


def test_every_query_names_only_exported_metrics():
    exported = exported_names()
    for title, expr in _queries():
        names = promql_metric_names(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        assert names <= exported, f"panel {title!r} reads {names - exported}, which kvserve does not export"


def test_layout_is_vllms_grid_plus_cache_and_tier_panels():
    panels = _panels()
    titles = {p["title"] for p in panels}
    assert VLLM_PANELS <= titles
    assert {"KV Blocks by State", "Prefix Cache Hit Rate", "Evictions and Preemptions", "KV Tier Usage",
            "KV Tier Faults"} <= titles
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    assert {v["name"] for v in doc["templating"]["list"]} == {"DS_PROMETHEUS", "model_name"}


@pytest.mark.needs("prometheus")
def test_every_query_is_promql_prometheus_accepts():
    with PrometheusServer([], []) as prom:
        for title, expr in _queries():
            concrete = expr.replace("$__rate_interval", "1m").replace("$model_name", "m")
            r = httpx.get(f"{prom.url}/api/v1/query", params={"query": concrete}, timeout=10)
            assert r.status_code == 200, f"panel {title!r}: {r.json().get('error')}"
