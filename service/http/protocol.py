"""OpenAI-compatible request bodies (pydantic v2) and their translation to `SamplingParams`.

Types are strict: a string where a number belongs is a 400, not a silent coercion. Ranges
are those the OpenAI API documents (temperature 0..2, top_p 0..1, penalties -2..2,
completions `logprobs` 0..5, chat `top_logprobs` 0..20, n and max_tokens at least 1) and,
for the vLLM extensions, those vLLM's `SamplingParams` enforces (top_k >= -1, min_p 0..1,
repetition_penalty > 0, min_tokens >= 0); a value outside one is a 400 naming the field.
`SamplingParams` checks what it needs again (and what relates two fields, such as
min_tokens <= max_tokens). Unknown fields are ignored, as OpenAI clients send extras.

A field a request leaves unset takes the server's `GenerationDefaults` (the model's
generation_config.json, as vLLM's `--generation-config auto`), else `SamplingParams`' default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from scheduler.sampling import SamplingParams, SamplingParamsError
from service.http.errors import APIError, bad_request

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # matching costs up to O(len) per token in the engine's loop
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for the requests that leave a field unset (None: no default here)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config.json's max_new_tokens

    def __post_init__(self) -> None:
        """Ranges as `SamplingParams` checks them; SamplingParamsError names the field."""
        SamplingParams(**self.sampling())
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
            )

    def sampling(self) -> dict[str, Any]:
        """The sampling fields that have a default."""
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name != "max_tokens" and (v := getattr(self, f.name)) is not None
        }

    def describe(self) -> str:
        """'temperature=0.6, top_p=0.9' for the start-up log ('none' when nothing is set)."""
        items = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return ", ".join(f"{k}={v:g}" for k, v in items if v is not None) or "none"


NO_DEFAULTS = GenerationDefaults()
# where `create_app` keeps the server's defaults for the routes
GENERATION_DEFAULTS = web.AppKey("stepserve_generation_defaults", GenerationDefaults)


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` changes anything."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: Annotated[int | None, Field(ge=-1)] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # non-negative and in the vocabulary: checked later
    repetition_penalty: Annotated[float | None, Field(gt=0.0)] = None
    priority: int = 0
    include_stop_str_in_output: bool = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple; empty strings are rejected by `check`."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        """Checks pydantic cannot express: stop strings must be non-empty and few."""
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", "stop"
            )
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise bad_request(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters", "stop"
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for (None: up to the context)."""
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """How many top logprobs to return per token (None: no logprobs)."""
        return None

    def sampling_params(
        self, max_tokens: int, defaults: GenerationDefaults = NO_DEFAULTS
    ) -> SamplingParams:
        """Translate to `SamplingParams`, the unset fields from `defaults`; raises
        `SamplingParamsError` for out-of-range values."""
        opt: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        fallback = defaults.sampling()
        opt = {k: fallback.get(k) if v is None else v for k, v in opt.items()}
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=self.num_logprobs(),
            priority=self.priority,
            **{k: v for k, v in opt.items() if v is not None},
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] = None
    echo: bool = False
    suffix: str | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string or token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        super().check()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` content part (the only kind a text model takes)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat; content may be a string or a list of text parts."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them (`developer` maps to `system`)."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
        return out


def resolve_max_tokens(
    req: _SamplingRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int | None = None,
) -> int:
    """The completion budget, checked against the context; 400 with the numbers if over.
    Unset, it is what the context leaves, capped at `default_max_tokens` when given."""
    requested = req.requested_max_tokens()
    param = (
        "max_completion_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    what = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has {num_prompt_tokens} tokens, leaving no room for the completion. "
            f"Please reduce the length of the {what}.",
            param=what,
            code="context_length_exceeded",
        )
    if requested is None:
        room = max_model_len - num_prompt_tokens
        return room if default_max_tokens is None else min(room, default_max_tokens)
    if num_prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"{what}, {requested} for the completion). Please reduce the length of the "
            f"{what} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested
