"""Structured outputs and tool calls through the HTTP API of a live `stepserve serve` on the
default model, with the official `openai` client unmodified: `response_format` (a JSON
schema, a pydantic model through `parse`, any JSON object), vLLM's `structured_outputs` and
its older `guided_*` names, streamed and whole; a constraint that does not compile is a 400
naming its field and changes nothing; the compile shows in /metrics; a forced tool choice
(named or required) returns calls whose arguments validate, whole and streamed, and tool
results in the history reach the model."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a fictional city as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool
    climate: Literal["dry", "wet", "cold"]


@pytest.fixture(scope="module")
def client(live_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(live_server: Any) -> str:
    with urllib.request.urlopen(live_server.url + "/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, max_tokens=80, temperature=0)  # type: ignore[arg-type]
    (choice,) = resp.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_streamed_json_schema_reassembles_to_a_valid_object(client: openai.OpenAI) -> None:
    schema = {**City.model_json_schema(), "additionalProperties": False}  # as strict mode wants
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "response_format": fmt, "max_tokens": 80, "temperature": 0.8, "seed": 3}
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == text  # seeded: the same tokens either way


def test_json_object_on_completions_n_choices(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60, n=2, temperature=0.7, seed=5,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert len(resp.choices) == 2
    for choice in resp.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # cut by max_tokens: truncated JSON, as every server returns it
            assert choice.finish_reason == "length" and choice.text.startswith("{")


@pytest.mark.parametrize(("body", "check"), [
    ({"structured_outputs": {"choice": ["north", "south", "east", "west"]}}, lambda t: t in ("north", "south", "east", "west")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}}, lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
    ({"guided_grammar": 'root ::= "The answer is " [0-9]+ "."'}, lambda t: re.fullmatch(r"The answer is \d+\.", t)),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}}},
     lambda t: 2 <= len(json.loads(t)) <= 4),
])
def test_vllm_constraints(client: openai.OpenAI, body: dict[str, Any], check: Any) -> None:
    resp = client.completions.create(model=MODEL, prompt="Question: which one? Answer:", max_tokens=40, temperature=0, extra_body=body)
    (choice,) = resp.choices
    assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_it(client: openai.OpenAI, live_server: Any, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    metrics = _metrics(live_server)
    assert _metric(metrics, "stepserve:num_requests_waiting_for_grammar") == 0
    assert _metric(metrics, "stepserve:num_requests_running") == 0


def test_compiles_are_cached_and_counted(client: openai.OpenAI, live_server: Any) -> None:
    body = {"structured_outputs": {"regex": "(ab){2,3}c"}}
    before = _metric(_metrics(live_server), "stepserve:grammar_compile_seconds_count")
    for _ in range(3):
        resp = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0, extra_body=body)
        assert re.fullmatch("(ab){2,3}c", resp.choices[0].text)
    assert _metric(_metrics(live_server), "stepserve:grammar_compile_seconds_count") == before + 1


# -- tool calls: a forced choice is a grammar ----------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                                      "required": ["a", "b"], "additionalProperties": False}}},
]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0)  # type: ignore[arg-type]
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]


def test_a_streamed_tool_call_reassembles_to_the_same_arguments(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert parts[0].id and parts[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert "".join(p.function.arguments or "" for p in parts) == whole.choices[0].message.tool_calls[0].function.arguments  # type: ignore[index, union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_or_more_tools(client: openai.OpenAI) -> None:
    for parallel in (True, False):
        resp = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                              parallel_tool_calls=parallel, max_tokens=120, temperature=0)
        (choice,) = resp.choices
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]


def test_tool_results_in_the_history_reach_the_model(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0)  # type: ignore[arg-type]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [*WEATHER_ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    resp = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert resp.choices[0].message.content and resp.usage is not None
    assert resp.usage.prompt_tokens > first.usage.prompt_tokens + 5  # type: ignore[union-attr]


def test_auto_needs_a_parser_on_this_server(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, max_tokens=5)  # type: ignore[arg-type]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tool_choice"
