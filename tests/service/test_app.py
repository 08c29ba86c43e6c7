"""The HTTP app over an InstantRunner-backed engine (a real worker process, no model):
response shapes, streaming, n, stop strings, logprobs, usage, KV accounting."""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.engine.detokenizer import decode
from service.http.state import ServiceState

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(make_client: Callable[..., Any]) -> AsyncIterator[tuple[TestClient, ServiceState]]:
    async with make_client() as pair:
        yield pair



async def _sse(resp: Any) -> list[Any]:
    """Parse an SSE body into JSON events (and the literal "[DONE]")."""
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    events = []
    for block in (await resp.text()).split("\n\n"):
        if block.strip():
            assert block.startswith("data: ")
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def _complete(client: TestClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json={"model": "instant", "prompt": "Hello there", **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_completion_text_usage_and_ids(app: tuple[TestClient, ServiceState], tokenizer: Any, settled_kv: Any) -> None:
    client, state = app
    body = await _complete(client, max_tokens=9, ignore_eos=True)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    n_prompt = len(tokenizer.encode("Hello there"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 9, "total_tokens": n_prompt + 9}
    assert choice["text"]  # instant tokens decode to real vocabulary
    assert (await settled_kv(client))["kv_cache_usage"] == 0.0


async def test_streaming_equals_non_streaming(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    whole = await _complete(client, max_tokens=20, ignore_eos=True)
    resp = await client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 20, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    events = await _sse(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_n_and_multiple_prompts(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    client, _ = app
    body = await _complete(client, prompt=["Hello there", "Bye"], n=2, max_tokens=4, ignore_eos=True, temperature=0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == texts[1] != texts[2] == texts[3]  # instant tokens depend on the prompt only
    n_prompt = len(tokenizer.encode("Hello there")) + len(tokenizer.encode("Bye"))
    assert body["usage"]["prompt_tokens"] == n_prompt
    assert body["usage"]["completion_tokens"] == 16


async def test_stop_string_trims_and_reports_stop(app: tuple[TestClient, ServiceState], settled_kv: Any) -> None:
    client, _ = app
    full = (await _complete(client, max_tokens=24, ignore_eos=True))["choices"][0]["text"]
    stop = full[10:14]
    before = await _finished_counts(client)
    cut = full[: full.index(stop)]
    body = await _complete(client, max_tokens=24, ignore_eos=True, stop=[stop])
    assert body["choices"][0]["text"] == cut
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == stop
    assert body["usage"]["completion_tokens"] < 24
    kept = await _complete(client, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == cut + stop
    resp = await client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 24, "ignore_eos": True, "stop": [stop], "stream": True})
    events = await _sse(resp)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert (await settled_kv(client))["kv_cache_usage"] == 0.0
    after = await _finished_counts(client)
    assert after["stop"] - before["stop"] == 3 and after["abort"] == before["abort"]


async def _finished_counts(client: TestClient) -> dict[str, float]:
    """stepserve:request_success_total by finished_reason, from /metrics."""
    counts = {}
    for line in (await (await client.get("/metrics")).text()).splitlines():
        if line.startswith("stepserve:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


async def test_logprobs_shapes(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    body = await _complete(client, max_tokens=3, ignore_eos=True, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert {"token", "logprob", "bytes", "top_logprobs"} <= set(content[0]) and len(content[0]["top_logprobs"]) == 2


async def test_chat_stream_shape(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    req = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_completion_tokens": 5, "ignore_eos": True}
    whole = await (await client.post("/v1/chat/completions", json=req)).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    events = await _sse(await client.post("/v1/chat/completions", json={**req, "stream": True, "n": 2}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        # the role rides on the choice's first chunk, which carries generated text already
        assert mine[0]["delta"]["role"] == "assistant" and mine[0]["delta"]["content"]
        assert all("role" not in ch["delta"] for ch in mine[1:])
        assert "".join(ch["delta"].get("content", "") for ch in mine) == whole["choices"][0]["message"]["content"]
        assert mine[-1]["finish_reason"] == "length"


async def test_chat_stream_sends_nothing_before_the_first_token(make_client: Any, setup_cls: Any) -> None:
    """One running slot, taken by a long completion: a chat stream submitted behind it gets
    its first chunk (role and content together) only once it has a token, so after the long
    request has left the scheduler; a role chunk sent at submission would arrive first."""
    async with make_client(setup=setup_cls(max_num_seqs=1)) as (client, state):
        scheduler = state.loaded.engine.scheduler  # type: ignore[union-attr]
        long_body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
        long = await client.post("/v1/completions", json=long_body)
        long_id = None
        while long_id is None:  # its first chunk: it holds the slot now
            line = (await long.content.readline()).strip()
            if line.startswith(b"data: "):
                long_id = orjson.loads(line[6:])["id"]
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True, "stream": True})
        assert chat.status == 200
        while not (line := (await chat.content.readline()).strip()).startswith(b"data: "):
            pass
        still_running = [rid for rid in scheduler.requests if rid.startswith(long_id)]
        first = orjson.loads(line[6:])["choices"][0]
        assert first["delta"]["role"] == "assistant" and first["delta"]["content"]
        assert still_running == [], "the chat's first chunk left before its first token"
        await long.read()
        await chat.read()


async def test_token_prompt_and_detokenized_text(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    """The returned text is exactly the decode of the generated ids (InstantRunner's rule)."""
    client, _ = app
    prompt = [100, 200, 300]
    body = await _complete(client, prompt=prompt, max_tokens=6, ignore_eos=True, logprobs=0)
    ids, token = [], prompt[-1]
    for position in range(len(prompt), len(prompt) + 6):
        token = (token * 31 + position) % 32000
        token = token + 1 if token == 2 else token
        ids.append(token)
    assert body["choices"][0]["text"] == decode(tokenizer, ids)


async def test_models_version_metrics(app: tuple[TestClient, ServiceState]) -> None:
    """Each counter is checked against this test's own request, whatever ran before."""
    client, _ = app
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "instant" and models["data"][0]["max_model_len"] == 1024
    version = await client.get("/version")
    assert version.status == 200 and (await version.json()) == {"version": importlib.metadata.version("stepserve")}
    before = await _finished_counts(client)
    full = (await _complete(client, max_tokens=12, ignore_eos=True))["choices"][0]["text"]
    stopped = await _complete(client, max_tokens=12, ignore_eos=True, stop=[full[3:6]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    after = await _finished_counts(client)
    assert (after["stop"] - before["stop"], after["length"] - before["length"]) == (1, 1)
    text = await (await client.get("/metrics")).text()
    for name in ("stepserve:generation_tokens_total", "stepserve:time_to_first_token_seconds_bucket", "stepserve:kv_cache_usage_perc"):
        assert name in text
    assert (await client.get("/health")).status == 200


async def test_streaming_usage_reports_cached_prompt_tokens(app: tuple[TestClient, ServiceState], settled_kv: Any) -> None:
    """A prompt whose first two blocks are in the prefix cache (its twin ran just before)
    reports them in the streamed usage, as the non-streaming response does."""
    client, _ = app
    prompt = list(range(7000, 7040))  # 40 tokens: two full 16-token blocks, seen by no other test
    cold = await _complete(client, prompt=prompt, max_tokens=4, ignore_eos=True)
    assert "prompt_tokens_details" not in cold["usage"]
    await settled_kv(client)
    hits_before = await _metric_value(client, "stepserve:prefix_cache_hits_total")
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = (await _sse(await client.post("/v1/completions", json=body)))[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 4
    assert await _metric_value(client, "stepserve:prefix_cache_hits_total") - hits_before == 32
    warm = await _complete(client, prompt=prompt, max_tokens=4, ignore_eos=True)
    assert warm["usage"] == usage


async def _metric_value(client: TestClient, name: str) -> float:
    text = await (await client.get("/metrics")).text()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return values[name]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
async def test_json_routes_refuse_other_content_types(app: tuple[TestClient, ServiceState], settled_kv: Any,
                                                     content_type: str) -> None:
    client, _ = app
    body = orjson.dumps({"prompt": "Hello there", "max_tokens": 2})
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = await client.post(path, data=body, headers={"Content-Type": content_type})
        assert resp.status == 415
        err = (await resp.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["code"] == "unsupported_media_type" and content_type.split(";")[0] in err["message"]
    assert (await settled_kv(client))["num_unfinished_streams"] == 0
    for ok_type in ("application/json", "application/json; charset=utf-8", None):
        headers = {"Content-Type": ok_type} if ok_type else {}
        ok = await client.post("/v1/completions", data=body, headers=headers, skip_auto_headers=["Content-Type"])
        assert ok.status == 200, (ok_type, await ok.text())


async def test_step_metrics_include_the_workers_execute_time(app: tuple[TestClient, ServiceState]) -> None:
    """Every step the engine times also carries the worker's own execute time (measured in
    the worker process), so /metrics separates model time from engine and pipe time."""
    client, _ = app
    await _complete(client, max_tokens=5, ignore_eos=True)
    text = await (await client.get("/metrics")).text()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    steps = values["stepserve:step_duration_seconds_count"]
    assert steps >= 5 and values["stepserve:model_execute_time_seconds_count"] == steps
    assert values["stepserve:model_execute_time_seconds_sum"] > 0
