"""The dashboard in a real browser: headless Chromium opens /dashboard on a server under load,
the page polls until its charts have updated, and the figures in its DOM match /metrics. The
screenshot it takes is the one in docs/ (copy it from the path the test prints)."""
from __future__ import annotations

import re
import shutil
import subprocess
import threading

import httpx
import pytest
from server_util import start_server, wait_until

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1400,1100"]


def chromium(url: str, profile, *args: str, budget_ms: int = 8000) -> subprocess.CompletedProcess:
    """One headless run: virtual time lets the page's timers (its 1.5 s polls) run `budget_ms`."""
    cmd = [shutil.which("chromium"), *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
           *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _attr(dom: str, element_id: str, attr: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*{attr}="([^"]*)"', dom) or \
        re.search(rf'{attr}="([^"]*)"[^>]*id="{element_id}"', dom)
    assert m, f"#{element_id} has no {attr} in the page"
    return m.group(1)


@pytest.mark.slow
@pytest.mark.needs("chromium")
def test_dashboard_in_headless_chromium_matches_metrics(tmp_path):
    server = start_server("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "96",
                          "--max-num-seqs", "4", "--disable-log-stats", "--disable-uvicorn-access-log")
    stop = threading.Event()

    def load(i: int):
        shared = "You are a helpful assistant that answers about the KV cache. " * 3
        while not stop.is_set():
            try:
                httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"prompt": shared + f"Question {i}: why?", "max_tokens": 96, "ignore_eos": True})
            except httpx.HTTPError:
                pass
    workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(3)]
    try:
        pin = httpx.post(f"{server.url}/v1/cache/pins", timeout=120,
                         json={"prompt": "A pinned system prompt that the dashboard shows in its own colour. " * 4})
        assert pin.status_code == 200, pin.text
        for w in workers:
            w.start()
        wait_until(lambda: server.metric("kvserve:kv_blocks_used") > 0, timeout=60, interval=0.2,
                   what="the workload to hold KV blocks")
        run = chromium(f"{server.url}/dashboard", tmp_path / "profile", "--dump-dom")
        assert run.returncode == 0, run.stderr[-2000:]
        dom = run.stdout
        metrics_usage = server.metric("vllm:gpu_cache_usage_perc")
        assert int(re.search(r'data-updates="(\d+)"', dom).group(1)) >= 2, "the page did not poll twice"
        assert int(_attr(dom, "blocks", "data-blocks_total")) == server.metric("kvserve:kv_blocks_total") == 96
        assert int(_attr(dom, "blocks", "data-blocks_pinned")) == server.metric("kvserve:kv_cache_pinned_blocks") > 0
        # usage moves as requests start and finish: within a quarter of the pool of /metrics' reading
        assert abs(float(_attr(dom, "kv-usage", "data-value")) - metrics_usage) <= 0.25
        assert float(_attr(dom, "kv-usage", "data-value")) > 0
        assert "Question" in dom or "helpful assistant" in dom, "no cached prefix in the tree"
        assert "<tr><td>" in dom, "no request rows"
        shot = tmp_path / "dashboard.png"
        run = chromium(f"{server.url}/dashboard", tmp_path / "profile2", f"--screenshot={shot}")
        assert run.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", run.stderr[-2000:]
        print(f"screenshot: {shot}")
    finally:
        stop.set()
        server.stop()
        for w in workers:
            w.join(timeout=30)
