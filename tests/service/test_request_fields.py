"""Every request field OpenAI or vLLM defines for the completion routes is honoured or refused
by name: its effect observed through the HTTP app on the instant stand-in worker (a real
worker process, no model), or a 400 whose `param` names it, leaving the engine untouched.
The sampler-side fields' effect on tokens (logit_bias, allowed_token_ids, bad_words) needs a
model that samples: `test_live_openai.py` checks it; here they are checked to arrive in the
engine's `SamplingParams`, tokenized and checked against the vocabulary."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers

from common.tokenizer import Tokenizer, apply_chat_template
from scheduler.sampling import SamplingParams
from service.engine.detokenizer import (
    DetokenizeOptions,
    IncrementalDetokenizer,
    decode,
    decode_output,
)
from service.http.openai_routes import bad_words_token_ids
from service.http.state import ServiceState

ON_APP_LOOP = pytest.mark.asyncio(loop_scope="module")  # the module's app lives on one loop

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
INSTANT_VOCAB = 32000
# The instant stand-in's next token is (last * 31 + position) % 32000: after [T, T] its output
# starts 0, 3 (<|endoftext|>, <repo_name>: two special tokens in a row), then ordinary ones.
T = (-2 * pow(31, -1, INSTANT_VOCAB)) % INSTANT_VOCAB


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(make_client: Callable[..., Any]) -> AsyncIterator[tuple[TestClient, ServiceState]]:
    async with make_client() as pair:
        yield pair


async def _post(client: TestClient, path: str, **body: Any) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _events(client: TestClient, path: str, **body: Any) -> list[dict[str, Any]]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200, await resp.text()
    out = []
    for block in (await resp.text()).split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(orjson.loads(block[6:]))
    return out


@contextmanager
def _recorded(state: ServiceState) -> Iterator[list[tuple[SamplingParams, dict[str, Any]]]]:
    """What the routes hand the engine: each submission's SamplingParams and keywords."""
    engine = state.loaded.engine  # type: ignore[union-attr]
    submit, seen = engine.submit, []

    def record(ids: Any, params: SamplingParams, *args: Any, **kwargs: Any) -> Any:
        seen.append((params, kwargs))
        return submit(ids, params, *args, **kwargs)

    engine.submit = record  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del engine.submit


# -- refused by name -------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # structured outputs: the stand-in has no vocabulary to constrain (a model's server honours
    # them: test_structured_outputs.py)
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    (CHAT, {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format"),
    (CHAT, {"tools": [TOOL]}, "tool_choice"),  # "auto" by default: this server has no parser
    (CHAT, {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    (COMPLETIONS, {"guided_json": {"type": "object"}}, "guided_json"),
    (CHAT, {"guided_regex": "a+"}, "guided_regex"),
    (CHAT, {"guided_choice": ["a", "b"]}, "guided_choice"),
    (COMPLETIONS, {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    # malformed or unhonoured whatever the worker
    (COMPLETIONS, {"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+", "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    (COMPLETIONS, {"structured_outputs": {}}, "structured_outputs"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, "structured_outputs.backend"),
    (COMPLETIONS, {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    (COMPLETIONS, {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    (COMPLETIONS, {"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    (COMPLETIONS, {"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary
    (COMPLETIONS, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    (CHAT, {"echo": True, "logprobs": True}, "echo"),
    (COMPLETIONS, {"best_of": 3, "n": 1}, "best_of"),
    (COMPLETIONS, {"suffix": "The end."}, "suffix"),
    (CHAT, {"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),  # the stand-in: no grammar
    (CHAT, {"tool_choice": "required"}, "tool_choice"),  # no tools
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
    (CHAT, {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[0].type"),
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"length_penalty": 0.5}, "length_penalty"),
    (COMPLETIONS, {"logits_processors": ["my.module:Proc"]}, "logits_processors"),
    (COMPLETIONS, {"cache_salt": "s3cret"}, "cache_salt"),
    (COMPLETIONS, {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    (COMPLETIONS, {"vllm_xargs": {"x": 1}}, "vllm_xargs"),
    (CHAT, {"mm_processor_kwargs": {"size": 3}}, "mm_processor_kwargs"),
    (COMPLETIONS, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"metadata": {"k": "v"}}, "metadata"),
    (CHAT, {"service_tier": "flex"}, "service_tier"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    (CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
    (CHAT, {"continue_final_message": True}, "continue_final_message"),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    (COMPLETIONS, {"logit_bias": {"not-a-token": 5}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"5": 150}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {str(INSTANT_VOCAB): 5}}, "logit_bias"),
    (COMPLETIONS, {"bad_words": ["Hello there"]}, "bad_words"),  # a token past the stand-in's vocabulary
    (COMPLETIONS, {"allowed_token_ids": []}, "allowed_token_ids"),
    (COMPLETIONS, {"allowed_token_ids": [1, INSTANT_VOCAB + 5]}, "allowed_token_ids"),
    (CHAT, {"bad_words": [" "]}, "bad_words"),
    (COMPLETIONS, {"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, _, f in REFUSED])
@ON_APP_LOOP
async def test_unhonoured_fields_are_refused_by_name(app: tuple[TestClient, ServiceState], settled_kv: Any,
                                                     path: str, body: dict[str, Any], param: str) -> None:
    client, _ = app
    base: dict[str, Any] = {"prompt": "Hello"} if path == COMPLETIONS else {"messages": USER}
    resp = await client.post(path, json={**base, "max_tokens": 2, **body})
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    kv = await settled_kv(client)
    assert kv["num_unfinished_streams"] == 0 and kv["num_free_blocks"] == kv["num_gpu_blocks"]


def test_refusals_say_not_supported_yet() -> None:
    from service.http.errors import APIError
    from service.http.protocol import CompletionRequest

    req = CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True})
    with pytest.raises(APIError) as info:
        req.check()
    assert "not supported yet" in info.value.message and "use_beam_search" in info.value.message


# -- honoured --------------------------------------------------------------------------------


@ON_APP_LOOP
async def test_nulls_mean_the_defaults(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    nulls = dict.fromkeys(["n", "stream", "logprobs", "echo", "ignore_eos", "min_tokens", "priority", "stop", "seed",
                           "user", "max_tokens", "presence_penalty", "frequency_penalty", "temperature", "top_p",
                           "best_of", "suffix", "logit_bias", "stream_options", "response_format", "top_k"])
    plain = await _post(client, COMPLETIONS, prompt=[5, 6, 7], temperature=0)
    nulled = await _post(client, COMPLETIONS, prompt=[5, 6, 7], **{**nulls, "temperature": 0})
    assert nulled["choices"][0]["text"] == plain["choices"][0]["text"]
    assert nulled["usage"] == plain["usage"]
    chat_nulls = {k: None for k in ("n", "stream", "logprobs", "top_logprobs", "max_completion_tokens", "tools",
                                    "tool_choice", "functions", "seed", "stop", "user", "echo", "response_format")}
    body = await _post(client, CHAT, messages=[{"role": "user", "content": "hi", "name": None}], max_tokens=2,
                       **chat_nulls)
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 2


@ON_APP_LOOP
async def test_unknown_keys_are_ignored(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    body = await _post(client, COMPLETIONS, prompt="Hello", max_tokens=2, frobnicate={"x": 1})
    assert body["usage"]["completion_tokens"] == 2


@ON_APP_LOOP
async def test_completions_default_to_16_tokens_chat_to_the_context(app: tuple[TestClient, ServiceState]) -> None:
    client, state = app
    body = await _post(client, COMPLETIONS, prompt="Hello", ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16
    chat = await _post(client, CHAT, messages=USER, ignore_eos=True)
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["total_tokens"] == state.loaded.max_model_len  # type: ignore[union-attr]


@ON_APP_LOOP
async def test_token_controls_reach_the_engine(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    """logit_bias (token-id keys), allowed_token_ids and bad_words (tokenized as vLLM does)
    arrive in each choice's SamplingParams."""
    client, state = app
    with _recorded(state) as seen:
        await _post(client, COMPLETIONS, prompt="Hello", max_tokens=2, n=2, logit_bias={"42": 100, "7": -100},
                    allowed_token_ids=[42, 43], bad_words=["world", " blue cat"])
        await _post(client, CHAT, messages=USER, max_tokens=2, bad_words=["world"])
    want_words = bad_words_token_ids(tokenizer, ["world", " blue cat"])
    for params, _ in seen[:2]:
        assert params.logit_bias == ((42, 100.0), (7, -100.0))
        assert params.allowed_token_ids == (42, 43)
        assert params.bad_words_token_ids == want_words
    assert seen[2][0].bad_words_token_ids == bad_words_token_ids(tokenizer, ["world"])


def test_bad_words_are_tokenized_with_and_without_a_leading_space(tokenizer: Any) -> None:
    words = bad_words_token_ids(tokenizer, ["world", "  Paris"])
    assert tuple(tokenizer.encode("world")) in words and tuple(tokenizer.encode(" world")) in words
    assert tuple(tokenizer.encode("Paris")) in words and tuple(tokenizer.encode(" Paris")) in words
    assert len(words) == len(set(words)) == 4


@ON_APP_LOOP
async def test_skip_special_tokens(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    client, _ = app
    ask = {"prompt": [T, T], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    skipped = (await _post(client, COMPLETIONS, **ask))["choices"][0]
    kept = (await _post(client, COMPLETIONS, **ask, skip_special_tokens=False))["choices"][0]
    ids = kept["token_ids"]
    assert ids == skipped["token_ids"] and ids[:2] == [0, 3]  # the stand-in's rule gave two special tokens
    assert kept["text"] == decode(tokenizer, ids, skip_special_tokens=False)
    assert kept["text"].startswith("<|endoftext|><repo_name>")
    assert skipped["text"] == decode(tokenizer, ids) and "<|endoftext|>" not in skipped["text"]
    # ByteLevel decoding writes special tokens back to back already: no space to remove
    joined = (await _post(client, COMPLETIONS, **ask, skip_special_tokens=False,
                          spaces_between_special_tokens=False))["choices"][0]
    assert joined["text"] == kept["text"]
    streamed = await _events(client, COMPLETIONS, **ask, skip_special_tokens=False)
    assert "".join(e["choices"][0]["text"] for e in streamed) == kept["text"]


@ON_APP_LOOP
async def test_the_stop_token_adds_no_text(make_client: Any, setup_cls: Any, tokenizer: Any) -> None:
    """Special tokens kept, EOS still ends the text without showing itself (vLLM), unless
    include_stop_str_in_output."""
    async with make_client(setup=setup_cls(runner="standin_runners:eos_after_5")) as (client, _):
        ask = {"prompt": "Hello", "max_tokens": 20, "skip_special_tokens": False, "return_token_ids": True}
        choice = (await _post(client, COMPLETIONS, **ask))["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == tokenizer.eos_token_id
        assert choice["text"] == decode(tokenizer, choice["token_ids"][:-1], skip_special_tokens=False)
        assert tokenizer.eos_token not in choice["text"]
        shown = (await _post(client, COMPLETIONS, **ask, include_stop_str_in_output=True))["choices"][0]
        assert shown["text"] == choice["text"] + tokenizer.eos_token


def test_spaces_between_special_tokens_on_a_spacing_decoder() -> None:
    """A WordPiece decoder puts a space between tokens, special ones too; with
    spaces_between_special_tokens false, consecutive special tokens are written back to back
    (vLLM's meaning), in the stream and in the whole decode alike."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = Tokenizer(backend, special_tokens={"unk_token": "[UNK]", "bos_token": "[CLS]", "eos_token": "[SEP]"})
    ids = [3, 1, 2, 4, 5, 2, 1]
    want = {
        DetokenizeOptions(True, True): "hello worlds",
        DetokenizeOptions(False, True): "hello [CLS] [SEP] worlds [SEP] [CLS]",
        DetokenizeOptions(False, False): "hello [CLS][SEP] worlds [SEP][CLS]",
    }
    for options, text in want.items():
        detok = IncrementalDetokenizer(tok, options)
        streamed = "".join(detok.add([t]) for t in ids) + detok.finish()
        assert streamed == decode_output(tok, ids, options) == text


@ON_APP_LOOP
async def test_return_token_ids(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    client, _ = app
    body = await _post(client, COMPLETIONS, prompt=["Hello", "Bye now"], n=2, max_tokens=4, ignore_eos=True,
                       return_token_ids=True)
    for choice in body["choices"]:
        prompt = ["Hello", "Bye now"][choice["index"] // 2]
        assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
        assert len(choice["token_ids"]) == 4 and choice["text"] == decode(tokenizer, choice["token_ids"])
    plain = await _post(client, COMPLETIONS, prompt="Hello", max_tokens=4, ignore_eos=True)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    events = await _events(client, COMPLETIONS, prompt="Hello", max_tokens=4, ignore_eos=True, return_token_ids=True)
    assert events[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode("Hello")
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == body["choices"][0]["token_ids"]
    chat = await _post(client, CHAT, messages=USER, max_tokens=3, ignore_eos=True, return_token_ids=True)
    assert chat["prompt_token_ids"] == apply_chat_template(tokenizer, USER)
    assert len(chat["choices"][0]["token_ids"]) == 3
    chunks = await _events(client, CHAT, messages=USER, max_tokens=3, ignore_eos=True, return_token_ids=True, n=2)
    assert [c.get("prompt_token_ids") is not None for c in chunks].count(True) == 1
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]


@ON_APP_LOOP
async def test_return_tokens_as_token_ids(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    body = await _post(client, COMPLETIONS, prompt="Hello", max_tokens=3, ignore_eos=True, logprobs=1,
                       return_token_ids=True, return_tokens_as_token_ids=True)
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = await _post(client, CHAT, messages=USER, max_tokens=2, logprobs=True, return_tokens_as_token_ids=True)
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


@ON_APP_LOOP
async def test_echo(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    client, _ = app
    plain = await _post(client, COMPLETIONS, prompt="Hello there", max_tokens=4, ignore_eos=True)
    echoed = await _post(client, COMPLETIONS, prompt="Hello there", max_tokens=4, ignore_eos=True, echo=True)
    assert echoed["choices"][0]["text"] == "Hello there" + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]
    events = await _events(client, COMPLETIONS, prompt="Hello there", max_tokens=4, ignore_eos=True, echo=True)
    assert "".join(e["choices"][0]["text"] for e in events) == echoed["choices"][0]["text"]
    ids = await _post(client, COMPLETIONS, prompt=[100, 200], max_tokens=2, echo=True, return_token_ids=True)
    assert ids["choices"][0]["text"].startswith(decode(tokenizer, [100, 200], skip_special_tokens=False))
    convo = [{"role": "user", "content": "Say a colour"}, {"role": "assistant", "content": "The colour is"}]
    ask = {"messages": convo, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3,
           "ignore_eos": True}
    reply = await _post(client, CHAT, **ask)
    echo_reply = await _post(client, CHAT, **ask, echo=True)
    assert echo_reply["choices"][0]["message"]["content"] == "The colour is" + reply["choices"][0]["message"]["content"]
    chunks = await _events(client, CHAT, **ask, echo=True)
    assert chunks[0]["choices"][0]["delta"]["content"].startswith("The colour is")


@ON_APP_LOOP
async def test_echo_with_logprobs_and_prompt_logprobs(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    """The evaluation harnesses' request (echo, logprobs, max_tokens 0 or 1) and vLLM's
    prompt_logprobs, in their shapes (the stand-in's logprobs are made up: 0.0 for the
    token, which comes first; their values on a model: test_prompt_logprobs.py)."""
    client, _ = app
    prompt = [101, 202, 303, 404]
    texts = [tokenizer.decode([t]) for t in prompt]
    one = await _post(client, COMPLETIONS, prompt=prompt, max_tokens=1, echo=True, logprobs=1, ignore_eos=True)
    lp = one["choices"][0]["logprobs"]
    assert lp["tokens"][:4] == texts and len(lp["tokens"]) == 5
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:4] == [0.0, 0.0, 0.0]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {texts[1]: 0.0}
    assert lp["text_offset"][:4] == [0, len(texts[0]), len(texts[0] + texts[1]), len("".join(texts[:3]))]
    assert lp["text_offset"][4] == len(one["choices"][0]["text"]) - len(lp["tokens"][4])
    assert one["usage"]["completion_tokens"] == 1
    zero = await _post(client, COMPLETIONS, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    (choice,) = zero["choices"]
    assert choice["text"] == "".join(texts) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == texts and choice["logprobs"]["top_logprobs"][1] == {}
    assert zero["usage"]["completion_tokens"] == 0 and "prompt_logprobs" not in choice
    events = await _events(client, COMPLETIONS, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    vllm = await _post(client, COMPLETIONS, prompt=prompt, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    (pl0, pl1, *_rest) = vllm["choices"][0]["prompt_logprobs"]
    assert pl0 is None and pl1[str(prompt[1])] == {"logprob": 0.0, "rank": 1, "decoded_token": texts[1]}
    assert len(pl1) == 2 and vllm["choices"][0]["logprobs"] is None
    chat = await _post(client, CHAT, messages=USER, max_tokens=1, prompt_logprobs=0)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    chunks = await _events(client, CHAT, messages=USER, max_tokens=1, prompt_logprobs=0)
    assert chunks[0]["prompt_logprobs"] == chat["prompt_logprobs"]


@ON_APP_LOOP
async def test_chat_prompt_controls(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    """add_generation_prompt, continue_final_message, add_special_tokens, chat_template (a
    name), chat_template_kwargs, documents and reasoning_effort build the prompt the chat
    template renders; usage and prompt_token_ids show it."""
    client, state = app
    convo = [{"role": "user", "content": "Say a colour"}, {"role": "assistant", "content": "The colour is"}]

    async def prompt_ids(**body: Any) -> list[int]:
        out = await _post(client, CHAT, max_tokens=1, return_token_ids=True, **body)
        assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
        return list(out["prompt_token_ids"])

    assert await prompt_ids(messages=USER) == apply_chat_template(tokenizer, USER)
    assert await prompt_ids(messages=USER, add_generation_prompt=False) == apply_chat_template(tokenizer, USER, False)
    continued = await prompt_ids(messages=convo, add_generation_prompt=False, continue_final_message=True)
    text = decode(tokenizer, continued, skip_special_tokens=False)
    assert text.endswith("The colour is") and continued == apply_chat_template(
        tokenizer, convo, False, continue_final_message=True)
    reply = await _post(client, CHAT, messages=USER, add_generation_prompt=False, max_tokens=1)
    assert reply["choices"][0]["message"]["role"] == "user"  # vLLM: the final message's role
    probe = ("{{ flavour | default('plain') }}|{{ reasoning_effort | default('-') }}|"
             "{% for d in documents or [] %}{{ d.title }};{% endfor %}{{ messages[-1].content }}")
    tokenizer.chat_templates["probe"] = probe
    try:
        ids = await prompt_ids(messages=USER, chat_template="probe", chat_template_kwargs={"flavour": "mint"},
                               documents=[{"title": "Doc1", "text": "x"}], reasoning_effort="low")
        assert decode(tokenizer, ids, skip_special_tokens=False) == "mint|low|Doc1;hi"
        assert decode(tokenizer, await prompt_ids(messages=USER, chat_template="probe"),
                      skip_special_tokens=False) == "plain|-|hi"
    finally:
        del tokenizer.chat_templates["probe"]
    assert state.loaded.engine.tokenizer is tokenizer  # type: ignore[union-attr]


@ON_APP_LOOP
async def test_truncate_prompt_tokens(app: tuple[TestClient, ServiceState], tokenizer: Any) -> None:
    client, _ = app
    prompt = list(range(9000, 9020))
    body = await _post(client, COMPLETIONS, prompt=prompt, max_tokens=2, truncate_prompt_tokens=5,
                       return_token_ids=True)
    assert body["usage"]["prompt_tokens"] == 5 and body["choices"][0]["prompt_token_ids"] == prompt[-5:]
    same = await _post(client, COMPLETIONS, prompt=prompt[-5:], max_tokens=2)
    assert same["choices"][0]["text"] == body["choices"][0]["text"]
    chat = await _post(client, CHAT, messages=USER, max_tokens=1, truncate_prompt_tokens=3, return_token_ids=True)
    assert chat["prompt_token_ids"] == apply_chat_template(tokenizer, USER)[-3:]


@ON_APP_LOOP
async def test_usage_in_every_chunk(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    events = await _events(client, COMPLETIONS, prompt="Hello", max_tokens=5, ignore_eos=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    content, final = events[:-1], events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(e["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for e in content)
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in content)
    chat = await _events(client, CHAT, messages=USER, max_tokens=3, ignore_eos=True,
                         stream_options={"continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in chat) and chat[-1]["usage"]["completion_tokens"] == 3
    only_end = await _events(client, CHAT, messages=USER, max_tokens=3, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in only_end[:-1]) and only_end[-1]["usage"]["completion_tokens"] == 3


@ON_APP_LOOP
async def test_request_id_names_the_response(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    body = await _post(client, COMPLETIONS, prompt="Hello", max_tokens=1, request_id="my-req-1")
    assert body["id"] == "cmpl-my-req-1"
    twice = [await _post(client, CHAT, messages=USER, max_tokens=1, request_id="same") for _ in range(2)]
    assert [b["id"] for b in twice] == ["chatcmpl-same"] * 2


@ON_APP_LOOP
async def test_tenant_and_misc_fields(app: tuple[TestClient, ServiceState]) -> None:
    """safety_identifier names the tenant when `user` does not; best_of equal to n, a
    text response_format, tool_choice none, include_reasoning, parallel_tool_calls,
    prompt_cache_key and service_tier 'auto' are accepted as the no-ops they are here."""
    client, state = app
    with _recorded(state) as seen:
        await _post(client, CHAT, messages=USER, max_tokens=1, safety_identifier="team-a")
        await _post(client, CHAT, messages=USER, max_tokens=1, safety_identifier="team-a", user="alice")
        await _post(client, CHAT, messages=USER, max_tokens=1, best_of=1, response_format={"type": "text"},
                    tool_choice="none", tools=[TOOL], include_reasoning=False, parallel_tool_calls=False,
                    prompt_cache_key="k", service_tier="auto", modalities=["text"], store=False)
    assert [kw["user"] for _, kw in seen] == ["team-a", "alice", None]


@ON_APP_LOOP
async def test_tokens_out_of_the_vocabulary_name_their_field(app: tuple[TestClient, ServiceState]) -> None:
    client, _ = app
    for field, value in (("stop_token_ids", [INSTANT_VOCAB]), ("allowed_token_ids", [INSTANT_VOCAB + 1]),
                         ("logit_bias", {str(INSTANT_VOCAB + 2): 1.0})):
        resp = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1, field: value})
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == field and str(INSTANT_VOCAB) in err["message"]
