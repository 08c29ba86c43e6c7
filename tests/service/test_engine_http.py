"""The engine's scheduling paths through the HTTP API, on the instant stand-in worker: EOS
while a second plan is in flight, swap preemption, and priority preemption. Expectations
come from the same server's own solo runs, never from the stand-in's token rule, so the
tests hold however the stand-in computes its tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp.test_utils import TestClient
from standin_runners import EOS_AFTER

from scheduler.scheduler import Scheduler
from worker.execution.instant_runner import INSTANT_KV_BYTES_PER_TOKEN

BLOCK_BYTES = 16 * INSTANT_KV_BYTES_PER_TOKEN  # one KV block of the default block size


async def _events(resp: Any) -> list[Any]:
    assert resp.status == 200, await resp.text()
    out: list[Any] = []
    for block in (await resp.text()).split("\n\n"):
        block = block.strip()  # after a consumed first line the rest starts with its blank line
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out


async def _completion(client: TestClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json={"temperature": 0, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
    return float(lines[0].rsplit(" ", 1)[1])


async def test_eos_with_two_plans_in_flight_ends_the_stream_at_eos(make_client: Any, setup_cls: Any,
                                                                    settled_kv: Any) -> None:
    """With overlap the plan after the EOS step already holds each request and samples one
    more token for it; that token is never streamed, returned or counted."""
    async with make_client(setup=setup_cls(runner="standin_runners:eos_after_5")) as (client, _):
        metrics_before = await (await client.get("/metrics")).text()
        body = {"prompt": "Hello there", "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
        runs = await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(8)])
        whole = await _completion(client, prompt="Hello there", max_tokens=20)
        assert whole["choices"][0]["finish_reason"] == "stop" and whole["choices"][0]["stop_reason"] is None
        assert whole["usage"]["completion_tokens"] == EOS_AFTER
        for resp in runs:
            events = await _events(resp)
            assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
            content = [e["choices"][0] for e in events[:-2]]
            assert [c["finish_reason"] for c in content].count("stop") == 1 and content[-1]["finish_reason"] == "stop"
            assert "".join(c["text"] for c in content) == whole["choices"][0]["text"]
        metrics_after = await (await client.get("/metrics")).text()
        name = "stepserve:generation_tokens_total"
        assert _metric(metrics_after, name) - _metric(metrics_before, name) == 9 * EOS_AFTER
        ignored = await _completion(client, prompt="Hello there", max_tokens=20, ignore_eos=True)
        assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 20
        kv = await settled_kv(client)
        assert kv["num_free_blocks"] == kv["num_gpu_blocks"]


async def test_swap_preemption_keeps_every_output(make_client: Any, setup_cls: Any, settled_kv: Any) -> None:
    """Three requests that need 18 KV blocks share 8: the scheduler swaps some out to host
    slots and back, and each still returns exactly what it returns alone."""
    setup = setup_cls(kv_cache_memory=8 * BLOCK_BYTES, max_model_len=128, swap_space=16 * BLOCK_BYTES / (1 << 30),
                      preemption_mode="swap", enable_prefix_caching=False)
    async with make_client(setup=setup) as (client, state):
        prompts = [[100 + 7 * i + j for j in range(30)] for i in range(3)]
        request = {"max_tokens": 60, "ignore_eos": True}
        solo = [await _completion(client, prompt=p, **request) for p in prompts]
        scheduler: Scheduler = state.loaded.engine.scheduler  # type: ignore[union-attr,assignment]
        assert scheduler.num_swap_preemptions == 0
        together = await asyncio.gather(*[_completion(client, prompt=p, **request) for p in prompts])
        assert scheduler.num_swap_preemptions >= 1
        for alone, shared in zip(solo, together, strict=True):
            assert shared["choices"][0]["text"] == alone["choices"][0]["text"]
            assert shared["usage"]["completion_tokens"] == 60
        kv = await settled_kv(client)
        assert kv["num_free_blocks"] == kv["num_gpu_blocks"] and kv["num_swapped"] == 0
        assert len(scheduler.kv.host_free) == scheduler.config.num_cpu_blocks


async def test_urgent_request_preempts_a_running_one(make_client: Any, setup_cls: Any, settled_kv: Any) -> None:
    """One running slot: an urgent request arriving while a long low-priority one runs is
    served at once (the long one is preempted and resumes after, its output unchanged)."""
    setup = setup_cls(max_num_seqs=1, scheduling_policy="priority", priority_preemption_threshold=1,
                      max_model_len=4096, kv_cache_memory=400 << 20)
    async with make_client(setup=setup) as (client, state):
        scheduler: Scheduler = state.loaded.engine.scheduler  # type: ignore[union-attr,assignment]
        low_body = {"prompt": "a long story", "max_tokens": 1500, "ignore_eos": True}
        low = await client.post("/v1/completions", json={**low_body, "temperature": 0, "priority": 10, "stream": True})
        first = await _first_event(low)  # it is running
        urgent = await _completion(client, prompt="urgent", max_tokens=8, ignore_eos=True, priority=0)
        assert urgent["choices"][0]["finish_reason"] == "length"
        # Without preemption the urgent request would have waited for all 1500 tokens.
        assert len(scheduler.requests) == 1, "the long request must still be unfinished"
        assert scheduler.num_preemptions >= 1
        rest = await _events(low)
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
        streamed = first["choices"][0]["text"] + "".join(e["choices"][0]["text"] for e in rest[:-1])
        alone = await _completion(client, **low_body)
        assert streamed == alone["choices"][0]["text"]
        kv = await settled_kv(client)
        assert kv["num_free_blocks"] == kv["num_gpu_blocks"]


async def _first_event(resp: Any) -> dict[str, Any]:
    assert resp.status == 200, await resp.text()
    while True:
        line = (await resp.content.readline()).strip()
        if line.startswith(b"data: "):
            return orjson.loads(line[6:])
