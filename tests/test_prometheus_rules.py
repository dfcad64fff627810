"""deploy/prometheus: the rules read only metrics kvserve exports, each alert says which flag to
change, promtool's unit tests pass on synthetic series, and a real Prometheus scraping a real
server fires the KV-usage alert under a workload built to exceed it."""
from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from metric_names import exported_names, promql_metric_names
from prometheus_server import PrometheusServer
from server_util import start_server, wait_until

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = DEPLOY / "kvserve-rules.yml"
RULE_TESTS = DEPLOY / "kvserve-rules.test.yml"


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_rules_read_only_metrics_kvserve_exports():
    exported = exported_names()
    recorded = {r["record"] for r in _rules() if "record" in r}
    for rule in _rules():
        unknown = promql_metric_names(rule["expr"]) - exported - recorded
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads {unknown}, which kvserve does not export"


def test_every_alert_summary_names_a_serve_flag():
    import argparse

    from kvserve.cli import build_parser
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = {s for action in serve._actions for s in action.option_strings}
    alerts = [r for r in _rules() if "alert" in r]
    assert len(alerts) >= 5
    for rule in alerts:
        named = set(re.findall(r"--[a-z][a-z0-9-]+", rule["annotations"]["summary"]))
        assert named, f"{rule['alert']}'s summary names no flag to change"
        assert named <= flags, f"{rule['alert']} names {named - flags}, not flags of kvserve serve"


@pytest.mark.needs("promtool")
def test_rules_pass_promtool_check_and_unit_tests():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run(["promtool", "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                            timeout=120, cwd=DEPLOY)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # every alert has at least one unit test that expects it to fire
    tested_alerts = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert {r["alert"] for r in _rules() if "alert" in r} <= tested_alerts


@pytest.mark.slow
@pytest.mark.needs("prometheus")
def test_real_prometheus_fires_the_kv_usage_alert_on_a_full_pool(tmp_path):
    # The shipped rules, with the usage alert's 5 minutes shortened to 3 seconds.
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "KVServeKVCacheNearlyFull":
                rule["for"] = "3s"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc))
    # 16 blocks of 64 tokens: a request's ~910-token prompt alone holds 15 of them (> 90 %) from
    # its prefill to its end, and the next one starts from the cached prefix, so usage stays high
    # for seconds, not only for the last tokens of each request.
    server = start_server("--max-model-len", "1024", "--block-size", "64", "--num-gpu-blocks-override", "16",
                          "--max-num-seqs", "2", "--disable-log-stats", "--disable-uvicorn-access-log")
    stop = threading.Event()

    def load():
        while not stop.is_set():
            try:
                httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"prompt": "the cache is full " * 227, "max_tokens": 60, "ignore_eos": True})
            except httpx.HTTPError:
                pass
    workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    try:
        with PrometheusServer([server.url.removeprefix("http://")], [str(rules)]) as prom:
            for w in workers:
                w.start()

            def firing():
                return [a for a in prom.alerts()
                        if a["labels"]["alertname"] == "KVServeKVCacheNearlyFull" and a["state"] == "firing"]
            alerts = wait_until(firing, timeout=120, interval=0.5, what="KVServeKVCacheNearlyFull to fire")
            assert float(alerts[0]["value"]) > 0.9
            assert "--kv-cache-memory" in alerts[0]["annotations"]["summary"]
            # the scraped series it fired on is the server's own gauge
            usage = prom.api("query", query="max_over_time(vllm:gpu_cache_usage_perc[1m])")["result"]
            assert usage and float(usage[0]["value"][1]) > 0.9
            assert all(a["labels"]["alertname"] != "KVServeTierFailing" for a in prom.alerts())
    finally:
        stop.set()
        server.stop()  # ends the requests in flight, so the workers return at once
        for w in workers:
            w.join(timeout=30)
