"""Live `stepserve serve` subprocesses on free ports, for tests of the service and of the
worker that need a real server (the fixtures that start them live in the conftests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    """A `stepserve serve` subprocess."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get_json(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_live_server(tmp: Path, *args: str, timeout: float = 240.0, compiled: bool = False,
                      env: dict[str, str] | None = None) -> LiveServer:
    """Start `stepserve serve` on a free port (its environment updated by `env`) and wait
    for /health 200. The forward runs eagerly unless `compiled` (building it takes a minute
    or two of the suite's two cores; the compiled path has its own end-to-end test)."""
    port = free_port()
    log_path = tmp / f"serve-{port}.log"
    eager = () if compiled else ("--enforce-eager",)
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--enable-debug-endpoints", *eager, *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = LiveServer(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if server.get_json("/health")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.log()}")
