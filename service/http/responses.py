"""OpenAI response bodies: completions and chat, whole and as stream chunks, plus logprobs.

Plain dicts (serialized with orjson), in exactly the shapes the `openai` client parses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from scheduler.output import TokenLogprobs

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
    token_text: TokenText,
    want_logprobs: bool,
) -> dict[str, Any]:
    """A whole (non-streaming) completion or chat completion."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        item: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if meta.chat:
            item["message"] = {"role": "assistant", "content": c.text}
            item["logprobs"] = (
                chat_logprobs(token_text, c.token_ids, c.logprobs) if want_logprobs else None
            )
        else:
            item["text"] = c.text
            item["logprobs"] = (
                completion_logprobs(token_text, c.token_ids, c.logprobs, 0)
                if want_logprobs
                else None
            )
        out.append(item)
    return {
        "id": meta.id,
        "object": meta.object,
        "created": meta.created,
        "model": meta.model,
        "choices": out,
        "usage": usage_body,
    }


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
    """Stream chunks as SSE events, byte for byte what ``event(chunk(...))`` gives: the parts
    every chunk of a response repeats are serialized once, only the choice per event."""

    __slots__ = ("_prefix", "_suffix")

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

    def choice_event(self, choice: dict[str, Any]) -> bytes:
        return self._prefix + orjson.dumps(choice) + self._suffix


def chat_role_choice(index: int) -> dict[str, Any]:
    """The first chunk of each chat choice announces the assistant role."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def stream_choice(
    meta: ResponseMeta,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    """The choice object of a content chunk."""
    item: dict[str, Any] = {"index": index}
    if meta.chat:
        item["delta"] = {"content": text} if text or finish_reason is None else {}
    else:
        item["text"] = text
    item["logprobs"] = logprobs
    item["finish_reason"] = finish_reason
    if finish_reason is not None:
        item["stop_reason"] = stop_reason
    return item
