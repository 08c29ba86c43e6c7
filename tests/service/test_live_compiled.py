"""`stepserve serve` on its defaults (the probe's weight form, the compiled forward, the
C++ attention where it builds) through the official `openai` client: healthy at once on the
eager forward while the compiled one is built, which is then swapped in and loaded at once by
the next start; greedy outputs equal the reference mode's, streams and concurrent requests
complete, and /metrics and /health say how the worker runs."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _worker_labels(server: Any) -> dict[str, str]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        body = resp.read().decode()
    (line,) = [ln for ln in body.splitlines() if ln.startswith("stepserve:worker_info{")]
    return dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].replace('"', "").split(","))


def test_defaults_run_compiled_and_say_so(default_live_server: Any) -> None:
    labels = _worker_labels(default_live_server)
    assert labels["device"] == "cpu" and labels["model_name"] == MODEL
    # a GGUF model never runs bf16 by default: it fails the accuracy gate (see test_fast_mode)
    assert labels["dtype"] == "float32"
    # the C++ attention reads a float16 cache by default (half the bytes of a long decode)
    assert labels["kv_cache_dtype"] == ("float16" if labels["attention_backend"] == "cpu" else "float32")
    log = default_live_server.log_path.read_text()  # whole: /health polls fill its tail
    assert "worker ready" in log
    # no cached build: healthy at once on the eager forward, the compiled one built beside it
    assert default_live_server.first_health == {"status": "ready", "forward": "eager", "compiling": True}
    assert "forward: eager while the compiled forward is built" in log
    assert default_live_server.get_json("/health")[1] == {"status": "ready", "forward": "compiled", "compiling": False}, log
    assert labels["compiled"] == "true"
    assert "worker forward: compiled (built in" in log


def test_a_restart_loads_the_compiled_forward_at_once(default_live_server: Any, start_server: Any, tmp_path: Any) -> None:
    """The build is kept on disk: the next server (same settings, same cache) serves the
    compiled forward from its first /health 200, and the packages stay as they were."""
    before = {p: p.stat().st_mtime_ns for p in default_live_server.aot_cache.rglob("*.pt2")}
    assert before, "the first server kept no build"
    server = start_server(tmp_path, "--max-num-seqs", "16", compiled=True,
                          env={"STEPSERVE_AOT_CACHE": str(default_live_server.aot_cache)})
    try:
        health = server.get_json("/health")[1]
        assert health == {"status": "ready", "forward": "compiled", "compiling": False}, server.log()
        log = server.log_path.read_text()
        assert "compiled (1-token forward" in log and "loaded from" in log
        reply = _client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert reply.choices[0].text
    finally:
        assert server.stop() == 0, server.log()
    assert {p: p.stat().st_mtime_ns for p in default_live_server.aot_cache.rglob("*.pt2")} == before


def test_greedy_outputs_equal_the_reference_mode(default_live_server: Any, live_server: Any) -> None:
    fast, ref = _client(default_live_server), _client(live_server)
    for prompt in PROMPTS:
        kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                  "extra_body": {"ignore_eos": True}}
        assert fast.completions.create(**kwargs).choices[0].text == ref.completions.create(**kwargs).choices[0].text


def test_streams_and_concurrent_requests(default_live_server: Any) -> None:
    client = _client(default_live_server)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0, stream=True,
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)

    def one(i: int) -> int:
        resp = client.completions.create(model=MODEL, prompt=f"Item {i}: " + "word " * (i * 7), max_tokens=10,
                                         temperature=0.8, seed=i, extra_body={"ignore_eos": True})
        assert resp.choices[0].finish_reason == "length"
        return resp.usage.completion_tokens  # type: ignore[union-attr]

    with ThreadPoolExecutor(12) as pool:  # prompt lengths from 3 to 80 tokens: every compiled graph width
        assert list(pool.map(one, range(12))) == [10] * 12
