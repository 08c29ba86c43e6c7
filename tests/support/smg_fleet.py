"""Live processes for the router tests: `stepserve serve` replicas and an `smg launch`
router (SGLang's model gateway, PyPI `smg`) in front of them, and the readings the tests
compare: a replica's access-log lines and /metrics counters, the router's view of its
workers.

Each process runs in its own session, so a kill takes its whole process group (a replica's
worker process included) and nothing outlives a test. Readiness is polled with generous
time limits; no limit here is a performance threshold."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from live_servers import free_port

REPO = Path(__file__).resolve().parents[2]
# The instant stand-in at 10 ms a step (tests/support/standin_runners.py): long streams stay running.
INSTANT_REPLICA = ("--worker-runner", "standin_runners:PacedInstantRunner", "--kv-cache-memory", "512MiB")
# The default model as the suite's other live servers run it: no kernel probe, no compile.
REAL_REPLICA = ("--dtype", "float32", "--quantization", "none", "--enforce-eager", "--kv-cache-memory", "128MiB",
                "--max-num-seqs", "4")
# Short health and load intervals so the router notices a change within seconds.
ROUTER_FLAGS = ("--backend", "vllm", "--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
                "--health-failure-threshold", "1", "--health-success-threshold", "1",
                "--load-monitor-interval", "1", "--shutdown-grace-period-secs", "1")
_SAMPLE = re.compile(r"^(?P<name>[\w:]+)(?P<labels>\{.*\})? (?P<value>\S+)$", re.MULTILINE)
_ACCESS_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3}) ')


def _child_path() -> str:
    """PYTHONPATH for a replica: this folder first, so `standin_runners` imports there."""
    return os.pathsep.join(filter(None, (str(Path(__file__).parent), os.environ.get("PYTHONPATH"))))


def smg_executable() -> str | None:
    """The `smg` command of this interpreter's environment (or PATH), if installed."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


def http_json(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    """GET `url`: (status, parsed JSON body or None)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        with contextlib.suppress(ValueError):
            return exc.code, json.loads(body or b"null")
        return exc.code, None


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def wait_for(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if condition():
                return
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric `name` in a Prometheus page, over every label set
    that has `labels`."""
    total = 0.0
    for match in _SAMPLE.finditer(text):
        if match["name"] == name and all(f'{k}="{v}"' in (match["labels"] or "") for k, v in labels.items()):
            total += float(match["value"])
    return total


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group `process` leads, then reap it. Call once per process: its
    group id may be reused once it is reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@dataclass
class Replica:
    """One `stepserve serve` on a fixed loopback port; `start` again after a kill to restart
    it on the same port (each start writes a new log)."""

    port: int
    args: tuple[str, ...]
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Spawn the server; `wait_ready` waits for its /health."""
        self.starts += 1
        self.log_path = self.log_dir / f"replica-{self.port}-{self.starts}.log"
        cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-log-stats", *self.args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _child_path()})

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"replica on {self.port} exited with {self.process.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                if http_json(self.url + "/health", timeout=5)[0] == 200:
                    return
            time.sleep(0.25)
        raise RuntimeError(f"replica on {self.port} not healthy after {timeout:.0f} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the replica's process group: the server and its worker, as `kill -9` of a
        container does."""
        if self.process is not None:
            _kill_group(self.process)
            self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def access_count(self, method: str, path: str, status: str | None = None) -> int:
        """Requests in the current log's access lines whose path (query string dropped)
        is `path`, with `status` if given. A streamed response is logged when it ends."""
        count = 0
        for match in _ACCESS_LINE.finditer(self.log_path.read_text(errors="replace") if self.log_path else ""):
            if (match["method"] == method and match["path"].split("?")[0] == path
                    and (status is None or match["status"] == status)):
                count += 1
        return count

    def metric(self, name: str) -> float:
        return metric_sum(http_text(self.url + "/metrics"), name)


@dataclass
class Router:
    """An `smg launch` process in front of some replicas."""

    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path
    worker_urls: tuple[str, ...] = field(default=())
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, bool]:
        """Worker URL -> whether the router counts it healthy (GET /workers)."""
        return {w["url"]: bool(w["is_healthy"]) for w in http_json(self.url + "/workers")[1]["workers"]}

    def engine_loads(self) -> dict[str, dict[str, Any]]:
        """Worker URL -> the load the router last read from it (GET /get_loads)."""
        return {entry["worker"]: entry for entry in http_json(self.url + "/get_loads")[1].get("loads", [])}

    def worker_requests(self) -> dict[str, float]:
        """Worker URL -> requests the router has sent it (its `smg_worker_requests_total`)."""
        text = http_text(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return {url: metric_sum(text, "smg_worker_requests_total", worker=url) for url in self.worker_urls}

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))[-4000:]

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            _kill_group(self.process)


def start_router(smg: str, replicas: Iterable[Replica], policy: str, log_dir: Path, *extra: str,
                 timeout: float = 120.0) -> Router:
    """`smg launch` on free loopback ports, waited until every replica is registered healthy."""
    urls = tuple(r.url for r in replicas)
    port, metrics_port = free_port(), free_port()
    log_path = log_dir / f"smg-{policy}-{port}.log"
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics_port), "--worker-urls", *urls, "--policy", policy, *ROUTER_FLAGS, *extra]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(process, port, metrics_port, log_path, urls)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with {process.returncode}:\n{router.log()}")
        health = router.health()
        return len(health) == len(urls) and all(health.values())

    try:
        wait_for(ready, timeout, f"smg to register {len(urls)} healthy workers")
    except BaseException:
        router.stop()
        raise
    return router
