"""Tool calls on /v1/chat/completions: the grammar a forced `tool_choice` imposes, the tool
calls read back from the output (forced, or parsed from free output with a tool-call parser),
and their OpenAI shapes, whole and as streamed deltas.

- A named `tool_choice` constrains the output to the function's parameters schema: the
  output *is* the call's arguments.
- `required` constrains it to a JSON array of `{"name", "parameters"}` objects, one of the
  tools each (one object when `parallel_tool_calls` is false), as vLLM does.
- `auto` leaves the output free and parses it with the parser the server was started with
  (`--enable-auto-tool-choice --tool-call-parser hermes`): Hermes' `<tool_call>{"name",
  "arguments"}</tool_call>` blocks, the format Qwen, Hermes and many fine-tunes write.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.http.errors import bad_request

TOOL_CALL_PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def function_names(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> function definition; a 400 naming `tools` for a malformed tool."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or (
            not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
        ):
            raise bad_request(f"tools[{i}] must be a function: "
                              '{"type": "function", "function": {"name": ..., "parameters": ...}}',
                              "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        out[fn["name"]] = fn
    return out


def named_choice(tool_choice: Any) -> str | None:
    """The function a `{"type": "function", "function": {"name": ...}}` choice names."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
        fn.get("name"), str
    ):
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    return str(fn["name"])


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def forced_schema(
    tools: list[dict[str, Any]], tool_choice: Any, parallel: bool
) -> dict[str, Any] | None:
    """The JSON schema a forced choice (named or `required`) puts on the output; None for
    `auto` and `none`."""
    functions = function_names(tools)
    name = named_choice(tool_choice)
    if name is not None:
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools",
                              "tool_choice")
        return _parameters(functions[name])
    if tool_choice != "required":
        return None
    calls = [
        {"type": "object", "properties": {"name": {"enum": [n]}, "parameters": _parameters(fn)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for n, fn in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls a forced choice's (finished) output holds."""
    name = named_choice(tool_choice)
    if name is not None:
        return [ToolCall(name, text)]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in json.loads(text)]


def hermes_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content before the first `<tool_call>` block and the calls of the blocks whose
    JSON parses; the whole text as content when none does."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            args = value.get("arguments", value.get("parameters", {}))
            calls.append(ToolCall(value["name"], json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.index(_HERMES_OPEN)].strip()
    return content or None, calls


class ToolStream:
    """One streamed choice's deltas in tool mode: the text in, `delta` fields out.

    Named: the text is the arguments, streamed as it comes (the first delta names the
    function). Required: the array is held until it ends, then one delta per call. Auto:
    content streams until a `<tool_call>` tag begins (a partial tag is held back), then the
    rest is held and parsed when the choice ends."""

    def __init__(self, tool_choice: Any) -> None:
        self.tool_choice = tool_choice
        self.name = named_choice(tool_choice)
        self.call_id = call_id()
        self.text = ""
        self.sent_content = 0  # characters of `text` already sent as content (auto)
        self.started = False
        self.calls = 0

    def feed(self, piece: str, finished: bool) -> dict[str, Any] | None:
        """The delta's fields for this piece of text (None: nothing to send yet)."""
        self.text += piece
        if self.name is not None:
            return self._named(piece)
        if self.tool_choice == "required":
            if not finished:
                return None
            try:
                return self._calls(forced_calls(self.text, self.tool_choice))
            except ValueError:  # cut short by max_tokens or a stop string: the text as content
                return self._content(len(self.text))
        return self._auto(finished)

    def _named(self, piece: str) -> dict[str, Any] | None:
        fn: dict[str, Any] = {"arguments": piece}
        call: dict[str, Any] = {"index": 0, "function": fn}
        if not self.started:
            self.started = True
            call.update(id=self.call_id, type="function")
            fn["name"] = self.name
        elif not piece:
            return None
        self.calls = 1
        return {"tool_calls": [call]}

    def _calls(self, calls: list[ToolCall]) -> dict[str, Any] | None:
        if not calls:
            return None
        self.calls = len(calls)
        return {"tool_calls": [{"index": i, **c.body()} for i, c in enumerate(calls)]}

    def _auto(self, finished: bool) -> dict[str, Any] | None:
        start = self.text.find(_HERMES_OPEN)
        if finished:
            _, calls = hermes_calls(self.text)
            if calls:
                head = self.text[self.sent_content : start].rstrip() if start > 0 else ""
                out = self._calls(calls) or {}
                return {"content": head, **out} if head else out
            return self._content(len(self.text))
        if start >= 0:
            return self._content(start)
        keep = next((k for k in range(len(_HERMES_OPEN) - 1, 0, -1)
                     if self.text.endswith(_HERMES_OPEN[:k])), 0)
        return self._content(len(self.text) - keep)

    def _content(self, upto: int) -> dict[str, Any] | None:
        if upto <= self.sent_content:
            return None
        piece, self.sent_content = self.text[self.sent_content : upto], upto
        return {"content": piece}
