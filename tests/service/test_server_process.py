"""The `stepserve serve` process: SIGTERM drains (in-flight work completes, new work gets
503, exit 0; what outlives --shutdown-timeout is aborted, still exit 0), `kill -9` of the
worker ends every in-flight stream with an error event and the server exits non-zero, and
--stream-stall-timeout aborts a client that stops reading. InstantRunner workers keep
these servers cheap. Time bounds here are generous upper bounds on events (far above what
the code needs), never performance thresholds."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

INSTANT_ARGS = ("--worker-runner", "worker.execution.instant_runner:InstantRunner", "--kv-cache-memory", "512MiB")


def _open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first event: the request is running
    return conn, resp


class StreamReader(threading.Thread):
    """Reads one streamed completion as fast as it comes, timing each event."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, {**body, "stream": True}
        self.events: list[tuple[float, Any]] = []  # (monotonic arrival, event)
        self.running = threading.Event()  # the first event arrived

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp:
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    self.events.append((time.monotonic(), "[DONE]" if payload == b"[DONE]" else json.loads(payload)))
                    self.running.set()
        except OSError:
            pass  # the server went away; the events so far tell what happened
        finally:
            self.running.set()
            conn.close()

    def error_time(self) -> float | None:
        return next((t for t, e in self.events if isinstance(e, dict) and "error" in e), None)

    def last_choice(self) -> dict[str, Any]:
        return next(e for _, e in reversed(self.events) if isinstance(e, dict) and e.get("choices"))["choices"][0]


def _start_readers(port: int, count: int, max_tokens: int) -> list[StreamReader]:
    readers = [StreamReader(port, {"prompt": f"Hello {i}", "max_tokens": max_tokens, "ignore_eos": True})
               for i in range(count)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.running.wait(60) and reader.events, "a stream did not start"
    return readers


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


def test_sigterm_drains_several_streams_and_exits_0(tmp_path: Path, start_server: Any) -> None:
    server = start_server(tmp_path, *INSTANT_ARGS, "--shutdown-timeout", "120")
    readers = _start_readers(server.port, 4, 2000)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(120) == 0, server.log()
    for reader in readers:
        reader.join(30)
        assert reader.events[-1][1] == "[DONE]"
        assert reader.last_choice()["finish_reason"] == "length"


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path: Path, start_server: Any) -> None:
    """8000 tokens per stream take seconds even on the instant worker; after a 1 s drain
    they are aborted: each stream still ends properly, and the server exits 0."""
    server = start_server(tmp_path, "--worker-runner", "worker.execution.instant_runner:InstantRunner",
                          "--kv-cache-memory", "2GiB", "--shutdown-timeout", "1")
    readers = _start_readers(server.port, 3, 8000)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.log()
    assert time.monotonic() - signalled < 30  # generous: a 1 s drain plus the shutdown
    for reader in readers:
        reader.join(30)
        assert reader.events[-1][1] == "[DONE]"
        assert reader.last_choice()["finish_reason"] == "abort"
    assert "shutdown timeout: aborted" in server.log()


def test_worker_death_exits_non_zero(tmp_path: Path, start_server: Any) -> None:
    server = start_server(tmp_path, *INSTANT_ARGS)
    (worker,) = _worker_pids(server.process.pid)
    os.kill(worker, signal.SIGKILL)
    assert server.process.wait(30) == 1, server.log()
    assert "worker process" in server.log() and "died" in server.log()


def test_kill_9_of_the_worker_ends_every_stream_with_an_error(tmp_path: Path, start_server: Any) -> None:
    """Each in-flight stream gets an error event naming the dead worker, long before any
    stall timeout could have ended it (the code needs well under a second; the bound
    asserted is generous), then [DONE]; the server exits 1 for its supervisor."""
    server = start_server(tmp_path, *INSTANT_ARGS, "--stream-stall-timeout", "600")
    readers = _start_readers(server.port, 4, 8000)
    (worker,) = _worker_pids(server.process.pid)
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    assert server.process.wait(60) == 1, server.log()
    for reader in readers:
        reader.join(30)
        error_at = reader.error_time()
        assert error_at is not None, reader.events[-3:]
        assert error_at - killed < 15
        error = next(e for _, e in reader.events if isinstance(e, dict) and "error" in e)["error"]
        assert "died" in error["message"] and set(error) == {"message", "type", "param", "code"}
        assert reader.events[-1][1] == "[DONE]"


def test_stream_stall_timeout_flag_aborts_a_client_that_stops_reading(tmp_path: Path, start_server: Any) -> None:
    server = start_server(tmp_path, *INSTANT_ARGS, "--stream-stall-timeout", "1")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000, "ignore_eos": True,
                       "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b"data: " not in got:  # running; then this client reads nothing more
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        deadline = time.monotonic() + 60
        while "stopped reading" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "stopped reading for over 1 s" in server.log()
        kv = server.get_json("/debug/kv")[1]
        while kv["num_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
            kv = server.get_json("/debug/kv")[1]
        assert kv["num_unfinished_streams"] == 0 and kv["num_free_blocks"] == kv["num_gpu_blocks"]


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()
