"""Clients that read slowly or not at all, over a raw TCP socket (no HTTP client library
buffering for them) against the app on a real listening socket: a stalled client is
aborted after the stall timeout and its KV freed; one that pauses for less keeps its
stream, with nothing lost."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import orjson
from aiohttp.client_exceptions import ClientConnectionResetError

from service.http.sse import DONE
from service.http.stall import GuardedWriter
from service.http.state import AppConfig

LONG = {"prompt": "Hello there", "max_tokens": 8000, "ignore_eos": True, "stream": True, "logprobs": 5}
# About 2 KB of event per token: no socket buffer can hold a whole 8000-token answer.
HEAVY = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8000, "ignore_eos": True, "stream": True,
         "logprobs": True, "top_logprobs": 20}


async def _open(host: str, port: int, body: dict[str, Any], path: str = "/v1/completions") -> tuple[socket.socket, bytes]:
    """Send the request from a socket with a tiny receive buffer; return it and what it
    received once the first SSE event has arrived (the request is running)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    payload = orjson.dumps(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    await loop.sock_sendall(sock, head + payload)
    got = b""
    while b"data: " not in got:
        got += await loop.sock_recv(sock, 4096)
    return sock, got


async def _read_all(sock: socket.socket, data: bytes = b"", pause_every: int = 0, pause: float = 0.0) -> bytes:
    """Read to the end of the chunked response (or the connection), pausing `pause` s
    after about every `pause_every` bytes."""
    loop, since_pause = asyncio.get_running_loop(), 0
    while True:
        try:
            chunk = await loop.sock_recv(sock, 65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
        since_pause += len(chunk)
        if pause_every and since_pause >= pause_every:
            since_pause = 0
            await asyncio.sleep(pause)
        if data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
            return data


async def _aborted_count(client: Any) -> float:
    text = await (await client.get("/metrics")).text()
    line = next(x for x in text.splitlines() if x.startswith("stepserve:request_success_total") and '"abort"' in x)
    return float(line.rsplit(" ", 1)[1])


async def test_client_that_stops_reading_is_aborted_and_its_kv_freed(make_client: Any, setup_cls: Any) -> None:
    # A buffer cap past the whole answer: only the stall watch can end this request early.
    setup = setup_cls(max_model_len=8192, kv_cache_memory=400 << 20, max_buffered_tokens=10_000)
    config = AppConfig(enable_debug_endpoints=True, stream_stall_timeout=0.5)
    async with make_client(setup=setup, config=config) as (client, state):
        sock, _ = await _open(client.host, client.port, HEAVY, "/v1/chat/completions")  # ... and never read again
        try:
            deadline = time.monotonic() + 60  # generous; the abort comes ~timeout after the buffer fills
            kv = await (await client.get("/debug/kv")).json()
            while kv["num_unfinished_streams"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                kv = await (await client.get("/debug/kv")).json()
            assert kv["num_unfinished_streams"] == 0 and state.stall_watch.num_stalled == 1
            while kv["num_running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                kv = await (await client.get("/debug/kv")).json()
            assert kv["num_free_blocks"] == kv["num_gpu_blocks"]
            assert await _aborted_count(client) == 1
            assert state.loaded is not None
            assert state.loaded.engine.metrics.generation_tokens._value.get() < 8000  # type: ignore[union-attr]
            # The server dropped the connection: what it had buffered ends without [DONE].
            rest = await asyncio.wait_for(_read_all(sock), 30)
            assert b"data: [DONE]" not in rest
        finally:
            sock.close()


async def test_client_pausing_for_less_than_the_timeout_gets_everything(make_client: Any, setup_cls: Any) -> None:
    setup = setup_cls(max_model_len=8192, kv_cache_memory=400 << 20)
    config = AppConfig(enable_debug_endpoints=True, stream_stall_timeout=30.0)
    async with make_client(setup=setup, config=config) as (client, state):
        body = {**LONG, "max_tokens": 3000}
        sock, first = await _open(client.host, client.port, body)
        try:
            await asyncio.sleep(0.3)  # the buffers fill; the engine runs ahead of this reader
            data = await asyncio.wait_for(_read_all(sock, first, pause_every=64 << 10, pause=0.1), 120)
        finally:
            sock.close()
        events = [orjson.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]
        tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert tokens == 3000 and data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert len(events) < tokens  # coalesced while it was not reading
        assert state.stall_watch.num_stalled == 0 and await _aborted_count(client) == 0


async def test_a_client_gone_by_the_final_write_is_not_a_server_error(
        make_client: Any, monkeypatch: Any, caplog: Any) -> None:
    """The connection closes after the last token's event, before `[DONE]` (a client that
    stops at `finish_reason`): the handler ends quietly, with no 500 and no error logged."""
    original = GuardedWriter.write

    async def write(self: GuardedWriter, data: bytes) -> None:
        if data == DONE:
            raise ClientConnectionResetError("Cannot write to closing transport")
        await original(self, data)

    monkeypatch.setattr(GuardedWriter, "write", write)
    async with make_client() as (client, state):
        body = {"model": "instant", "prompt": "hi", "max_tokens": 5, "ignore_eos": True, "stream": True}
        with caplog.at_level(logging.ERROR):
            resp = await client.post("/v1/completions", json=body)
            data = await resp.read()
        assert resp.status == 200 and b'"finish_reason":"length"' in data and DONE not in data
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert await _aborted_count(client) == 0  # it had finished; nothing to abort
