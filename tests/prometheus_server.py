"""A real Prometheus server for tests: 127.0.0.1, a free port, its own config and data dir.

It scrapes the given targets every second and evaluates the given rule files every second; the
tests read its HTTP API (/api/v1/alerts, /api/v1/query). Stopped by PID. Install it with
`.ci/install_observability.sh` (Debian package `prometheus`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import httpx
import yaml
from helpers import free_port, terminate


class PrometheusServer:
    def __init__(self, targets: list[str], rule_files: list[str], *, metrics_path: str = "/metrics"):
        self.binary = shutil.which("prometheus")
        if self.binary is None:
            raise RuntimeError("prometheus is not installed; run .ci/install_observability.sh "
                               "(apt-get install -y prometheus)")
        self.port = free_port()
        self.workdir = tempfile.mkdtemp(prefix="kvserve-prometheus-")
        self.config = os.path.join(self.workdir, "prometheus.yml")
        with open(self.config, "w") as f:
            yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                            "rule_files": rule_files,
                            "scrape_configs": [{"job_name": "kvserve", "metrics_path": metrics_path,
                                                "static_configs": [{"targets": targets}]}]}, f)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.workdir, "prometheus.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "PrometheusServer":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir}/data",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready on port {self.port} within {timeout}s: {self.log()[-3000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def api(self, path: str, **params) -> dict:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5).json()
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def stop(self) -> None:
        terminate(self.proc, 10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
