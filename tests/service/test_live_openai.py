"""The official `openai` client against a live `stepserve serve` on the default model: the
API, vLLM's extra fields (through `extra_body`) where a real sampler shows their effect, and
/tokenize against the server's own tokenization."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import openai
import pytest

from service.http.openai_routes import bad_words_token_ids

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(live_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_and_usage(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "The capital of France is"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    (choice,) = resp.choices
    assert choice.text and choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_streaming_completion_matches_whole(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_chat_whole_and_streaming(client: openai.OpenAI, tokenizer: Any) -> None:
    from common.tokenizer import apply_chat_template

    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.usage is not None and whole.usage.prompt_tokens == len(apply_chat_template(tokenizer, CHAT))
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content  # the role waits for the first token
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n2_returns_two_choices(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Write a word:", max_tokens=4, temperature=1.0, seed=5, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 8


def test_stop_string(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Count: 1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = full[: full.index(stop)]
    resp = client.completions.create(**kwargs, stop=[stop])
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 6, "temperature": 1.0, "seed": 1234}
    first = client.completions.create(**kwargs).choices[0].text
    assert first == client.completions.create(**kwargs).choices[0].text
    chat: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 1.0, "seed": 99}
    first_chat = client.chat.completions.create(**chat).choices[0].message.content
    assert first_chat == client.chat.completions.create(**chat).choices[0].message.content


MAX_TOKENS = 5  # the CPU model is slow under load; five tokens already show any divergence
PROMPTS = [
    "The quick brown fox",
    "In 1492, Columbus",
    "def fibonacci(n):",
    "The best way to learn is",
    "Water boils at",
    "A haiku about the sea:",
    "Paris is the capital of",
    "Three reasons to exercise:",
]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join([c.choices[0].text async for c in stream if c.choices])


async def test_64_concurrent_greedy_streams_equal_solo_runs(live_server: Any) -> None:
    client = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    solo = {p: await _stream_text(client, p) for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    together = await asyncio.gather(*[_stream_text(client, p) for p in prompts])
    mismatches = [(p, t, solo[p]) for p, t in zip(prompts, together, strict=True) if t != solo[p]]
    assert not mismatches, mismatches[:3]
    await client.close()


def test_min_tokens_holds_off_eos(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40, "temperature": 0}
    short = client.chat.completions.create(**kwargs)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None  # ends with EOS
    floor = short.usage.completion_tokens + 6
    assert floor < 40
    held = client.chat.completions.create(**kwargs, extra_body={"min_tokens": floor})
    assert held.usage is not None and held.usage.completion_tokens >= floor


def _token_ids(choice: Any) -> list[int]:
    """vLLM's `token_ids` (asked for with return_token_ids), which the client keeps as an extra."""
    return list(choice.model_extra["token_ids"])


def test_logit_bias_steers_greedy_sampling(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    extra = {"return_token_ids": True, "ignore_eos": True}
    free = _token_ids(client.completions.create(**kwargs, extra_body=extra).choices[0])
    (target,) = tokenizer.encode(" banana", add_special_tokens=False)[:1]
    forced = client.completions.create(**kwargs, logit_bias={str(target): 100}, extra_body=extra)
    assert _token_ids(forced.choices[0]) == [target] * 4
    banned = client.completions.create(**kwargs, logit_bias={str(free[0]): -100}, extra_body=extra)
    assert _token_ids(banned.choices[0])[0] != free[0]


def test_allowed_token_ids_restrict_the_output(client: openai.OpenAI, tokenizer: Any) -> None:
    allowed = sorted(set(tokenizer.encode(" yes no maybe Yes No", add_special_tokens=False)))
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=3,  # type: ignore[arg-type]
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    )
    ids = _token_ids(resp.choices[0])
    assert len(ids) == 6 and set(ids) <= set(allowed)


def _contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_never_appear(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    free = _token_ids(client.completions.create(**kwargs, extra_body={"return_token_ids": True}).choices[0])
    # a word greedy decoding writes as one token after a space
    word = next(text.strip() for t in free if (text := tokenizer.decode([t])).startswith(" ")
                and text.strip().isalpha() and tokenizer.encode(text, add_special_tokens=False) == [t])
    seqs = bad_words_token_ids(tokenizer, [word])
    assert any(_contains(free, s) for s in seqs)
    banned = client.completions.create(**kwargs, extra_body={"bad_words": [word], "return_token_ids": True})
    ids = _token_ids(banned.choices[0])
    assert ids and not any(_contains(ids, s) for s in seqs), (word, ids)


def _post(server: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def test_tokenize_matches_the_chat_prompt(client: openai.OpenAI, live_server: Any) -> None:
    tokens = _post(live_server, "/tokenize", {"model": MODEL, "messages": CHAT})
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and tokens["count"] == chat.usage.prompt_tokens == len(tokens["tokens"])
    assert tokens["max_model_len"] == 8192
    text = _post(live_server, "/detokenize", {"tokens": tokens["tokens"]})["prompt"]
    assert text.startswith("<|im_start|>") and "Name three colors." in text
    assert _post(live_server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == tokens["tokens"]
