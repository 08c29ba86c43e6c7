"""The load generator end to end against a fake OpenAI-compatible SSE server, and once
against a live `stepserve serve`.

The fake server streams one chunk per token with known gaps and known usage, fails some
requests on purpose (HTTP 400 for max_tokens 7, an error event mid-stream for max_tokens
9), and counts requests in flight, so every figure the load generator reports is checked
against what the server did. The live server runs the instant stand-in worker behind the
real engine, HTTP layer and tokenizer; a server that does not start fails the test.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadgen.bench import main, run_benchmark
from loadgen.sse_client import Target
from loadgen.workloads import WorkloadRequest

FIRST_TOKEN_DELAY = 0.05
TOKEN_GAP = 0.02
API_KEY = "secret"


@dataclass
class FakeServer:
    """A fake server on a background event loop, and what it saw."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _chunk(text: str, chat: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"id": "x", "choices": [choice]}


async def _stream(request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    # An empty first chunk (a chat role chunk) must not count as the first token.
    await resp.write(_sse({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, "text": ""}]}))
    await asyncio.sleep(FIRST_TOKEN_DELAY)
    for i in range(n):
        if i:
            await asyncio.sleep(TOKEN_GAP)
        if n == 9 and i == 1:
            await resp.write(_sse({"error": {"message": "engine exploded", "code": 500}}))
            return resp
        await resp.write(_sse(_chunk(f" t{i}", chat)))
    prompt = body.get("prompt", body.get("messages"))
    usage = {"prompt_tokens": len(prompt) + 1, "completion_tokens": n, "total_tokens": len(prompt) + 1 + n}
    await resp.write(_sse({"id": "x", "choices": [], "usage": usage}))
    await resp.write(_sse("[DONE]"))
    return resp


def _make_app(state: FakeServer) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"error": {"message": "bad api key"}}, status=401)
        body = await request.json()
        state.bodies.append(body)
        if body["max_tokens"] == 7:
            return web.json_response({"error": {"message": "max_tokens 7 is not allowed"}}, status=400)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            return await _stream(request, body, request.path.endswith("chat/completions"))
        finally:
            state.in_flight -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    state, loop, ready = FakeServer(), asyncio.new_event_loop(), threading.Event()
    runner = web.AppRunner(_make_app(state))

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        state.url = f"http://127.0.0.1:{port}"
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop)
    assert ready.wait(10), "fake server did not start"
    yield state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _requests(output_lens: list[int], rate_gap: float = 0.0) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(f"req-{i}", i * rate_gap, 3, n, priority=i % 2, prompt_token_ids=[11, 12, 13])
        for i, n in enumerate(output_lens)
    ]


def test_every_request_accounted_for(server: FakeServer) -> None:
    target = Target(server.url + "/v1/completions", "fake-model", API_KEY, ignore_eos=True)
    output_lens = [4, 7, 1, 9, 5, 7]
    records, duration = asyncio.run(run_benchmark(_requests(output_lens), target, progress=False))
    assert [r.request_id for r in records] == [f"req-{i}" for i in range(6)]
    assert [r.success for r in records] == [True, False, True, False, True, False]
    assert records[1].error == "HTTP 400: max_tokens 7 is not allowed"
    assert "engine exploded" in records[3].error
    assert records[3].generated_text == " t0"  # what streamed before the error event
    assert records[0].generated_text == " t0 t1 t2 t3"
    for rec, n in zip(records, output_lens, strict=True):
        if rec.success:
            assert rec.output_tokens == n and rec.prompt_tokens == 4  # from usage, not the workload
            assert len(rec.itls) == n - 1
            assert rec.ttft >= FIRST_TOKEN_DELAY * 0.8  # the empty role chunk is not a token
            assert all(gap >= TOKEN_GAP * 0.5 for gap in rec.itls)
            assert rec.e2el >= rec.ttft + sum(rec.itls) * 0.99
    assert duration >= max(r.start_time + r.e2el for r in records) * 0.99


def test_payload_fields(server: FakeServer) -> None:
    server.bodies.clear()
    target = Target(server.url + "/v1/completions", "fake-model", API_KEY, ignore_eos=True)
    asyncio.run(run_benchmark(_requests([2, 3]), target, progress=False))
    body = next(b for b in server.bodies if b["max_tokens"] == 3)
    assert body["prompt"] == [11, 12, 13] and body["model"] == "fake-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 3 and body["priority"] == 1


def test_arrivals_and_concurrency_cap(server: FakeServer) -> None:
    server.max_in_flight = 0
    target = Target(server.url + "/v1/completions", "fake-model", API_KEY)
    reqs = _requests([3] * 6, rate_gap=0.01)
    records, _ = asyncio.run(run_benchmark(reqs, target, max_concurrency=2, progress=False))
    assert all(r.success for r in records)
    assert all(r.start_time >= r.arrival_time for r in records)  # never sent early
    assert server.max_in_flight == 2


def test_wrong_api_key_fails_every_request(server: FakeServer) -> None:
    target = Target(server.url + "/v1/completions", "fake-model", "wrong")
    records, _ = asyncio.run(run_benchmark(_requests([2, 2]), target, progress=False))
    assert [r.error for r in records] == ["HTTP 401: bad api key"] * 2


def test_connection_refused_is_a_failure() -> None:
    target = Target("http://127.0.0.1:9/v1/completions", "m")
    records, _ = asyncio.run(run_benchmark(_requests([2]), target, progress=False))
    assert not records[0].success and records[0].error


def test_cli_end_to_end(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt_token_ids": [5, 6], "output_len": n} for n in (3, 7, 2, 4)]
    data.write_text("\n".join(json.dumps(x) for x in lines))
    result, plots = tmp_path / "out" / "result.json", tmp_path / "plots"
    rc = main(["--base-url", server.url, "--api-key", API_KEY, "--no-tokenizer", "--dataset", "jsonl",
               "--dataset-path", str(data), "--num-prompts", "8", "--request-rate", "200",
               "--max-concurrency", "3", "--seed", "1", "--goodput", "ttft:60000",
               "--result-json", str(result), "--plot", str(plots), "--disable-tqdm"])
    assert rc == 0
    out = json.loads(result.read_text())
    # vLLM's run header, at the top level as `vllm bench serve --save-result` writes it
    assert out["backend"] == out["endpoint_type"] == "openai" and out["model_id"] == "fake-model"
    assert out["tokenizer_id"] is None and out["num_prompts"] == 8
    assert (out["request_rate"], out["burstiness"], out["max_concurrency"]) == (200.0, 1.0, 3)
    assert len(out["date"]) == len("20260101-120000")
    assert (out["completed"], out["failed"]) == (6, 2) and out["request_goodput"] > 0
    assert out["total_output_tokens"] == 2 * (3 + 2 + 4) and out["total_input_tokens"] == 6 * 3
    # vLLM's per-request lists, one entry per request; errors "" for those that succeeded
    errors, output_lens = out["errors"], out["output_lens"]
    assert all(len(out[k]) == 8 for k in ("input_lens", "output_lens", "ttfts", "itls",
                                          "generated_texts", "errors"))
    assert sorted(errors) == [""] * 6 + ["HTTP 400: max_tokens 7 is not allowed"] * 2
    assert sum(output_lens) == out["total_output_tokens"]
    for error, n, ttft, itls, text in zip(errors, output_lens, out["ttfts"], out["itls"],
                                          out["generated_texts"], strict=True):
        assert (n == 0) == bool(error)
        assert text == "".join(f" t{i}" for i in range(n)) and len(itls) == max(n - 1, 0)
        assert (ttft > 0) == (n > 0)
    assert out["error_counts"] == {"HTTP 400: max_tokens 7 is not allowed": 2}
    # vLLM's default --percentile-metrics ttft,tpot,itl and --metric-percentiles 99
    latency = {k for k in out if k.endswith("_ms")}
    assert latency == {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl")
                       for s in ("mean", "median", "std", "p99")}
    # stepserve's own keys
    assert len(out["requests"]) == 8 and out["config"]["dataset"] == "jsonl"
    assert out["config"]["ignore_eos"] is False  # jsonl: the server decides when to stop
    assert not {"model", "request_rate", "api_key"} & set(out["config"])
    assert API_KEY not in result.read_text()
    assert {p.name for p in plots.iterdir()} == {"latency_cdf.png", "timeline.png"}
    assert all(p.stat().st_size > 1000 for p in plots.iterdir())
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "failed x2: HTTP 400" in printed
    assert "Maximum request concurrency:" in printed and "Request rate configured" in printed
    assert "P99 ITL (ms):" in printed and "E2EL" not in printed


def test_cli_percentile_flags(server: FakeServer, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "pct.json"
    rc = main(["--base-url", server.url, "--api-key", API_KEY, "--no-tokenizer", "--model", "m",
               "--num-prompts", "3", "--prompt-len", "4", "--output-len", "5",
               "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "25,50,99",
               "--result-json", str(result), "--disable-tqdm"])
    out = json.loads(result.read_text())
    assert rc == 0 and out["completed"] == 3
    latency = {k for k in out if k.endswith("_ms")}
    assert latency == {f"{s}_{m}_ms" for m in ("ttft", "e2el")
                       for s in ("mean", "median", "std", "p25", "p50", "p99")}
    assert out["p25_e2el_ms"] <= out["p50_e2el_ms"] == out["median_e2el_ms"] <= out["p99_e2el_ms"]
    printed = capsys.readouterr().out
    assert "P25 TTFT (ms):" in printed and "P50 E2EL (ms):" in printed
    assert "Median E2EL (ms):" in printed and "ITL" not in printed and "TPOT" not in printed


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--percentile-metrics", "ttft,p99"), ("--metric-percentiles", "99,101"),
     ("--metric-percentiles", "p99")],
)
def test_cli_rejects_bad_percentile_flags(flag: str, value: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--no-tokenizer", "--model", "m", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err


def test_cli_chat_endpoint(server: FakeServer, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "say hello", "output_len": 3}))
    result = tmp_path / "chat.json"
    rc = main(["--base-url", server.url, "--endpoint", "/v1/chat/completions", "--api-key", API_KEY,
               "--no-tokenizer", "--dataset", "jsonl", "--dataset-path", str(data),
               "--num-prompts", "2", "--model", "fake-model", "--result-json", str(result),
               "--disable-tqdm"])
    out = json.loads(result.read_text())
    assert rc == 0 and out["completed"] == 2 and out["total_output_tokens"] == 6
    assert out["backend"] == "openai-chat" and out["generated_texts"] == [" t0 t1 t2"] * 2
    assert all(len(itls) == 2 for itls in out["itls"])


def test_cli_extra_body_reaches_every_request(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server.bodies.clear()
    fmt = {"response_format": {"type": "json_object"}, "top_k": 5}
    rc = main(["--base-url", server.url, "--api-key", API_KEY, "--no-tokenizer", "--num-prompts", "2", "--prompt-len", "4",
               "--output-len", "2", "--model", "fake-model", "--disable-tqdm", "--extra-body", json.dumps(fmt)])
    assert rc == 0 and len(server.bodies) == 2
    assert all(b["response_format"] == fmt["response_format"] and b["top_k"] == 5 for b in server.bodies)
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", server.url, "--extra-body", "[1]"])
    assert exc.value.code == 2 and "--extra-body" in capsys.readouterr().err


def test_cli_rejects_token_prompts_on_chat(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--base-url", server.url, "--endpoint", "/v1/chat/completions", "--model", "m",
               "--no-tokenizer", "--num-prompts", "1", "--disable-tqdm"])
    assert rc == 2
    assert "chat endpoint needs text prompts" in capsys.readouterr().err


def test_cli_synthetic_defaults_to_exact_lengths(server: FakeServer, tmp_path: Path) -> None:
    server.bodies.clear()
    result = tmp_path / "synthetic.json"
    rc = main(["--base-url", server.url, "--api-key", API_KEY, "--no-tokenizer", "--num-prompts", "5",
               "--prompt-len", "6", "--output-len", "uniform:2:5", "--priority-mix", "0:1,3:1",
               "--seed", "4", "--result-json", str(result), "--disable-tqdm"])
    out = json.loads(result.read_text())
    assert rc == 0 and out["completed"] == 5 and out["config"]["ignore_eos"] is True
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] for b in server.bodies)
    assert all(len(b["prompt"]) == 6 for b in server.bodies)
    assert out["total_output_tokens"] == sum(b["max_tokens"] for b in server.bodies)
    assert {r["priority"] for r in out["requests"]} <= {0, 3}


def test_bench_scripts_read_the_result_file(server: FakeServer, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`bench.servers.load` runs `stepserve bench` in a child process and reads the result
    file's top-level keys, E2EL's included although the default table leaves them out."""
    from bench.servers import load

    keys = ("completed", "failed", "total_output_tokens", "median_ttft_ms", "p99_itl_ms",
            "median_e2el_ms", "p99_e2el_ms")
    workload = ["--api-key", API_KEY, "--no-tokenizer", "--num-prompts", "3", "--prompt-len", "4",
                "--output-len", "3"]
    got = load(server.url, workload, tmp_path / "load.json", keys, model="fake-model")
    assert (got["completed"], got["failed"], got["total_output_tokens"]) == (3, 0, 9)
    assert 0 < got["median_ttft_ms"] < got["median_e2el_ms"] <= got["p99_e2el_ms"]
    assert got["p99_itl_ms"] > 0
    assert "Serving Benchmark Result" in capsys.readouterr().err  # the table, off stdout


def test_cli_all_failed_exit_code(server: FakeServer) -> None:
    rc = main(["--base-url", server.url, "--api-key", "wrong", "--model", "m", "--no-tokenizer",
               "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, limit_s: float) -> str | None:
    """None once the server answers /v1/models, else why it never did."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with {proc.returncode}: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return None
        except OSError:
            time.sleep(0.5)
    return f"server not ready after {limit_s:.0f}s: {log.read_text()[-2000:]}"


INSTANT_WORKER = ("--worker-runner", "worker.execution.instant_runner:InstantRunner",
                  "--kv-cache-memory", "512MiB")


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`stepserve serve` with the instant worker on a free port; fails if it cannot start."""
    port, log = _free_port(), tmp_path_factory.mktemp("live") / "server.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port),
                                 *INSTANT_WORKER],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    try:
        why = _wait_ready(proc, url, log, limit_s=300)
        if why is not None:
            pytest.fail(f"live stepserve did not start: {why}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_live_stepserve(live_server: str, tmp_path: Path) -> None:
    result = tmp_path / "live.json"
    rc = main(["--base-url", live_server, "--num-prompts", "4", "--prompt-len", "16",
               "--output-len", "4", "--request-rate", "inf", "--goodput", "e2el:600000",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--result-json", str(result),
               "--disable-tqdm"])
    out = json.loads(result.read_text())
    assert rc == 0, out["error_counts"]
    assert (out["completed"], out["failed"]) == (4, 0) and out["errors"] == [""] * 4
    assert out["request_goodput"] == pytest.approx(out["request_throughput"])
    assert out["tokenizer_id"] and out["model_id"]
    # Exact-length text prompts, exact output lengths (ignore_eos + min_tokens).
    assert out["input_lens"] == [16] * 4 and out["output_lens"] == [4] * 4
    for ttft, itls, text, rec in zip(out["ttfts"], out["itls"], out["generated_texts"],
                                     out["requests"], strict=True):
        assert 0 < ttft <= rec["e2el"] and len(itls) <= 3 and text
    assert out["total_output_tokens"] == 16 and out["mean_ttft_ms"] > 0
    assert out["median_e2el_ms"] >= out["median_ttft_ms"]
