"""Request models, their translation to SamplingParams, and the error mapping."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from scheduler.sampling import SamplingParamsError
from service.http.chat_protocol import ChatCompletionRequest
from service.http.errors import APIError, from_validation_error
from service.http.protocol import CompletionRequest, SamplingRequest, resolve_max_tokens


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
    assert resolve_max_tokens(default, 30, 120) == 16  # OpenAI's and vLLM's default
    assert resolve_max_tokens(default, 110, 120) == 10  # capped by what the context leaves
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert resolve_max_tokens(chat, 30, 120) == 90  # chat: the rest of the context
    assert resolve_max_tokens(chat, 30, 120, default_max_tokens=12) == 12  # generation config
    assert resolve_max_tokens(default, 30, 120, default_max_tokens=12) == 12


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
        ("completions", "max_tokens", [-1], [1]),  # 0: only with echo (test_request_fields)
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


SAMPLING_FIELDS = ["n", "stream", "ignore_eos", "min_tokens", "priority", "stop", "seed", "user", "max_tokens",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                   "min_p", "stop_token_ids", "include_stop_str_in_output", "logit_bias", "best_of",
                   "stream_options", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids",
                   "bad_words", "truncate_prompt_tokens", "return_token_ids", "response_format", "use_beam_search",
                   "length_penalty", "prompt_logprobs", "structured_outputs", "guided_json", "logits_processors"]


@pytest.mark.parametrize(
    ("model", "base", "extra"),
    [
        (CompletionRequest, {"prompt": "x"}, ["logprobs", "echo", "suffix", "add_special_tokens"]),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": None}]},
         ["logprobs", "top_logprobs", "max_completion_tokens", "echo", "tools", "tool_choice", "functions",
          "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents"]),
    ],
)
def test_null_means_the_default(model: type[SamplingRequest], base: dict[str, object], extra: list[str]) -> None:
    """The SDKs send null for what they leave unset: every field takes its default."""
    nulled = model.model_validate({**base, **dict.fromkeys(SAMPLING_FIELDS + extra)})
    nulled.check()
    plain = model.model_validate(base)
    assert nulled == plain
    assert nulled.sampling_params(8) == plain.sampling_params(8)


def test_unknown_keys_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="service.http.protocol"):
        req = CompletionRequest.model_validate({"prompt": "x", "frobnicate": 3})
    req.check()
    assert "frobnicate" in caplog.text


def test_token_controls_reach_sampling_params() -> None:
    req = CompletionRequest.model_validate(
        {"prompt": "x", "logit_bias": {"42": 100, "7": -100}, "allowed_token_ids": [1, 2, 3]}
    )
    req.check()
    params = req.sampling_params(4, bad_words_token_ids=((5, 6),))
    assert params.logit_bias == ((42, 100.0), (7, -100.0))
    assert params.allowed_token_ids == (1, 2, 3)
    assert params.bad_words_token_ids == ((5, 6),)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
    ],
)
def test_bad_values_name_the_field(body: dict[str, object], param: str) -> None:
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(APIError) as info:
        req.check()
    assert (info.value.status, info.value.param) == (400, param)


def test_stream_options() -> None:
    def opts(**o: object) -> CompletionRequest:
        return CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": o})

    assert (opts().include_usage, opts().continuous_usage) == (False, False)
    assert (opts(include_usage=True).include_usage, opts(include_usage=True).continuous_usage) == (True, False)
    both = opts(include_usage=True, continuous_usage_stats=True)
    assert (both.include_usage, both.continuous_usage) == (True, True)
    alone = opts(continuous_usage_stats=True)  # vLLM's include_usage defaults to true here
    assert (alone.include_usage, alone.continuous_usage) == (True, True)


def test_chat_prompt_fields() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "Sure"}],
         "add_generation_prompt": False, "continue_final_message": True, "echo": True,
         "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
    )
    req.check()
    assert req.chat_messages()[0] == {"role": "user", "content": "hi", "name": "ann"}
    assert req.template_vars() == {"enable_thinking": False, "reasoning_effort": "low"}
    assert req.response_role == "assistant" and req.echo_text() == "Sure"
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert plain.response_role == "assistant" and plain.echo_text() == ""  # the final message is the user's


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "none"}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"echo": True, "logprobs": True}, "echo"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_chat_refusals_name_the_field(body: dict[str, object], param: str) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    with pytest.raises(APIError) as info:
        req.check()
    assert (info.value.status, info.value.param) == (400, param)


def test_tools_with_tool_choice_none_go_to_the_template() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                "tool_choice": "none", "response_format": {"type": "text"}})
    req.check()
    assert req.tools == tools


def test_truncate_prompt_tokens() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": 2})
    assert req.truncated([1, 2, 3, 4], 100) == [3, 4]
    assert CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": -1}).truncated([1, 2, 3], 2) == [2, 3]
    with pytest.raises(APIError) as info:
        CompletionRequest.model_validate({"prompt": "x", "truncate_prompt_tokens": 50}).truncated([1], 10)
    assert info.value.param == "truncate_prompt_tokens"


def test_tool_history_reaches_the_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]})
    req.check()
    _, assistant, tool = req.chat_messages()
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # as templates read it
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_tool_modes_and_forced_constraints() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "g"}}]
    base = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    modes = {None: "auto", "auto": "auto", "none": "none", "required": "forced"}
    for choice, mode in modes.items():
        req = ChatCompletionRequest.model_validate({**base, "tool_choice": choice})
        req.check()
        assert req.tool_mode == mode
    named = ChatCompletionRequest.model_validate({**base, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    param, constraint = named.constraint()  # type: ignore[misc]
    assert param == "tool_choice" and constraint.spec == tools[0]["function"]["parameters"]
    one = ChatCompletionRequest.model_validate({**base, "tool_choice": "required", "parallel_tool_calls": False})
    _, c = one.constraint()  # type: ignore[misc]
    assert c.spec["maxItems"] == 1 and [a["properties"]["name"]["enum"] for a in c.spec["items"]["anyOf"]] == [["f"], ["g"]]
