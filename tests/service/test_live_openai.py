"""The official `openai` client against a live `stepserve serve` on the default model."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

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
