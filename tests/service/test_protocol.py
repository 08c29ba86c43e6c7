"""Request models, their translation to SamplingParams, and the error mapping."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.sampling import SamplingParamsError
from service.http.errors import APIError, from_validation_error
from service.http.protocol import ChatCompletionRequest, CompletionRequest, resolve_max_tokens


def test_sampling_params_carry_every_field() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 3,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
            "repetition_penalty": 1.1,
            "stop_token_ids": [5],
            "ignore_eos": True,
            "min_tokens": 2,
            "priority": -1,
            "logprobs": 2,
            "n": 2,
        }
    )
    p = req.sampling_params(max_tokens=7)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (7, 0.5, 0.9, 40, 0.05, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert (p.stop_token_ids, p.ignore_eos, p.min_tokens, p.priority, p.logprobs, p.n) == ((5,), True, 2, -1, 2, 2)


def test_chat_fields() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 4,
            "max_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    assert req.chat_messages() == [{"role": "system", "content": "ab"}]
    assert req.requested_max_tokens() == 4
    assert req.num_logprobs() == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_validation_errors_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    err = from_validation_error(info.value)
    assert err.status == 400
    assert err.param == field
    assert field in err.message


def test_nested_message_error_names_the_path() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]})
    assert from_validation_error(info.value).param == "messages[1].role"


def test_a_rule_between_two_fields_is_a_sampling_error_with_param() -> None:
    """Ranges of one field are the model's; min_tokens <= max_tokens (known only once the
    context sets max_tokens) is SamplingParams'."""
    req = CompletionRequest.model_validate({"prompt": "x", "min_tokens": 5})
    with pytest.raises(SamplingParamsError) as info:
        req.sampling_params(max_tokens=4)
    assert info.value.param == "min_tokens"


def test_context_length_message_has_the_numbers() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 100})
    with pytest.raises(APIError) as info:
        resolve_max_tokens(req, 30, 120)
    assert info.value.status == 400
    assert all(str(n) in info.value.message for n in (120, 130, 30, 100))
    default = CompletionRequest.model_validate({"prompt": "x"})
    assert resolve_max_tokens(default, 30, 120) == 90


def test_stop_checks() -> None:
    with pytest.raises(APIError):
        CompletionRequest.model_validate({"prompt": "x", "stop": ["a", ""]}).check()
    req = CompletionRequest.model_validate({"prompt": "x", "stop": "END"})
    req.check()
    assert req.stop_strings == ("END",)


@pytest.mark.parametrize(
    ("route", "field", "bad", "good"),
    [
        # OpenAI's documented ranges
        ("completions", "temperature", [-0.1, 2.01], [0, 2]),
        ("chat", "temperature", [2.5], [0.0, 1.3]),
        ("completions", "top_p", [0, 1.01], [0.01, 1]),
        ("completions", "presence_penalty", [-2.1, 2.1], [-2, 2]),
        ("chat", "frequency_penalty", [-2.5, 3], [-2.0, 2.0]),
        ("completions", "logprobs", [-1, 6], [0, 5]),
        ("chat", "top_logprobs", [-1, 21], [0, 20]),
        ("completions", "n", [0, -3], [1, 4]),
        ("completions", "max_tokens", [0, -1], [1]),
        ("chat", "max_completion_tokens", [0], [1]),
        # vLLM's ranges for its extensions
        ("completions", "top_k", [-2], [-1, 0, 1, 50]),
        ("completions", "min_p", [-0.1, 1.1], [0, 1]),
        ("completions", "repetition_penalty", [0, -1], [0.01, 2, 5]),
        ("completions", "min_tokens", [-1], [0, 3]),
    ],
)
def test_documented_ranges(route: str, field: str, bad: list[float], good: list[float]) -> None:
    model = CompletionRequest if route == "completions" else ChatCompletionRequest
    base: dict[str, object] = {"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    if field == "top_logprobs":
        base["logprobs"] = True
    for value in good:
        req = model.model_validate({**base, field: value, "max_tokens": 8})
        req.check()
        req.num_logprobs()
        if field not in ("n", "max_completion_tokens"):
            req.sampling_params(max_tokens=8)
    for value in bad:
        with pytest.raises(ValidationError) as info:
            model.model_validate({**base, field: value})
        err = from_validation_error(info.value)
        assert (err.status, err.param) == (400, field) and str(value) in err.message
