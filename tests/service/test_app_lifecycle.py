"""Start-up, auth, overload, client disconnect, worker death and draining, in-process over
InstantRunner workers (real worker processes, no model)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer

from service.http.app import create_app
from service.http.state import STATE, AppConfig, LoadedEngine, Status

LONG = {"prompt": "Hello there", "max_tokens": 8000, "ignore_eos": True, "stream": True}


async def _first_event(resp: Any) -> dict[str, Any]:
    """Read SSE lines until the first data event."""
    assert resp.status == 200, await resp.text()
    while True:
        line = (await resp.content.readline()).strip()
        if line.startswith(b"data: "):
            return orjson.loads(line[6:])


async def _rest_events(resp: Any) -> list[Any]:
    text = (await resp.content.read()).decode()
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out


async def test_health_is_503_until_the_engine_is_ready(engine_factory: Any) -> None:
    release = asyncio.Event()
    real = engine_factory()

    async def gated() -> LoadedEngine:
        await release.wait()
        return await real()

    app = create_app(AppConfig(), gated)
    async with TestClient(TestServer(app)) as client:
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "starting"
        resp = await client.post("/v1/completions", json={"prompt": "hi"})
        assert resp.status == 503 and (await resp.json())["error"]["type"] == "service_unavailable_error"
        release.set()
        await asyncio.wait_for(app[STATE].ready.wait(), 60)
        assert (await client.get("/health")).status == 200


async def test_failed_start_is_fatal() -> None:
    async def broken() -> LoadedEngine:
        raise RuntimeError("no such model")

    app = create_app(AppConfig(), broken)
    async with TestClient(TestServer(app)) as client:
        await asyncio.wait_for(app[STATE].fatal.wait(), 10)
        health = await client.get("/health")
        assert health.status == 503
        assert "no such model" in (await health.json())["error"]


async def test_auth(make_client: Any) -> None:
    async with make_client(config=AppConfig(api_key="s3cret")) as (client, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = await client.get("/v1/models", headers=headers)
            assert resp.status == 401
            err = (await resp.json())["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        auth = {"Authorization": "Bearer s3cret"}
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert ok.status == 200
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200


async def test_429_past_the_waiting_limit(make_client: Any, setup_cls: Any, settled_kv: Any) -> None:
    setup = setup_cls(max_num_seqs=1, max_waiting_requests=1, max_model_len=8192, kv_cache_memory=400 << 20)
    async with make_client(setup=setup) as (client, _):
        running = await client.post("/v1/completions", json=LONG)
        await _first_event(running)
        waiting = await client.post("/v1/completions", json=LONG)
        assert waiting.status == 200
        rejected = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert rejected.status == 429
        assert rejected.headers["Retry-After"] == "1"
        assert (await rejected.json())["error"]["type"] == "rate_limit_error"
        running.close()
        waiting.close()
        kv = await settled_kv(client)
        assert kv["num_free_blocks"] == kv["num_gpu_blocks"]
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200


async def test_disconnect_mid_stream_frees_blocks(make_client: Any, setup_cls: Any, settled_kv: Any) -> None:
    setup = setup_cls(max_model_len=8192, kv_cache_memory=400 << 20)
    async with make_client(setup=setup) as (client, state):
        resp = await client.post("/v1/completions", json=LONG)
        await _first_event(resp)
        during = await (await client.get("/debug/kv")).json()
        assert during["num_free_blocks"] < during["num_gpu_blocks"]
        resp.close()
        kv = await settled_kv(client)
        assert kv["num_free_blocks"] == kv["num_gpu_blocks"] and kv["num_unfinished_streams"] == 0
        metrics = await (await client.get("/metrics")).text()
        assert 'stepserve:request_success_total{finished_reason="abort",model_name="instant"} 1.0' in metrics
        tokens = [line for line in metrics.splitlines() if line.startswith("stepserve:generation_tokens_total")]
        assert float(tokens[0].split()[-1]) < 8000  # it stopped early, not ran to the end


async def test_worker_death_ends_streams_and_turns_health_503(make_client: Any, setup_cls: Any) -> None:
    """Every in-flight stream ends with an error event soon after the kill (well under a
    second in practice; the bound asserted is generous), /health turns 503, new work 503."""
    setup = setup_cls(max_model_len=8192, kv_cache_memory=400 << 20)
    async with make_client(setup=setup) as (client, state):
        streams = [await client.post("/v1/completions", json={**LONG, "max_tokens": 2000}) for _ in range(3)]
        for resp in streams:
            await _first_event(resp)
        assert state.loaded is not None
        killed = time.monotonic()
        os.kill(state.loaded.engine.worker.pid, signal.SIGKILL)  # type: ignore[attr-defined]

        async def rest(resp: Any) -> tuple[float, list[Any]]:
            events = await _rest_events(resp)
            return time.monotonic(), events

        for ended, events in await asyncio.gather(*[rest(r) for r in streams]):
            assert events[-1] == "[DONE]"
            assert "error" in events[-2] and "died" in events[-2]["error"]["message"]
            assert ended - killed < 15
        await asyncio.wait_for(state.fatal.wait(), 10)
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "failed"
        assert (await client.post("/v1/completions", json={"prompt": "hi"})).status == 503


async def test_drain_lets_in_flight_finish_then_aborts_stragglers(make_client: Any, setup_cls: Any) -> None:
    setup = setup_cls(max_model_len=8192, kv_cache_memory=400 << 20)
    async with make_client(setup=setup) as (client, state):
        assert state.loaded is not None
        engine = state.loaded.engine
        short = await client.post("/v1/completions", json={**LONG, "max_tokens": 300})
        await _first_event(short)
        state.status = Status.DRAINING
        assert (await client.post("/v1/completions", json={"prompt": "hi"})).status == 503
        assert await engine.drain(timeout=60)
        events = await _rest_events(short)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        state.status = Status.READY
        long = await client.post("/v1/completions", json=LONG)
        await _first_event(long)
        assert not await engine.drain(timeout=0.0)
        events = await _rest_events(long)
        assert events[-2]["choices"][0]["finish_reason"] == "abort" and events[-1] == "[DONE]"
