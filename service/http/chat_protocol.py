"""OpenAI-compatible chat bodies: messages (text content parts, assistant tool calls, tool
results), the chat prompt's template options (shared with /tokenize), and
`ChatCompletionRequest` with its tool choice (`service.http.tool_calls`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from common.grammar import Constraint
from service.http.errors import APIError, bad_request
from service.http.protocol import (
    MAX_TOP_LOGPROBS,
    RESERVED_TEMPLATE_VARS,
    SAMPLING_REFUSED,
    Body,
    SamplingRequest,
    not_supported,
)
from service.http.tool_calls import forced_schema


class ContentPart(Body):
    """One part of a message's content; a text model takes only `{"type": "text"}` parts."""

    type: str
    text: str | None = None


class ChatMessage(Body):
    """One message of a chat; content may be a string or a list of text parts."""

    REFUSED = {
        "function_call": ((), "function calls (the deprecated form of tool calls)"),
        "audio": ((), "this server serves a text-only model"),
        "refusal": ((), ""),
    }

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    def check_at(self, at: str) -> None:
        """The refusals for this message, `at` naming it (`messages[2]`)."""
        if self.role == "function":
            raise not_supported(f"{at}.role", "'function' messages (use 'tool' messages)")
        try:
            self.check_refused()
        except APIError as exc:
            raise not_supported(f"{at}.{exc.param}") from None
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text":
                raise not_supported(f"{at}.content[{j}].type", "content parts must be text")
            if part.text is None:
                raise bad_request(f"'{at}.content[{j}].text' is a required field",
                                  f"{at}.content[{j}].text")

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (`developer` becomes `system`)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        for key in ("name", "reasoning_content", "reasoning", "tool_call_id"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        if self.tool_calls is not None:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call as templates read it: `arguments` as an object when it is
    JSON text (as vLLM hands it to templates), else as sent."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


class ChatPrompt(Body):
    """How a chat becomes a prompt (shared by /v1/chat/completions and /tokenize)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None  # a name among the model's templates
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None

    def check_prompt(self) -> None:
        for i, message in enumerate(self.messages):
            message.check_at(f"messages[{i}]")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true (set "
                "add_generation_prompt to false to continue the final message)",
                "continue_final_message",
            )
        clash = sorted(RESERVED_TEMPLATE_VARS & set(self.chat_template_kwargs or {}))
        if clash:
            raise bad_request(
                f"chat_template_kwargs may not set {clash[0]!r}, which the request sets",
                "chat_template_kwargs",
            )

    def template_vars(self) -> dict[str, Any]:
        """Extra variables the chat template sees."""
        return dict(self.chat_template_kwargs or {})

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them."""
        return [m.for_template() for m in self.messages]


class ChatCompletionRequest(SamplingRequest, ChatPrompt):
    """POST /v1/chat/completions."""

    REFUSED = {
        **SAMPLING_REFUSED,
        "functions": ((), "function calling"),
        "function_call": (("none",), "function calling"),
        "audio": ((), "this server serves a text-only model"),
        "prediction": ((), "predicted outputs"),
        "web_search_options": ((), "web search"),
        "verbosity": ((), ""),
    }

    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    echo: bool = False  # vLLM: start the reply with the final message when it has its role
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: bool = True  # no reasoning is split from the content to leave out
    modalities: list[Literal["text", "audio"]] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    PROMPT_FIELD = "messages"

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

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

    def check(self) -> None:
        super().check()
        self.check_prompt()
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if self.tools:
            forced_schema(self.tools, self.tool_choice, self.parallel_tool_calls)  # checks
        if self.modalities and "audio" in self.modalities:
            raise not_supported("modalities", "this server serves a text-only model")
        if self.echo and self.logprobs:
            raise not_supported("echo", "with logprobs it needs the prompt's logprobs")
        self.num_logprobs()

    @property
    def tool_mode(self) -> Literal["none", "auto", "forced"]:
        """How tools are called: not at all, parsed from free output, or forced by a grammar.
        With tools and no tool_choice, OpenAI's default is auto."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if not self.tools or choice == "none":
            return "none"
        return "auto" if choice == "auto" else "forced"

    def constraint(self) -> tuple[str, Constraint] | None:
        """A forced tool choice's schema, or the request's own constraint; not both."""
        own = super().constraint()
        if self.tool_mode != "forced":
            return own
        if own is not None:
            raise bad_request(f"a forced tool_choice cannot be combined with {own[0]}", own[0])
        schema = forced_schema(self.tools or [], self.tool_choice, self.parallel_tool_calls)
        return "tool_choice", Constraint("json", schema)

    def template_vars(self) -> dict[str, Any]:
        out = super().template_vars()
        if self.reasoning_effort is not None:  # as vLLM: templates that know it read it
            out.setdefault("reasoning_effort", self.reasoning_effort)
        return out

    @property
    def response_role(self) -> str:
        """The reply's role: the assistant's, or the final message's when it is continued
        without a generation prompt (vLLM's rule)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """What `echo` writes before the reply: the final message, when it has the reply's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role else ""
