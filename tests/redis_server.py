"""A real redis-server for tests: 127.0.0.1, a free port, a temp dir, no persistence.

`kill()` simulates a crash (SIGKILL) and `start()` brings it back on the same port, which is how
the fault tests take Redis away mid-run and return it. Install the server with
`.ci/install_redis.sh` (Debian package `redis-server`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from helpers import free_port, terminate


class RedisServer:
    def __init__(self, port: int | None = None, binary: str | None = None):
        self.binary = binary or shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed; run .ci/install_redis.sh "
                               "(apt-get install -y redis-server)")
        self.port = port or free_port()
        self.workdir = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> str:
        return os.path.join(self.workdir, "redis.log")

    def start(self, timeout: float = 10.0) -> "RedisServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.workdir,
             "--save", "", "--appendonly", "no", "--logfile", self.logfile, "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self._log_tail()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout}s: "
                           f"{self._log_tail()}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Crash it: SIGKILL, no shutdown handshake, clients see resets / refused connections."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        terminate(self.proc, 5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log_tail(self) -> str:
        try:
            with open(self.logfile) as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"
