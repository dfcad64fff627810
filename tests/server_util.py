"""Start the real server (`python -m kvserve serve ...`) as a subprocess on 127.0.0.1 and a free port.

Servers are shared per configuration across test modules (starting one loads the model: ~20 s on
two CPU cores) and stopped at the end of the session by the fixtures' finalizers.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
from helpers import free_port, wait_until  # noqa: F401 (wait_until: the tests' import)

# float32: greedy output must not depend on whether a prompt hit the prefix cache (in bfloat16 a
# one-token prefill and a full prefill round differently, so near-ties can flip).
SMALL = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "256MiB"]
# The server most tests share: small model budget, a 1 MiB body limit to test 413 cheaply.
MAIN_ARGS = [*SMALL, "--max-request-body-bytes", "1MiB", "--disable-log-stats"]
STARTUP_TIMEOUT_S = 240.0
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen
    log_path: str
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: `name{labels}` -> value (first sample per series)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return parse_metrics(text)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return metric_value(self.metrics(), name, **labels)

    def children(self) -> list[int]:
        """PIDs of the server's child processes (the engine core)."""
        return child_pids(self.proc.pid)

    def stop(self) -> None:
        children = self.children() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in children:  # the core exits with its parent; never leave one behind
            if not wait_gone(pid, 10):
                os.kill(pid, signal.SIGKILL)
                wait_gone(pid, 10)


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def wait_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (or is a zombie), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def open_request(url: str, path: str, body: dict, timeout: float = 60.0) -> socket.socket:
    """POST `body` as JSON to `url + path` on a connection of its own and return the socket without
    reading the answer: closing it is a client disconnect at a moment the test chooses."""
    host, _, port = url.removeprefix("http://").partition(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def metric_value(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` in a parse_metrics() result whose labels include `labels`."""
    total, found = 0.0, False
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            found = True
    if not found:
        raise KeyError(f"metric {name}{labels} not in /metrics")
    return total


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def start_server(*args: str, timeout: float = STARTUP_TIMEOUT_S, env: dict | None = None) -> ServerHandle:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvserve-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kvserve", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    # The checkout's src/ first, as pytest's pythonpath does for the tests: never an installed copy.
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **(env or {}))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log.name, list(args))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during startup:\n{handle.log()[-4000:]}")
        try:
            if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    handle.stop()
    raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{handle.log()[-4000:]}")


_SERVERS: dict[tuple[str, ...], ServerHandle] = {}


def shared_server(request, *args: str) -> ServerHandle:
    """The running server for these args, started on first use; stopped when the session ends."""
    key = tuple(args)
    handle = _SERVERS.get(key)
    if handle is None or handle.proc.poll() is not None:
        handle = _SERVERS[key] = start_server(*args)

        def stop() -> None:
            _SERVERS.pop(key, None)
            handle.stop()

        request.addfinalizer(stop)  # call from a session-scoped fixture so modules share it
    return handle
