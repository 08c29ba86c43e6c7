"""Structured outputs through the HTTP API of a live `stepserve serve` on the default model,
with the official `openai` client unmodified: `response_format` (a JSON schema, a pydantic
model through `parse`, any JSON object), vLLM's `structured_outputs` and its older `guided_*`
names, streamed and whole; a constraint that does not compile is a 400 naming its field and
changes nothing; the compile shows in /metrics."""

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
