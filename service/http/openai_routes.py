"""POST /v1/completions and /v1/chat/completions: validate, tokenize, submit, respond.

Each choice (prompt x n) is one engine request with id ``{response id}-{index}``; siblings
share the prompt, so the scheduler's prefix cache lets them share its KV blocks.
Tokenization and chat templates run in a thread pool, so a huge prompt never stalls the
event loop (and with it every other stream). The engine hands each stream ready deltas;
handlers only format and write them, SSE writes going through the app's stall watch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel

from common.tokenizer import apply_chat_template
from scheduler.sampling import SamplingParams
from service.engine.stream import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestRejectedError,
    RequestStream,
    StreamDelta,
)
from service.http import responses as R
from service.http.errors import APIError, bad_request, error_body, unsupported_media_type
from service.http.protocol import (
    GENERATION_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationDefaults,
    resolve_max_tokens,
)
from service.http.sse import DONE, event, merge, open_event_stream
from service.http.stall import GuardedWriter
from service.http.state import STATE, LoadedEngine, ServiceState

MAX_CHOICES = 256  # prompts x n in one request

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state, loaded = _ready(request)
    req = CompletionRequest.model_validate(await _read_json(request))
    req.check()
    _check_model(req.model, loaded)
    raw_prompts = req.prompts()
    _check_choice_count(len(raw_prompts), req.n)  # before tokenizing them all
    prompts = [await _prompt_ids(state, loaded, p) for p in raw_prompts]
    return await _serve(
        request,
        state,
        loaded,
        req,
        prompts,
        R.ResponseMeta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), loaded.model_name, chat=False),
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state, loaded = _ready(request)
    req = ChatCompletionRequest.model_validate(await _read_json(request))
    req.check()
    _check_model(req.model, loaded)
    tokenizer = loaded.engine.tokenizer
    try:
        ids = await _in_executor(state, apply_chat_template, tokenizer, req.chat_messages(), True)
    except Exception as exc:  # the template (jinja) rejects these messages, e.g. an odd role order
        raise bad_request(
            f"cannot apply the chat template to these messages: {exc}", "messages"
        ) from None
    return await _serve(
        request,
        state,
        loaded,
        req,
        [ids],
        R.ResponseMeta(
            f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), loaded.model_name, chat=True
        ),
    )


def _ready(request: web.Request) -> tuple[ServiceState, LoadedEngine]:
    state = request.app[STATE]
    return state, state.require_ready()


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


async def _read_json(request: web.Request) -> Any:
    # A body without a Content-Type is read as JSON (as FastAPI, and so vLLM, does); one
    # that says it is something else is refused before it is read.
    if "Content-Type" in request.headers and not _is_json(request.content_type):
        raise unsupported_media_type(request.content_type)
    body = await request.read()  # raises 413 past client_max_size
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def _check_model(model: str | None, loaded: LoadedEngine) -> None:
    if model is not None and model != loaded.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{loaded.model_name}`.",
            param="model",
            code="model_not_found",
        )


async def _in_executor(state: ServiceState, fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.executor, fn, *args)


async def _prompt_ids(
    state: ServiceState, loaded: LoadedEngine, prompt: str | list[int]
) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        ids: list[int] = list(await _in_executor(state, loaded.engine.tokenizer.encode, prompt))
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < loaded.vocab_size]
        if bad:
            raise bad_request(
                f"prompt token ids must be in [0, {loaded.vocab_size}); got {bad[:5]}", "prompt"
            )
    if not ids:
        raise bad_request("prompt must contain at least one token", "prompt")
    return ids


def _choices(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    loaded: LoadedEngine,
    defaults: GenerationDefaults,
) -> list[_Choice]:
    _check_choice_count(len(prompts), req.n)
    out: list[_Choice] = []
    for p, ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(req, len(ids), loaded.max_model_len, defaults.max_tokens)
        params = req.sampling_params(max_tokens, defaults)
        _check_worker_limits(params, req.n, loaded.vocab_size)
        for i in range(req.n):
            seed = None if params.seed is None else params.seed + i  # siblings must differ
            out.append(_Choice(p * req.n + i, ids, dataclasses.replace(params, n=1, seed=seed)))
    return out


def _check_choice_count(num_prompts: int, n: int) -> None:
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    if n * num_prompts > MAX_CHOICES:
        raise bad_request(
            f"at most {MAX_CHOICES} choices (prompts x n) per request, got {n * num_prompts}", "n"
        )


def _check_worker_limits(params: SamplingParams, n: int, vocab_size: int) -> None:
    """Values the worker would fail on must be refused here, before they can fail a step
    that other requests share."""
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise bad_request(
            f"stop_token_ids must be in [0, {vocab_size}); got {bad[:5]}", "stop_token_ids"
        )
    if params.seed is not None and params.seed + n - 1 >= 2**63:
        raise bad_request(
            f"seed + n - 1 must be below 2**63, got seed {params.seed} with n={n}", "seed"
        )


async def _serve(
    request: web.Request,
    state: ServiceState,
    loaded: LoadedEngine,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    meta: R.ResponseMeta,
) -> web.StreamResponse:
    choices = _choices(req, prompts, loaded, request.app[GENERATION_DEFAULTS])
    engine = loaded.engine
    try:
        engine.check_capacity(len(choices))
        streams = [
            engine.submit(
                c.prompt_ids,
                c.params,
                f"{meta.id}-{c.index}",
                stop=req.stop_strings,
                include_stop_str_in_output=req.include_stop_str_in_output,
                user=req.user,
            )
            for c in choices
        ]
    except EngineOverloadedError as exc:
        raise APIError(429, str(exc), headers={"Retry-After": "1"}) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    prompt_tokens = sum(len(ids) for ids in prompts)
    try:
        if req.stream:
            return await _stream(
                request,
                state,
                engine.token_texts,
                req,
                meta,
                streams,
                [c.index for c in choices],
                prompt_tokens,
            )
        return await _whole(
            engine.token_texts, req, meta, streams, [c.index for c in choices], prompt_tokens
        )
    finally:  # whatever happened (a client gone before the first event included), abort the rest
        for stream in streams:
            stream.close()


def _generation_error(exc: EngineError) -> APIError:
    if isinstance(exc, RequestRejectedError):
        return APIError(400, str(exc))
    return APIError(500, f"generation failed: {exc}")


async def _whole(
    token_text: R.TokenText,
    req: BaseModel,
    meta: R.ResponseMeta,
    streams: list[RequestStream],
    indices: list[int],
    prompt_tokens: int,
) -> web.Response:
    results = [R.ChoiceResult(index=i) for i in indices]
    cached = 0
    try:
        async for pos, delta in merge(streams):
            res = results[pos]
            res.text += delta.text
            res.token_ids.extend(delta.token_ids)
            res.logprobs.extend(delta.logprobs)
            res.num_output_tokens = delta.num_output_tokens
            if delta.finished:
                res.finish_reason, res.stop_reason = delta.finish_reason, delta.stop_reason
                if res.index % req.n == 0:  # type: ignore[attr-defined]  # a prompt counts once, as in prompt_tokens
                    cached += delta.num_cached_tokens
    except EngineError as exc:
        raise _generation_error(exc) from None
    usage = R.usage(prompt_tokens, sum(r.num_output_tokens for r in results), cached)
    want_logprobs = req.num_logprobs() is not None  # type: ignore[attr-defined]
    body = R.full_response(meta, results, usage, token_text, want_logprobs)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request,
    state: ServiceState,
    token_text: R.TokenText,
    req: CompletionRequest | ChatCompletionRequest,
    meta: R.ResponseMeta,
    streams: list[RequestStream],
    indices: list[int],
    prompt_tokens: int,
) -> web.StreamResponse:
    response = await open_event_stream(request)
    with state.stall_watch.watch(request, response, streams) as writer:
        try:
            await _write_events(writer, token_text, req, meta, streams, indices, prompt_tokens)
            await writer.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left (or stalled): its streams are closed, so aborted
    return response


async def _write_events(
    writer: GuardedWriter,
    token_text: R.TokenText,
    req: CompletionRequest | ChatCompletionRequest,
    meta: R.ResponseMeta,
    streams: list[RequestStream],
    indices: list[int],
    prompt_tokens: int,
) -> None:
    """Every content event, then the usage event (or an error event: headers are out)."""
    events = _EventBuilder(token_text, req, meta, indices)
    if meta.chat:
        for index in indices:
            await writer.write(events.encoder.choice_event(R.chat_role_choice(index)))
    try:
        if len(streams) == 1:  # most requests: read the stream itself, no merging layer
            async for delta in streams[0]:
                await writer.write(events.content(0, delta))
        else:
            async for pos, delta in merge(streams):
                await writer.write(events.content(pos, delta))
    except EngineError as exc:
        err = _generation_error(exc)
        await writer.write(event(error_body(err.status, err.message)))
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("stream %s failed", meta.id)
        await writer.write(event(error_body(500, "internal server error; see the server log")))
    else:
        if req.include_usage:
            usage = R.usage(prompt_tokens, sum(events.num_output), events.cached)
            await writer.write(event(R.chunk(meta, None, usage, True)))


class _EventBuilder:
    """One streamed response's content events, and the usage they add up to."""

    def __init__(self, token_text: R.TokenText, req: CompletionRequest | ChatCompletionRequest,
                 meta: R.ResponseMeta, indices: list[int]) -> None:
        self.token_text, self.meta, self.indices, self.n = token_text, meta, indices, req.n
        self.want_logprobs = req.num_logprobs() is not None
        self.encoder = R.ChunkEncoder(meta, req.include_usage)
        self.num_output = [0] * len(indices)
        self.offsets = [0] * len(indices)
        self.cached = 0

    def content(self, pos: int, delta: StreamDelta) -> bytes:
        self.num_output[pos] = delta.num_output_tokens
        if (
            delta.finished and self.indices[pos] % self.n == 0
        ):  # a prompt counts once, as in prompt_tokens
            self.cached += delta.num_cached_tokens
        logprobs = (
            _delta_logprobs(self.token_text, self.meta, delta, self.offsets[pos])
            if self.want_logprobs
            else None
        )
        self.offsets[pos] += len(delta.text)
        choice = R.stream_choice(
            self.meta,
            self.indices[pos],
            delta.text,
            delta.finish_reason,
            delta.stop_reason,
            logprobs,
        )
        return self.encoder.choice_event(choice)


def _delta_logprobs(
    token_text: R.TokenText, meta: R.ResponseMeta, delta: StreamDelta, offset: int
) -> dict[str, Any]:
    if meta.chat:
        return R.chat_logprobs(token_text, delta.token_ids, delta.logprobs)
    return R.completion_logprobs(token_text, delta.token_ids, delta.logprobs, offset)
