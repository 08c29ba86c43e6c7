"""OpenAI response bodies: completions and chat, whole and as stream chunks, plus logprobs.

Plain dicts (serialized with orjson), in exactly the shapes the `openai` client parses, with
vLLM's additions where a request asks for them: `prompt_token_ids` and `token_ids`
(`return_token_ids`: per choice for completions, the prompt's on the response for chat) and
the usage so far on every chunk (`continuous_usage_stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from scheduler.output import TokenLogprobs
from service.http.tool_calls import forced_calls, hermes_calls

TokenText = Callable[[int], str]  # a token id's own text (`service.engine.detokenizer.TokenTexts`)


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk and response of one HTTP request repeats."""

    id: str
    created: int
    model: str
    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass(frozen=True)
class ResponseShape:
    """What one request asked to see in its choices, beyond the text."""

    token_text: TokenText  # a token's text in logprobs
    n: int = 1  # choices per prompt: choice i answers prompt i // n
    want_logprobs: bool = False
    role: str = "assistant"  # the chat reply's role
    prompt_ids: tuple[list[int], ...] = ()  # each prompt's token ids
    return_token_ids: bool = False
    echo: tuple[str, ...] | None = None  # per prompt: the text written before the completion
    # completions' logprobs start with the echoed prompt's, with this many alternatives
    echo_logprobs: int | None = None
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field
    tool_mode: str = "none"  # chat: "auto" (parsed) or "forced" (a grammar) tool calls
    tool_choice: Any = None

    def prompt_of(self, index: int) -> int:
        return index // self.n

    def echoed(self, index: int) -> str:
        return "" if self.echo is None else self.echo[self.prompt_of(index)]


def token_id_texts(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids`: a token written as 'token_id:{id}'."""
    return f"token_id:{token_id}"


@dataclass
class ChoiceResult:
    """One finished choice of a non-streaming response."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """The `usage` object."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def completion_logprobs(
    token_text: TokenText,
    token_ids: list[int] | tuple[int, ...],
    logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...],
    offset: int,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object for some tokens, text offsets from `offset`."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def echoed_logprobs(
    token_text: TokenText,
    prompt_ids: list[int],
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None,
    k: int,
) -> dict[str, Any]:
    """The completions `logprobs` object of an echoed prompt with `k` alternatives: null
    for its first token (or for every token, if they were not computed), offsets from 0."""
    lps = prompt_logprobs or (None,) * len(prompt_ids)
    body = completion_logprobs(token_text, prompt_ids, (), 0)
    body["token_logprobs"] = [None if lp is None else lp.logprob for lp in lps]
    body["top_logprobs"] = [
        None if lp is None else {token_text(t): v for t, v in lp.top[:k]} for lp in lps
    ]
    return body


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions `logprobs` objects one after the other."""
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(
    token_text: TokenText,
    prompt_ids: list[int],
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else its id and its
    top alternatives' ids -> {logprob, rank, decoded_token}."""
    if prompt_logprobs is None:
        return None
    out: list[dict[str, Any] | None] = []
    for token_id, lp in zip(prompt_ids, prompt_logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                 "decoded_token": token_text(token_id)}}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


def chat_logprobs(
    token_text: TokenText,
    token_ids: list[int] | tuple[int, ...],
    logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...],
) -> dict[str, Any]:
    """The chat `logprobs` object: one entry per token with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        tok = token_text(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}

    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def full_response(
    meta: ResponseMeta,
    choices: list[ChoiceResult],
    usage_body: dict[str, Any],
    shape: ResponseShape,
) -> dict[str, Any]:
    """A whole (non-streaming) completion or chat completion."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        item: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        text = shape.echoed(c.index) + c.text
        if meta.chat:
            item["message"] = {"role": shape.role, "content": text}
            if shape.tool_mode != "none" and c.finish_reason == "stop":
                calls = _tool_message(shape, c.text, item["message"])
                item["finish_reason"] = "tool_calls" if calls else c.finish_reason
            item["logprobs"] = (
                chat_logprobs(shape.token_text, c.token_ids, c.logprobs)
                if shape.want_logprobs
                else None
            )
        else:
            item["text"] = text
            item["logprobs"] = _completion_logprobs(shape, c) if shape.want_logprobs else None
            if shape.return_token_ids:
                item["prompt_token_ids"] = shape.prompt_ids[shape.prompt_of(c.index)]
            if shape.prompt_logprobs:
                prompt = shape.prompt_ids[shape.prompt_of(c.index)]
                item["prompt_logprobs"] = vllm_prompt_logprobs(
                    shape.token_text, prompt, c.prompt_logprobs
                )
        if shape.return_token_ids:
            item["token_ids"] = c.token_ids
        out.append(item)
    body = {
        "id": meta.id,
        "object": meta.object,
        "created": meta.created,
        "model": meta.model,
        "choices": out,
        "usage": usage_body,
    }
    if meta.chat and shape.return_token_ids:
        body["prompt_token_ids"] = shape.prompt_ids[0]
    if meta.chat and shape.prompt_logprobs:  # vLLM puts a chat's on the response
        first = choices[0].prompt_logprobs if choices else None
        body["prompt_logprobs"] = vllm_prompt_logprobs(shape.token_text, shape.prompt_ids[0], first)
    return body


def _tool_message(shape: ResponseShape, text: str, message: dict[str, Any]) -> bool:
    """Put the tool calls a finished chat choice made on its `message`; False if none."""
    if shape.tool_mode == "forced":
        try:
            calls = forced_calls(text, shape.tool_choice)
        except ValueError:  # cut short (a stop string): the text stays the content
            return False
        content = None
    else:
        content, calls = hermes_calls(text)
    if not calls:
        return False
    message["content"] = content
    message["tool_calls"] = [call.body() for call in calls]
    return True


def _completion_logprobs(shape: ResponseShape, c: ChoiceResult) -> dict[str, Any]:
    """A whole choice's logprobs: the echoed prompt's first when echo asked for them."""
    echo = shape.echoed(c.index)
    generated = completion_logprobs(shape.token_text, c.token_ids, c.logprobs, len(echo))
    if shape.echo_logprobs is None:
        return generated
    prompt = shape.prompt_ids[shape.prompt_of(c.index)]
    echoed = echoed_logprobs(shape.token_text, prompt, c.prompt_logprobs, shape.echo_logprobs)
    return join_logprobs(echoed, generated)


def chunk(
    meta: ResponseMeta,
    choice: dict[str, Any] | None,
    usage_body: dict[str, Any] | None,
    include_usage: bool,
) -> dict[str, Any]:
    """One stream chunk; `choice` None makes the final usage-only chunk."""
    body: dict[str, Any] = {
        "id": meta.id,
        "object": meta.chunk_object,
        "created": meta.created,
        "model": meta.model,
        "choices": [] if choice is None else [choice],
    }
    if include_usage:
        body["usage"] = usage_body
    return body


class ChunkEncoder:
    """Stream chunks as SSE events, byte for byte what ``event(chunk(...))`` gives (plus any
    extra top-level fields): the parts every chunk of a response repeats are serialized
    once, only the choice (and the usage, and the extras) per event."""

    __slots__ = ("_prefix", "_suffix", "_include_usage")

    def __init__(self, meta: ResponseMeta, include_usage: bool) -> None:
        head = orjson.dumps(
            {
                "id": meta.id,
                "object": meta.chunk_object,
                "created": meta.created,
                "model": meta.model,
            }
        )
        self._prefix = b"data: " + head[:-1] + b',"choices":['
        self._suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._include_usage = include_usage

    def choice_event(
        self,
        choice: dict[str, Any],
        usage_body: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        """One chunk with one choice; `usage_body` (written only when the request asked for
        usage) and `extra` are top-level fields."""
        if usage_body is None and not extra:
            return self._prefix + orjson.dumps(choice) + self._suffix
        tail = dict(extra or {})
        if self._include_usage:
            tail["usage"] = usage_body
        rest = orjson.dumps(tail)[1:] if tail else b"}"
        return self._prefix + orjson.dumps(choice) + (b"]," if tail else b"]") + rest + b"\n\n"


def stream_choice(
    meta: ResponseMeta,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    logprobs: dict[str, Any] | None,
    role: str | None = None,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The choice object of a content chunk; a chat choice's first one carries its `role`.
    `fields` replace a chat delta's content (tool calls)."""
    item: dict[str, Any] = {"index": index}
    if meta.chat and fields is not None:
        item["delta"] = {"role": role, **fields} if role is not None else fields
    elif meta.chat:
        if role is not None:
            item["delta"] = {"role": role, "content": text}
        else:
            item["delta"] = {"content": text} if text or finish_reason is None else {}
    else:
        item["text"] = text
    item["logprobs"] = logprobs
    item["finish_reason"] = finish_reason
    if finish_reason is not None:
        item["stop_reason"] = stop_reason
    return item
