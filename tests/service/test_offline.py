"""Offline batch inference (`service.offline`, `stepserve generate`): batch lines read and
answered in OpenAI's Batch API shape or bare; the `LLM` class on the default model answers
exactly as the HTTP server does (greedy texts, usage, logprobs, structured outputs); a
refused request fails alone, with the server's status and error; the command writes one
result per line in order, refuses server-only flags by name and exits 2 for a flag the
worker refuses."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from worker_modes import REFERENCE_FLAGS

from service.offline import LLM, Answer, RequestError, read_line, result_line

REPO = Path(__file__).resolve().parents[2]
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
ASK = [{"role": "user", "content": "Name a colour."}]


# -- reading lines and writing results ---------------------------------------------------------


def test_a_bare_body_goes_to_chat_when_it_has_messages() -> None:
    chat = read_line(json.dumps({"messages": ASK, "max_tokens": 4}))
    plain = read_line(json.dumps({"prompt": "hi"}))
    assert (chat.chat, chat.batch_line, chat.error) == (True, False, None)
    assert (plain.chat, plain.batch_line, plain.body) == (False, False, {"prompt": "hi"})


def test_a_batch_line_names_its_endpoint() -> None:
    item = read_line(json.dumps({"custom_id": "r1", "method": "POST", "url": CHAT_URL, "body": {"messages": ASK}}))
    assert (item.chat, item.batch_line, item.custom_id, item.body) == (True, True, "r1", {"messages": ASK})
    item = read_line(json.dumps({"custom_id": "r2", "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": "x"}}))
    assert (item.chat, item.custom_id) == (False, "r2")


@pytest.mark.parametrize(("line", "param", "words"), [
    ("not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}', "url", "/v1/embeddings"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "method", "POST"),
    ('{"method": "POST", "url": "/v1/completions", "body": {}}', "custom_id", "custom_id"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions"}', "body", "body object"),
])
def test_a_wrong_line_is_refused_alone_with_a_400(line: str, param: str | None, words: str) -> None:
    item = read_line(line)
    assert item.error is not None and item.error.status == 400
    assert item.error.param == param and words in item.error.message


def test_a_batch_line_is_answered_in_the_batch_apis_shape() -> None:
    item = read_line(json.dumps({"custom_id": "q", "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": "x"}}))
    ok = result_line(item, Answer(200, {"id": "cmpl-1", "choices": []}))
    assert ok["custom_id"] == "q" and ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1", "choices": []}}
    refused = result_line(item, Answer(400, {"error": {"message": "m"}}))
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] == {"error": {"message": "m"}}
    bare = read_line(json.dumps({"prompt": "x"}))
    assert result_line(bare, Answer(400, {"error": {"message": "m"}})) == {"error": {"message": "m"}}


# -- the LLM class on the default model --------------------------------------------------------


CALLER_BEFORE: list[tuple[tuple[int, int, int], int, int | None]] = []


def _policy() -> int | None:
    return os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    policy = _policy()
    with contextlib.suppress(AttributeError, OSError):  # a caller of its own choosing: SCHED_BATCH
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    CALLER_BEFORE.append((gc.get_threshold(), gc.get_freeze_count(), _policy()))
    try:
        with LLM(*REFERENCE_FLAGS, "--max-num-seqs", "64") as engine:
            yield engine
    finally:
        if policy is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, policy, os.sched_param(0))


@pytest.mark.slow
def test_the_callers_process_is_left_alone(llm: LLM) -> None:
    """The server freezes its start-up heap, tunes its collector and sets its CPU policy; a
    library leaves the caller's as they were."""
    assert (gc.get_threshold(), gc.get_freeze_count(), _policy()) == CALLER_BEFORE[0]


@pytest.fixture(scope="module")
def http(live_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="none")


@pytest.mark.slow
def test_greedy_completions_equal_the_servers(llm: LLM, http: openai.OpenAI) -> None:
    """The same engine in reference mode: each greedy text, its token logprobs and usage as
    the HTTP server answers them, and all four prompts batched together."""
    offline = llm.generate(PROMPTS, max_tokens=12, temperature=0, logprobs=1)
    assert [r["object"] for r in offline] == ["text_completion"] * 4
    for prompt, got in zip(PROMPTS, offline, strict=True):
        want = http.completions.create(model=llm.model_name, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        assert got["choices"][0]["text"] == want.choices[0].text
        assert got["choices"][0]["logprobs"]["tokens"] == want.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert got["usage"] == {"prompt_tokens": want.usage.prompt_tokens, "completion_tokens": 12,  # type: ignore[union-attr]
                                "total_tokens": want.usage.total_tokens}  # type: ignore[union-attr]


@pytest.mark.slow
def test_chat_equals_the_servers_and_takes_many_conversations(llm: LLM, http: openai.OpenAI) -> None:
    one = llm.chat(ASK, max_tokens=10, temperature=0)
    want = http.chat.completions.create(model=llm.model_name, messages=ASK, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert one[0]["choices"][0]["message"]["content"] == want.choices[0].message.content
    two = llm.chat([ASK, [{"role": "user", "content": "Name a number."}]], max_tokens=10, temperature=0)
    assert len(two) == 2 and two[0]["choices"][0]["message"] == one[0]["choices"][0]["message"]


@pytest.mark.slow
def test_structured_output_offline_follows_its_schema(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    body = llm.chat(ASK, max_tokens=40, temperature=0, response_format=fmt)[0]
    assert set(json.loads(body["choices"][0]["message"]["content"])) == {"colour"}


@pytest.mark.slow
def test_a_refused_request_fails_alone(llm: LLM) -> None:
    """`run` answers every body, the bad one with the server's 400 naming its field and the
    others whole; `generate` raises it; nothing is left running."""
    answers = llm.run([{"prompt": "a", "max_tokens": 3}, {"prompt": "b", "temperature": -1},
                       {"prompt": "c", "max_tokens": 3, "stream": True}, {"messages": ASK, "max_tokens": 3}])
    assert [a.status for a in answers] == [200, 400, 400, 200]
    assert answers[1].body["error"]["param"] == "temperature"
    assert answers[2].body["error"]["param"] == "stream"
    assert answers[3].body["object"] == "chat.completion"
    with pytest.raises(RequestError) as exc:
        llm.generate(["fine", "too"], max_tokens=3, logit_bias={"999999999": 1})
    assert exc.value.status == 400 and exc.value.body["error"]["param"] == "logit_bias"
    with pytest.raises(RequestError, match="does not exist"):
        llm.generate("x", model="some-other-model")
    engine = llm._engine.loaded.engine
    deadline = time.monotonic() + 30  # the loop publishes its stats after its next output
    while (engine.stats.num_running, engine.stats.num_waiting, engine.stats.kv_cache_usage) != (0, 0, 0.0):
        assert time.monotonic() < deadline, engine.stats
        time.sleep(0.05)


# -- stepserve generate --------------------------------------------------------------------------


def _generate(tmp: Path, lines: list[str], *flags: str) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "service.cli", "generate", "--input", str(src), "--output", str(out),
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return done, results


@pytest.mark.slow
def test_the_command_answers_every_line_in_order(tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": COMPLETIONS_URL,
                         "body": {"prompt": p, "max_tokens": 6, "temperature": 0}}) for i, p in enumerate(PROMPTS)]
    lines += [json.dumps({"messages": ASK, "max_tokens": 5}), "", "{oops", json.dumps({"prompt": "x", "n": 0})]
    done, results = _generate(tmp_path, lines, *REFERENCE_FLAGS)
    assert done.returncode == 0, done.stderr
    assert len(results) == 7  # the blank line is no request
    assert [r["custom_id"] for r in results[:4]] == ["q0", "q1", "q2", "q3"]
    assert all(r["response"]["status_code"] == 200 for r in results[:4])
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in results[:4])
    assert results[4]["object"] == "chat.completion"
    assert "not valid JSON" in results[5]["error"]["message"] and results[6]["error"]["param"] == "n"
    assert "7 requests, 5 answered, 2 failed (2 x 400)" in done.stderr


def test_the_command_refuses_a_server_flag_by_name(tmp_path: Path) -> None:
    done, results = _generate(tmp_path, ['{"prompt": "x"}'], "--port", "8001")
    assert done.returncode == 2 and "unrecognized arguments: --port" in done.stderr and results == []


def test_the_command_exits_2_for_a_flag_the_worker_refuses(tmp_path: Path) -> None:
    """A KV cache too small for one block is refused by the worker at start-up, named."""
    done, results = _generate(tmp_path, ['{"prompt": "x"}'], *REFERENCE_FLAGS, "--kv-cache-memory", "1KiB")
    assert done.returncode == 2, done.stderr
    assert "stepserve generate: error: argument --kv-cache-memory" in done.stderr and results == []
