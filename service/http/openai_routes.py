"""POST /v1/completions and /v1/chat/completions: validate, tokenize, submit, respond.

Each choice (prompt x n) is one engine request with id ``{response id}-{index}``; siblings
share the prompt, so the scheduler's prefix cache lets them share its KV blocks.
Tokenization and chat templates run in a thread pool, so a huge prompt never stalls the
event loop (and with it every other stream). The engine hands each stream ready deltas;
handlers only format and write them, SSE writes going through the app's stall watch.

A streamed chat choice announces its role in its first chunk that carries generated output,
not before: a client that starts its time-to-first-token clock at the first chunk measures
the real one.

Before anything is submitted, the engine may refuse the request with a 429 whose
`Retry-After` is its predicted wait: past the waiting limit (`--max-waiting-requests`), or,
with `--reject-unmeetable`, when its TTFT objective cannot be met as the queue stands.

`respond_whole` answers a request body the same way without HTTP: the offline entry point
(`stepserve generate`, `service.offline.LLM`) runs every request through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web

from common.grammar import GrammarError
from common.tokenizer import apply_chat_template
from scheduler.sampling import SamplingParams
from scheduler.slo import NO_SLO, SLO
from service.engine.detokenizer import decode
from service.engine.stream import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestRejectedError,
    RequestStream,
    StreamDelta,
)
from service.http import responses as R
from service.http.chat_protocol import ChatCompletionRequest, ChatPrompt
from service.http.errors import APIError, bad_request, error_body, unsupported_media_type
from service.http.protocol import (
    GENERATION_DEFAULTS,
    CompletionRequest,
    GenerationDefaults,
    SamplingRequest,
    not_supported,
    resolve_max_tokens,
)
from service.http.sse import DONE, event, merge, open_event_stream
from service.http.stall import GuardedWriter
from service.http.state import STATE, LoadedEngine, ServiceState
from service.http.tool_calls import ToolStream

MAX_CHOICES = 256  # prompts x n in one request

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A request's prompts as token ids, and what its tokenizer work produced besides."""

    prompts: list[list[int]]
    bad_words: tuple[tuple[int, ...], ...] = ()
    echo: tuple[str, ...] | None = None  # per prompt, when the request echoes
    grammar: str | None = None  # structured outputs: compiled, ready for the worker
    slo: SLO = NO_SLO  # the objectives the request sets (fields or headers)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state, loaded = ready(request)
    req, prepared, meta = await prepare_completion(
        state, loaded, await read_json(request), request.headers
    )
    return await _serve(request, state, loaded, req, prepared, meta)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state, loaded = ready(request)
    req, prepared, meta = await prepare_chat(
        state, loaded, await read_json(request), request.headers
    )
    return await _serve(request, state, loaded, req, prepared, meta)


async def prepare_completion(
    state: ServiceState, loaded: LoadedEngine, data: Any, headers: Mapping[str, str]
) -> tuple[CompletionRequest, _Prepared, R.ResponseMeta]:
    """A completion request's body validated, its prompts tokenized, its grammar compiled."""
    req = CompletionRequest.model_validate(data)
    req.check()
    slo = req.objectives(headers)
    check_model(req.model, loaded)
    raw_prompts = req.prompts()
    _check_choice_count(len(raw_prompts), req.n)  # before tokenizing them all
    full = [await _prompt_ids(state, loaded, p, req.add_special_tokens) for p in raw_prompts]
    prompts = [req.truncated(ids, loaded.max_model_len) for ids in full]
    echo = None
    if req.echo:
        tokenizer = loaded.engine.tokenizer
        echo = tuple(await in_executor(state, _echo_texts, tokenizer, raw_prompts, full, prompts))
    grammar = await compiled_grammar(loaded, req)
    prepared = _Prepared(prompts, await _bad_words(state, loaded, req), echo, grammar, slo)
    meta = R.ResponseMeta(_response_id("cmpl", req), int(time.time()), loaded.model_name, False)
    return req, prepared, meta


async def prepare_chat(
    state: ServiceState, loaded: LoadedEngine, data: Any, headers: Mapping[str, str]
) -> tuple[ChatCompletionRequest, _Prepared, R.ResponseMeta]:
    """A chat request's body validated, rendered with the chat template and tokenized."""
    req = ChatCompletionRequest.model_validate(data)
    req.check()
    slo = req.objectives(headers)
    check_model(req.model, loaded)
    if req.tool_mode == "auto" and state.config.tool_call_parser is None:
        raise bad_request(
            '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
            '--tool-call-parser (tools with no tool_choice default to "auto"; "none", "required" '
            "and a named function need neither)", "tool_choice",
        )
    ids = req.truncated(await chat_prompt_ids(state, loaded, req), loaded.max_model_len)
    echo = (req.echo_text(),) if req.echo else None
    grammar = await compiled_grammar(loaded, req)
    prepared = _Prepared([ids], await _bad_words(state, loaded, req), echo, grammar, slo)
    meta = R.ResponseMeta(
        _response_id("chatcmpl", req), int(time.time()), loaded.model_name, chat=True
    )
    return req, prepared, meta


async def respond_whole(
    state: ServiceState,
    loaded: LoadedEngine,
    defaults: GenerationDefaults,
    data: Any,
    *,
    chat: bool,
) -> dict[str, Any]:
    """One request body answered whole, as the HTTP routes answer it unstreamed, without
    HTTP (the offline entry point). `stream` is refused: there is no one to stream to.
    Raises what the routes raise (`APIError`, pydantic's `ValidationError`, ...)."""
    if isinstance(data, dict) and data.get("stream"):
        raise bad_request("stream: offline, each response is written whole; leave it unset",
                          "stream")
    prepare = prepare_chat if chat else prepare_completion
    req, prepared, meta = await prepare(state, loaded, data, {})
    streams, shape, indices = _start(loaded, req, prepared, meta, defaults)
    try:
        return await _whole_body(req, meta, shape, streams, indices)
    finally:
        for stream in streams:
            stream.close()


def _response_id(prefix: str, req: SamplingRequest) -> str:
    return f"{prefix}-{req.request_id or uuid.uuid4().hex}"


def ready(request: web.Request) -> tuple[ServiceState, LoadedEngine]:
    """The app's state and its engine, or a 503 while there is none to use."""
    state = request.app[STATE]
    return state, state.require_ready()


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


async def read_json(request: web.Request) -> Any:
    """The body as a JSON object; 415 for another content type, 400 for anything else."""
    # A body without a Content-Type is read as JSON (as FastAPI, and so vLLM, does); one
    # that says it is something else is refused before it is read.
    if "Content-Type" in request.headers and not _is_json(request.content_type):
        raise unsupported_media_type(request.content_type)
    return json_object(await request.read())  # read() raises 413 past client_max_size


def json_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object; a 400 for anything else."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        data = _json_with_non_finite(body, exc)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def _json_with_non_finite(body: bytes, exc: orjson.JSONDecodeError) -> Any:
    """A body orjson refused, read again allowing the non-finite numbers Python's `json`
    writes (NaN, Infinity, 1e400), so that the field holding one gets a 400 naming it (the
    request models allow none); a 400 for anything else that is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad_request(f"request body is not valid JSON: {exc}") from None


def check_model(model: str | None, loaded: LoadedEngine) -> None:
    """404 for a model this server does not serve."""
    if model is not None and model != loaded.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{loaded.model_name}`.",
            param="model",
            code="model_not_found",
        )


async def in_executor(state: ServiceState, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run tokenizer work in the app's thread pool."""
    call = (lambda: fn(*args, **kwargs)) if kwargs else (lambda: fn(*args))
    return await asyncio.get_running_loop().run_in_executor(state.executor, call)


async def _prompt_ids(
    state: ServiceState, loaded: LoadedEngine, prompt: str | list[int], add_special_tokens: bool
) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        encode = loaded.engine.tokenizer.encode
        ids: list[int] = list(
            await in_executor(state, encode, prompt, add_special_tokens=add_special_tokens)
        )
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


def _echo_texts(
    tokenizer: Any,
    raw: Sequence[str | list[int]],
    full: Sequence[list[int]],
    kept: Sequence[list[int]],
) -> list[str]:
    """Each prompt's text as `echo` writes it: as sent, or decoded when it came as token ids
    or was truncated."""
    return [
        p if isinstance(p, str) and len(k) == len(f) else
        decode(tokenizer, k, skip_special_tokens=False)
        for p, f, k in zip(raw, full, kept, strict=True)
    ]


async def chat_prompt_ids(state: ServiceState, loaded: LoadedEngine, chat: ChatPrompt) -> list[int]:
    """The chat rendered with the model's template and tokenized, as the chat route does."""
    tokenizer = loaded.engine.tokenizer
    kwargs = {
        "continue_final_message": chat.continue_final_message,
        "tools": chat.tools or None,
        "documents": chat.documents,
        "chat_template": _template_name(tokenizer, chat.chat_template),
        "template_kwargs": chat.template_vars(),
        "add_special_tokens": chat.add_special_tokens,
    }
    messages = chat.chat_messages()
    try:
        ids = await in_executor(
            state, apply_chat_template, tokenizer, messages, chat.add_generation_prompt, **kwargs
        )
    except Exception as exc:  # the template (jinja) rejects these messages, e.g. an odd role order
        param = "continue_final_message" if "continue_final_message" in str(exc) else "messages"
        raise bad_request(
            f"cannot apply the chat template to these messages: {exc}", param
        ) from None
    return list(ids)


def _template_name(tokenizer: Any, name: str | None) -> str | None:
    """A request's `chat_template`: a name among the model's templates; a template's text is
    not accepted (the server's own is set with --chat-template)."""
    if name is None:
        return None
    own = getattr(tokenizer, "chat_template", None)
    names = set(getattr(tokenizer, "chat_templates", None) or ())
    names |= set(own) if isinstance(own, dict) else set()
    if name not in names:
        raise bad_request(
            f"chat_template must name one of the model's chat templates ({sorted(names)}); a "
            "template in the request is not accepted (start the server with --chat-template)",
            "chat_template",
        )
    return name


async def _bad_words(
    state: ServiceState, loaded: LoadedEngine, req: SamplingRequest
) -> tuple[tuple[int, ...], ...]:
    if not req.bad_words:
        return ()
    tokenizer = loaded.engine.tokenizer
    words: tuple[tuple[int, ...], ...] = await in_executor(
        state, bad_words_token_ids, tokenizer, req.bad_words
    )
    return words


async def compiled_grammar(loaded: LoadedEngine, req: SamplingRequest) -> str | None:
    """The request's structured-output grammar, compiled (off the loop, cached) before the
    request is submitted; a 400 naming the field when it does not compile."""
    found = req.constraint()
    if found is None:
        return None
    param, constraint = found
    grammars = loaded.engine.grammars
    if grammars is None:
        raise not_supported(param, "structured outputs need a model's vocabulary; this worker "
                            "has none to constrain (the instant stand-in)")
    try:
        text = constraint.grammar_text()
        await grammars.compile(text)
    except GrammarError as exc:
        raise bad_request(f"{param}: the constraint does not compile: {exc}", param) from None
    return text


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, as vLLM tokenizes them: the word alone, and after a space
    when that starts with another token and has as many (so a word is banned at the start
    of the text and inside it)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = word.lstrip()
        plain = tuple(tokenizer.encode(bare, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + bare, add_special_tokens=False))
        out.append(plain)
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def _choices(
    req: SamplingRequest, prepared: _Prepared, loaded: LoadedEngine, defaults: GenerationDefaults
) -> list[_Choice]:
    _check_choice_count(len(prepared.prompts), req.n)
    out: list[_Choice] = []
    for p, ids in enumerate(prepared.prompts):
        max_tokens = resolve_max_tokens(req, len(ids), loaded.max_model_len, defaults.max_tokens)
        params = req.sampling_params(max_tokens, defaults, prepared.bad_words, prepared.grammar)
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
    named = {
        "stop_token_ids": params.stop_token_ids,
        "logit_bias": [t for t, _ in params.logit_bias],
        "allowed_token_ids": params.allowed_token_ids or (),
        "bad_words": [t for word in params.bad_words_token_ids for t in word],
    }
    for param, ids in named.items():
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"{param} must be in [0, {vocab_size}); got {bad[:5]}", param)
    if params.seed is not None and params.seed + n - 1 >= 2**63:
        raise bad_request(
            f"seed + n - 1 must be below 2**63, got seed {params.seed} with n={n}", "seed"
        )


def _shape(
    req: CompletionRequest | ChatCompletionRequest, prepared: _Prepared, loaded: LoadedEngine
) -> R.ResponseShape:
    token_text = loaded.engine.token_texts
    return R.ResponseShape(
        token_text=R.token_id_texts if req.return_tokens_as_token_ids else token_text,
        n=req.n,
        want_logprobs=req.num_logprobs() is not None,
        role=req.response_role if isinstance(req, ChatCompletionRequest) else "assistant",
        prompt_ids=tuple(prepared.prompts),
        return_token_ids=req.return_token_ids,
        echo=prepared.echo,
        echo_logprobs=req.logprobs if isinstance(req, CompletionRequest) and req.echo else None,
        prompt_logprobs=req.prompt_logprobs is not None,
        tool_mode=req.tool_mode if isinstance(req, ChatCompletionRequest) else "none",
        tool_choice=req.tool_choice if isinstance(req, ChatCompletionRequest) else None,
    )


async def _serve(
    request: web.Request,
    state: ServiceState,
    loaded: LoadedEngine,
    req: CompletionRequest | ChatCompletionRequest,
    prepared: _Prepared,
    meta: R.ResponseMeta,
) -> web.StreamResponse:
    streams, shape, indices = _start(loaded, req, prepared, meta, request.app[GENERATION_DEFAULTS])
    try:
        if req.stream:
            return await _stream(request, state, req, meta, shape, streams, indices)
        body = await _whole_body(req, meta, shape, streams, indices)
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    finally:  # whatever happened (a client gone before the first event included), abort the rest
        for stream in streams:
            stream.close()


def _start(
    loaded: LoadedEngine,
    req: CompletionRequest | ChatCompletionRequest,
    prepared: _Prepared,
    meta: R.ResponseMeta,
    defaults: GenerationDefaults,
) -> tuple[list[RequestStream], R.ResponseShape, list[int]]:
    """Submit every choice; their streams, the response's shape and the choices' indices."""
    choices = _choices(req, prepared, loaded, defaults)
    # a client's request_id names the response; the engine's ids stay unique
    engine_id = f"{meta.id}-{uuid.uuid4().hex[:8]}" if req.request_id else meta.id
    streams = _submit(loaded, req, choices, engine_id, prepared.slo)
    return streams, _shape(req, prepared, loaded), [c.index for c in choices]


def _submit(
    loaded: LoadedEngine,
    req: SamplingRequest,
    choices: list[_Choice],
    engine_id: str,
    slo: SLO = NO_SLO,
) -> list[RequestStream]:
    """One engine request per choice, ids ``{engine_id}-{index}``, each with the request's
    objectives; none when the engine refuses the request (a 429 with the predicted wait in
    `Retry-After`)."""
    engine = loaded.engine
    options = req.detokenize_options()
    try:
        engine.check_capacity(len(choices))
        for c in choices[:: req.n]:  # one per prompt: its n siblings are forecast alike
            engine.check_objectives(c.prompt_ids, c.params, user=req.tenant, slo=slo)
        streams = []
        for c in choices:
            stream = engine.submit(
                c.prompt_ids,
                c.params,
                f"{engine_id}-{c.index}",
                stop=req.stop_strings,
                include_stop_str_in_output=req.include_stop_str_in_output,
                user=req.tenant,
                detokenize=options,
                slo=slo,
            )
            streams.append(stream)
    except EngineOverloadedError as exc:
        raise APIError(
            429, str(exc), code=exc.reason, headers={"Retry-After": str(exc.retry_after_s)}
        ) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    return streams


def _generation_error(exc: EngineError) -> APIError:
    if isinstance(exc, RequestRejectedError):
        return APIError(400, str(exc))
    return APIError(500, f"generation failed: {exc}")


def _prompt_alone(delta: StreamDelta) -> StreamDelta:
    """A delta of a max_tokens 0 request (echo): its one sampled token left out."""
    finish = "length" if delta.finished else None
    return dataclasses.replace(
        delta, text="", token_ids=(), logprobs=(), num_output_tokens=0, finish_reason=finish,
        stop_reason=None,
    )


def _prompt_tokens(shape: R.ResponseShape) -> int:
    return sum(len(ids) for ids in shape.prompt_ids)


async def _whole_body(
    req: SamplingRequest,
    meta: R.ResponseMeta,
    shape: R.ResponseShape,
    streams: list[RequestStream],
    indices: list[int],
) -> dict[str, Any]:
    results = [R.ChoiceResult(index=i) for i in indices]
    cached = 0
    try:
        async for pos, raw in merge(streams):
            delta = raw if req.generates else _prompt_alone(raw)
            res = results[pos]
            if delta.prompt_logprobs is not None:
                res.prompt_logprobs = delta.prompt_logprobs
            res.text += delta.text
            res.token_ids.extend(delta.token_ids)
            res.logprobs.extend(delta.logprobs)
            res.num_output_tokens = delta.num_output_tokens
            if delta.finished:
                res.finish_reason, res.stop_reason = delta.finish_reason, delta.stop_reason
                if res.index % req.n == 0:  # a prompt counts once, as in prompt_tokens
                    cached += delta.num_cached_tokens
    except EngineError as exc:
        raise _generation_error(exc) from None
    usage = R.usage(_prompt_tokens(shape), sum(r.num_output_tokens for r in results), cached)
    return R.full_response(meta, results, usage, shape)


async def _stream(
    request: web.Request,
    state: ServiceState,
    req: SamplingRequest,
    meta: R.ResponseMeta,
    shape: R.ResponseShape,
    streams: list[RequestStream],
    indices: list[int],
) -> web.StreamResponse:
    response = await open_event_stream(request)
    with state.stall_watch.watch(request, response, streams) as writer:
        try:
            await _write_events(writer, req, meta, shape, streams, indices)
            await writer.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left (or stalled): its streams are closed, so aborted
    return response


async def _write_events(
    writer: GuardedWriter,
    req: SamplingRequest,
    meta: R.ResponseMeta,
    shape: R.ResponseShape,
    streams: list[RequestStream],
    indices: list[int],
) -> None:
    """Every content event, then the usage event (or an error event: headers are out)."""
    events = _EventBuilder(req, meta, shape, indices)
    try:
        if len(streams) == 1:  # most requests: read the stream itself, no merging layer
            async for delta in streams[0]:
                if data := events.content(0, delta):
                    await writer.write(data)
        else:
            async for pos, delta in merge(streams):
                if data := events.content(pos, delta):
                    await writer.write(data)
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
            usage = R.usage(_prompt_tokens(shape), sum(events.num_output), events.cached)
            await writer.write(event(R.chunk(meta, None, usage, True)))


class _EventBuilder:
    """One streamed response's content events, and the usage they add up to."""

    def __init__(self, req: SamplingRequest, meta: R.ResponseMeta, shape: R.ResponseShape,
                 indices: list[int]) -> None:
        self.meta, self.shape, self.indices, self.n = meta, shape, indices, req.n
        self.continuous_usage = req.continuous_usage
        self.encoder = R.ChunkEncoder(meta, req.include_usage)
        self.num_output = [0] * len(indices)
        self.offsets = [0] * len(indices)
        self.started = [False] * len(indices)
        self.sent_prompt_ids = False
        self.cached = 0
        self.generates = req.generates
        self.tools = [ToolStream(shape.tool_choice) if shape.tool_mode != "none" else None
                      for _ in indices]

    def content(self, pos: int, delta: StreamDelta) -> bytes:
        index, shape = self.indices[pos], self.shape
        delta = delta if self.generates else _prompt_alone(delta)
        self.num_output[pos] = delta.num_output_tokens
        if delta.finished and index % self.n == 0:  # a prompt counts once, as in prompt_tokens
            self.cached += delta.num_cached_tokens
        first, self.started[pos] = not self.started[pos], True
        echo = shape.echoed(index) if first else ""
        logprobs = (
            _delta_logprobs(shape.token_text, self.meta, delta, self.offsets[pos] + len(echo))
            if shape.want_logprobs
            else None
        )
        prompt_ids = shape.prompt_ids[shape.prompt_of(index)]
        if first and logprobs is not None and shape.echo_logprobs is not None:
            prompt = R.echoed_logprobs(
                shape.token_text, prompt_ids, delta.prompt_logprobs, shape.echo_logprobs
            )
            logprobs = R.join_logprobs(prompt, logprobs)
        text = echo + delta.text
        self.offsets[pos] += len(text)
        role = shape.role if first and self.meta.chat else None
        reason, fields = delta.finish_reason, None
        tools = self.tools[pos]
        if tools is not None:
            fields = tools.feed(text, delta.finished)
            if fields is None and not (first or delta.finished):
                return b""  # held back: part of a tool call, or of its opening tag
            if reason == "stop" and tools.calls:
                reason = "tool_calls"
        choice = R.stream_choice(
            self.meta, index, text, reason, delta.stop_reason, logprobs, role,
            fields if fields is not None or tools is None else {},
        )
        extra = self._token_ids(choice, first, index, delta)
        if first and shape.prompt_logprobs:
            lps = R.vllm_prompt_logprobs(shape.token_text, prompt_ids, delta.prompt_logprobs)
            if self.meta.chat:
                extra = {**(extra or {}), "prompt_logprobs": lps}
            else:
                choice["prompt_logprobs"] = lps
        usage = (
            R.usage(len(prompt_ids), delta.num_output_tokens) if self.continuous_usage else None
        )
        return self.encoder.choice_event(choice, usage, extra)

    def _token_ids(
        self, choice: dict[str, Any], first: bool, index: int, delta: StreamDelta
    ) -> dict[str, Any] | None:
        """`return_token_ids`: the chunk's token ids on its choice; the prompt's on a
        completion choice's first chunk, or on the chat response's first chunk."""
        shape = self.shape
        if not shape.return_token_ids:
            return None
        choice["token_ids"] = list(delta.token_ids)
        if not first:
            return None
        if not self.meta.chat:
            choice["prompt_token_ids"] = shape.prompt_ids[shape.prompt_of(index)]
            return None
        if self.sent_prompt_ids:
            return None
        self.sent_prompt_ids = True
        return {"prompt_token_ids": shape.prompt_ids[0]}


def _delta_logprobs(
    token_text: R.TokenText, meta: R.ResponseMeta, delta: StreamDelta, offset: int
) -> dict[str, Any]:
    if meta.chat:
        return R.chat_logprobs(token_text, delta.token_ids, delta.logprobs)
    return R.completion_logprobs(token_text, delta.token_ids, delta.logprobs, offset)
