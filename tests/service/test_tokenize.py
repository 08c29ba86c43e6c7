"""POST /tokenize and /detokenize over an InstantRunner-backed app: vLLM's shapes, the same
token ids the completion and chat routes submit (their usage and prompt_token_ids agree),
round trips, and the /v1 routes' rules for errors, the API key and start-up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import processors

from common.tokenizer import apply_chat_template
from service.http.app import create_app
from service.http.state import STATE, AppConfig, LoadedEngine, ServiceState

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours, ünïcode 🎨"}]
CONVO = [{"role": "user", "content": "Say a colour"}, {"role": "assistant", "content": "The colour is"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(make_client: Callable[..., Any]) -> AsyncIterator[tuple[TestClient, ServiceState]]:
    async with make_client() as pair:
        yield pair


async def _ok(client: TestClient, path: str, **body: Any) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_tokenize_a_prompt(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    client, state = app
    text = "Hello wörld, the quick brown fox 🦊"
    body = await _ok(client, "/tokenize", prompt=text)
    ids = tokenizer.encode(text)
    assert body == {"count": len(ids), "max_model_len": state.loaded.max_model_len, "tokens": ids}  # type: ignore[union-attr]
    strs = await _ok(client, "/tokenize", prompt=text, return_token_strs=True, model="instant")
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids) and strs["tokens"] == ids
    completion = await _ok(client, "/v1/completions", prompt=text, max_tokens=1, return_token_ids=True)
    assert completion["usage"]["prompt_tokens"] == body["count"]
    assert completion["choices"][0]["prompt_token_ids"] == body["tokens"]
    assert (await _ok(client, "/detokenize", tokens=body["tokens"])) == {"prompt": text}
    assert (await _ok(client, "/tokenize", prompt=""))["count"] == 0


async def test_tokenize_a_chat_equals_the_chat_route(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    """The server's own tokenization of a chat request, whatever the prompt options."""
    client, _ = app
    cases: list[dict[str, Any]] = [
        {"messages": CHAT},
        {"messages": CHAT, "add_generation_prompt": False},
        {"messages": CONVO, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": CHAT, "chat_template_kwargs": {"unused_flag": True}},
    ]
    for case in cases:
        tokens = await _ok(client, "/tokenize", **case)
        chat = await _ok(client, "/v1/chat/completions", **case, max_tokens=1, return_token_ids=True)
        assert tokens["count"] == chat["usage"]["prompt_tokens"] == len(tokens["tokens"]), case
        assert tokens["tokens"] == chat["prompt_token_ids"], case
    default = await _ok(client, "/tokenize", messages=CHAT)
    assert default["tokens"] == apply_chat_template(tokenizer, CHAT)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (await _ok(client, "/detokenize", tokens=default["tokens"]))["prompt"] == rendered


async def test_add_special_tokens(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    """With a tokenizer that adds a BOS of its own: /tokenize and the completion routes add
    it by default for a prompt and not for a chat (whose template writes its own), and both
    follow add_special_tokens."""
    client, _ = app
    backend = tokenizer.backend_tokenizer
    original = backend.post_processor
    bos = tokenizer.bos_token_id
    backend.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    try:
        plain = tokenizer.encode("Hello", add_special_tokens=False)
        assert (await _ok(client, "/tokenize", prompt="Hello"))["tokens"] == [bos, *plain]
        assert (await _ok(client, "/tokenize", prompt="Hello", add_special_tokens=False))["tokens"] == plain
        completion = await _ok(client, "/v1/completions", prompt="Hello", max_tokens=1, add_special_tokens=False,
                               return_token_ids=True)
        assert completion["choices"][0]["prompt_token_ids"] == plain
        templated = apply_chat_template(tokenizer, CHAT)
        assert (await _ok(client, "/tokenize", messages=CHAT))["tokens"] == templated
        extra = await _ok(client, "/tokenize", messages=CHAT, add_special_tokens=True)
        assert extra["tokens"] == [bos, *templated]
        chat = await _ok(client, "/v1/chat/completions", messages=CHAT, add_special_tokens=True, max_tokens=1,
                         return_token_ids=True)
        assert chat["prompt_token_ids"] == extra["tokens"]
    finally:
        backend.post_processor = original


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": CONVO, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "mm_processor_kwargs": {"size": 1}}, 400, "mm_processor_kwargs"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": [{"role": "function", "content": "1", "name": "f"}]}, 400, "messages[0].role"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model"),
    ],
)
async def test_errors_name_the_field(app: tuple[TestClient, ServiceState], path: str, body: dict[str, Any],
                                     status: int, param: str) -> None:
    client, _ = app
    resp = await client.post(path, json=body)
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


async def test_json_only(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    resp = await client.post("/tokenize", data=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert resp.status == 415
    resp = await client.post("/detokenize", data=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert resp.status == 400


async def test_api_key_and_start_up(engine_factory: Any) -> None:
    """The API key guards /tokenize and /detokenize as it guards /v1; both answer 503 while
    the engine starts."""
    release = asyncio.Event()
    real = engine_factory()

    async def gated() -> LoadedEngine:
        await release.wait()
        return await real()

    app = create_app(AppConfig(api_key="sesame"), gated)
    async with TestClient(TestServer(app)) as client:
        key = {"Authorization": "Bearer sesame"}
        starting = await client.post("/tokenize", json={"prompt": "hi"}, headers=key)
        assert starting.status == 503 and starting.headers["Retry-After"] == "1"
        assert (await starting.json())["error"]["type"] == "service_unavailable_error"
        assert (await client.post("/detokenize", json={"tokens": [1]}, headers=key)).status == 503
        release.set()
        await asyncio.wait_for(app[STATE].ready.wait(), 60)
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            denied = await client.post(path, json=body)
            assert denied.status == 401 and (await denied.json())["error"]["code"] == "invalid_api_key"
            wrong = await client.post(path, json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status == 401
            assert (await client.post(path, json=body, headers=key)).status == 200
        assert (await client.get("/health")).status == 200
