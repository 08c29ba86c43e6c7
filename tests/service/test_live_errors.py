"""Bad requests against the live server: each gets the right status and an OpenAI-shaped
error, and changes nothing: a good request right after works and no KV block is held."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.slow

OK_BODY = {"prompt": "Hi", "max_tokens": 1}
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (name, method, path, body (dict, or raw bytes), status, param or None)
CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    ("malformed json", "POST", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("body is an array", "POST", COMPLETIONS, b"[1, 2]", 400, None),
    ("missing prompt", "POST", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("prompt wrong type", "POST", COMPLETIONS, {"prompt": 7}, 400, "prompt"),
    ("max_tokens as string", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens zero", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", "POST", COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature over 2", "POST", COMPLETIONS, {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("huge temperature", "POST", CHAT_PATH, {"messages": USER, "temperature": 1e300}, 400, "temperature"),
    ("top_p over 1", "POST", COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("frequency penalty under -2", "POST", CHAT_PATH, {"messages": USER, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("completions logprobs over 5", "POST", COMPLETIONS, {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("min_p over 1", "POST", COMPLETIONS, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("max_completion_tokens zero", "POST", CHAT_PATH, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("negative top_logprobs", "POST", CHAT_PATH, {"messages": USER, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("top_p zero", "POST", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_k negative", "POST", COMPLETIONS, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("n zero", "POST", COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs too many", "POST", COMPLETIONS, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("presence penalty out of range", "POST", COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition penalty zero", "POST", COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_tokens over max_tokens", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("negative stop token id", "POST", COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("stop token id past the vocabulary", "POST", COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**7], "min_tokens": 1, "max_tokens": 2}, 400, "stop_token_ids"),
    ("stop string too long", "POST", COMPLETIONS, {"prompt": "x", "stop": ["a" * 2000]}, 400, "stop"),
    ("too many choices", "POST", COMPLETIONS, {"prompt": ["x"] * 200, "n": 2}, 400, "n"),
    ("seed over 64 bits", "POST", COMPLETIONS, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("seed + n over 64 bits", "POST", COMPLETIONS, {"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed"),
    ("unknown model", "POST", COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("over the context", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("empty prompt", "POST", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty token list", "POST", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("token id out of vocab", "POST", COMPLETIONS, {"prompt": [1, 10**9]}, 400, "prompt"),
    ("empty stop string", "POST", COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("chat echo with logprobs unsupported", "POST", CHAT_PATH, {"messages": USER, "echo": True, "logprobs": True}, 400, "echo"),
    ("max_tokens zero without echo", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("a grammar that does not compile", "POST", COMPLETIONS, {"prompt": "x", "guided_regex": "[a-"}, 400, "guided_regex"),
    ("stream_options wrong type", "POST", COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ("stream_options without stream", "POST", COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("no messages", "POST", CHAT_PATH, {"messages": []}, 400, "messages"),
    ("bad role", "POST", CHAT_PATH, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("top_logprobs without logprobs", "POST", CHAT_PATH, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", "POST", CHAT_PATH, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat over the context", "POST", CHAT_PATH, {"messages": USER, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ("body too large", "POST", COMPLETIONS, b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413, None),
    ("unknown route", "POST", "/v1/embeddings", {"input": "x"}, 404, None),
    ("wrong method", "GET", COMPLETIONS, None, 405, None),
]


def _call(url: str, method: str, body: Any, content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _settled_kv(server: Any) -> dict[str, Any]:
    for _ in range(100):
        _, kv = server.get_json("/debug/kv")
        if kv["num_unfinished_streams"] == 0 and kv["num_running"] == 0 and kv["num_waiting"] == 0:
            return kv
        time.sleep(0.05)
    return kv


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_request(live_server: Any, name: str, method: str, path: str, body: Any, status: int, param: str | None) -> None:
    code, payload = _call(live_server.url + path, method, body)
    assert code == status, payload
    assert set(payload) == {"error"}
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param
    if name.endswith("over the context"):
        assert "8192" in err["message"]  # the limit and the requested total are spelled out
    ok_code, ok = _call(live_server.url + COMPLETIONS, "POST", OK_BODY)
    assert ok_code == 200 and ok["choices"][0]["text"] is not None
    kv = _settled_kv(live_server)
    assert kv["num_free_blocks"] == kv["num_gpu_blocks"], kv


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_non_json_content_type_is_415(live_server: Any, content_type: str) -> None:
    code, payload = _call(live_server.url + COMPLETIONS, "POST", OK_BODY, content_type)
    assert code == 415 and set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == "unsupported_media_type"
    kv = _settled_kv(live_server)
    assert kv["num_free_blocks"] == kv["num_gpu_blocks"] and kv["num_unfinished_streams"] == 0


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 20
