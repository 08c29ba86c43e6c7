"""POST /tokenize and POST /detokenize, in vLLM's shapes: the server's own tokenization.

/tokenize takes a completions-style `prompt` or a chat's `messages` and answers with the
token ids the completion and chat routes would submit for it (the same code makes them):
``{"count", "max_model_len", "tokens"}``, plus ``"token_strs"`` (each token's vocabulary
string) when `return_token_strs` is set. /detokenize turns `tokens` back into text, special
tokens kept, so the two round-trip. Both answer as the /v1 routes do: the same API key, the
same error shape, 503 while the model loads, and the tokenizer work in the thread pool.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from service.http.chat_protocol import ChatPrompt
from service.http.errors import bad_request
from service.http.openai_routes import (
    chat_prompt_ids,
    check_model,
    in_executor,
    read_json,
    ready,
)
from service.http.protocol import Body

PATHS = ("/tokenize", "/detokenize")  # guarded by the API key like /v1/*


class TokenizeCompletionRequest(Body):
    """/tokenize with a `prompt`."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """/tokenize with `messages` (tools, when given, are shown to the template)."""

    REFUSED = {"mm_processor_kwargs": ((), "this server serves a text-only model")}

    model: str | None = None
    return_token_strs: bool = False
    mm_processor_kwargs: Any = None


class DetokenizeRequest(Body):
    """/detokenize."""

    model: str | None = None
    tokens: list[int]


def _json(body: object) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize."""
    state, loaded = ready(request)
    data = await read_json(request)
    tokenizer = loaded.engine.tokenizer
    req: TokenizeCompletionRequest | TokenizeChatRequest
    if "messages" in data:
        req = TokenizeChatRequest.model_validate(data)
        req.check_refused()
        req.check_prompt()
        check_model(req.model, loaded)
        ids = await chat_prompt_ids(state, loaded, req)
    else:
        req = TokenizeCompletionRequest.model_validate(data)
        check_model(req.model, loaded)
        encoded = await in_executor(
            state, tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
        )
        ids = list(encoded)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": loaded.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = list(await in_executor(state, _token_strs, tokenizer, ids))
    return _json(body)


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's vocabulary string (as transformers' `convert_ids_to_tokens` gives it)."""
    return list(tokenizer.convert_ids_to_tokens(ids))


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize."""
    state, loaded = ready(request)
    req = DetokenizeRequest.model_validate(await read_json(request))
    check_model(req.model, loaded)
    bad = [t for t in req.tokens if not 0 <= t < loaded.vocab_size]
    if bad:
        raise bad_request(f"tokens must be in [0, {loaded.vocab_size}); got {bad[:5]}", "tokens")
    text = await in_executor(
        state, loaded.engine.tokenizer.decode, req.tokens, skip_special_tokens=False
    )
    return _json({"prompt": str(text)})
