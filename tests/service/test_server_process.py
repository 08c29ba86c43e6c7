"""The `stepserve serve` process: SIGTERM drains (in-flight work completes, new work gets
503, exit 0) and a dead worker makes the server exit non-zero. InstantRunner workers keep
these servers cheap."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

INSTANT_ARGS = ("--worker-runner", "worker.instant_runner:InstantRunner", "--kv-cache-memory", "512MiB")


def _open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first event: the request is running
    return conn, resp


def _events(resp: http.client.HTTPResponse) -> list[Any]:
    lines = [line for line in resp.read().decode().split("\n") if line.startswith("data: ")]
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines]


def _worker_pids(pid: int) -> list[int]:
    """Child processes of `pid` that run the spawned worker (not multiprocessing helpers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    out = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(child)
    return out


def test_sigterm_drains_in_flight_then_exits_0(tmp_path: Path, start_server: Any) -> None:
    server = start_server(tmp_path, *INSTANT_ARGS, "--shutdown-timeout", "60")
    # The client reads nothing more for now, so the stream's writes back up and it stays in flight.
    conn, resp = _open_stream(server.port, 8000)
    server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    status, body = server.get_json("/health")
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
        status, body = server.get_json("/health")
    assert status == 503 and body["status"] == "draining"
    new_code, new = _post(server.port, {"prompt": "hi", "max_tokens": 2})
    assert new_code == 503 and new["error"]["type"] == "service_unavailable_error"
    events = _events(resp)  # now read everything: the request completes in full
    conn.close()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(60) == 0, server.log()


def test_worker_death_exits_non_zero(tmp_path: Path, start_server: Any) -> None:
    server = start_server(tmp_path, *INSTANT_ARGS)
    (worker,) = _worker_pids(server.process.pid)
    os.kill(worker, signal.SIGKILL)
    assert server.process.wait(30) == 1, server.log()
    assert "worker process" in server.log() and "died" in server.log()


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()
