"""Tool calls: the forced choices' schemas, Hermes' `<tool_call>` parser, the streamed deltas
(named: arguments as they come; required: held to the end; auto: content until a tag, a
partial tag held back), and the whole response's message and finish reason."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.http import responses as R
from service.http.errors import APIError
from service.http.tool_calls import ToolStream, forced_calls, forced_schema, hermes_calls

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_forced_schemas() -> None:
    assert forced_schema(TOOLS, NAMED, True) == TOOLS[0]["function"]["parameters"]
    assert forced_schema(TOOLS, "auto", True) is None and forced_schema(TOOLS, "none", True) is None
    required = forced_schema(TOOLS, "required", True)
    assert required is not None and required["minItems"] == 1 and "maxItems" not in required
    assert required["items"]["anyOf"][1]["properties"] == {"name": {"enum": ["now"]}, "parameters": {"type": "object"}}
    assert forced_schema(TOOLS, "required", False)["maxItems"] == 1  # type: ignore[index]
    with pytest.raises(APIError) as info:
        forced_schema(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    assert info.value.param == "tool_choice"


def test_forced_calls() -> None:
    (call,) = forced_calls('{"city":"Oslo"}', NAMED)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Oslo"}') and call.id.startswith("call_")
    calls = forced_calls('[{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"Rome"}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2


def test_hermes_parser() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    content, calls = hermes_calls(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert hermes_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert hermes_calls("plain answer") == ("plain answer", [])
    assert hermes_calls('<tool_call>{"name": "now"}</tool_call>')[0] is None


def test_streamed_named_arguments_come_as_generated() -> None:
    stream = ToolStream(NAMED)
    first = stream.feed('{"ci', False)
    assert first is not None
    (call,) = first["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.feed('ty":"Oslo"}', False) == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo"}'}}]}
    assert stream.feed("", True) is None and stream.calls == 1


def test_streamed_required_calls_come_at_the_end() -> None:
    stream = ToolStream("required")
    assert stream.feed('[{"name":"now",', False) is None
    end = stream.feed('"parameters":{}}]', True)
    assert end is not None and end["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"} and stream.calls == 1
    cut = ToolStream("required")
    assert cut.feed('[{"name":"no', True) == {"content": '[{"name":"no'} and cut.calls == 0  # max_tokens cut it


def test_streamed_auto_content_then_calls() -> None:
    stream = ToolStream("auto")
    assert stream.feed("Sure, checking <tool", False) == {"content": "Sure, checking "}  # a partial tag is held
    assert stream.feed('_call>{"name": "now", "arguments": {}}', False) is None
    end = stream.feed("</tool_call>", True)
    assert end is not None and end["tool_calls"][0]["function"]["name"] == "now" and stream.calls == 1
    plain = ToolStream("auto")
    assert plain.feed("a <b", False) == {"content": "a <b"}  # no tag begins so
    assert plain.feed(" <to", False) == {"content": " "} and plain.feed("ast", True) == {"content": "<toast"} and plain.calls == 0


@pytest.mark.parametrize(("mode", "choice", "text", "finish", "calls"), [
    ("forced", NAMED, '{"city":"Oslo"}', "stop", ["get_weather"]),
    ("forced", NAMED, '{"city":"Os', "length", []),  # cut by max_tokens: the text stays the content
    ("auto", "auto", '<tool_call>{"name": "now", "arguments": {}}</tool_call>', "stop", ["now"]),
    ("auto", "auto", "no call here", "stop", []),
])
def test_whole_response_message(mode: str, choice: Any, text: str, finish: str, calls: list[str]) -> None:
    shape = R.ResponseShape(token_text=str, tool_mode=mode, tool_choice=choice)
    meta = R.ResponseMeta("chatcmpl-x", 0, "m", chat=True)
    body = R.full_response(meta, [R.ChoiceResult(index=0, text=text, finish_reason=finish)], R.usage(1, 1), shape)
    (item,) = body["choices"]
    message = item["message"]
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == calls
    if calls:
        assert item["finish_reason"] == "tool_calls" and message["content"] is None
    else:
        assert item["finish_reason"] == finish and message["content"] == text
