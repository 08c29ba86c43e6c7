"""Front-door benchmark: what the HTTP server, SSE streaming, the engine loop and the worker
pipe cost when the model costs nothing. Prints JSON.

A `stepserve serve` subprocess runs with `InstantRunner` as its worker (a token per request
per step, instantly), so every millisecond measured is the server's own. For each level of
concurrency, that many streaming completions run at once (greedy, ignore_eos, fixed length)
and the client records when each SSE event arrives:

- tokens_per_s: streamed tokens per second, all streams together, first byte to last;
- itl_ms p50/p99: gap between consecutive events of one stream, per token (an event that
  carries k tokens counts k gaps of gap/k): the latency the front door adds per token;
- ttft_ms p50/p99: request sent to first content event.

    python bench/frontdoor.py                     # 64 and 512 concurrent streams
    python bench/frontdoor.py --concurrency 64 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, max_seqs: int) -> subprocess.Popen[bytes]:
    """`stepserve serve` with an InstantRunner worker, sized so no stream ever waits for KV."""
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--log-level", "warning",
        "--worker-runner", "worker.instant_runner:InstantRunner", "--kv-cache-memory", "16GiB",
        "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", "8192", "--max-waiting-requests", "100000",
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("server did not become healthy")


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> tuple[float, list[tuple[float, int]], int]:
    """(send time, [(arrival, tokens in event)], completion tokens) of one streamed request."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
    sent = time.perf_counter()
    events: list[tuple[float, int]] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            n = len(chunk["choices"][0]["logprobs"]["tokens"])  # tokens carried by this event
            events.append((time.perf_counter(), n))
    return sent, events, sum(n for _, n in events)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


async def run_level(url: str, concurrency: int, tokens: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await one_stream(session, url, "warm up", 4)
        start = time.perf_counter()
        results = await asyncio.gather(*[one_stream(session, url, f"Stream {i} says", tokens) for i in range(concurrency)])
        wall = time.perf_counter() - start
    itl: list[float] = []
    ttft: list[float] = []
    total = 0
    for sent, events, n in results:
        total += n
        ttft.append((events[0][0] - sent) * 1e3)
        for (prev, _), (now, k) in zip(events, events[1:], strict=False):
            itl.extend([(now - prev) * 1e3 / k] * k)
    return {
        "concurrency": concurrency,
        "tokens_per_stream": tokens,
        "total_tokens": total,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total / wall, 1),
        "itl_ms_p50": round(_pct(itl, 50), 3),
        "itl_ms_p99": round(_pct(itl, 99), 3),
        "ttft_ms_p50": round(_pct(ttft, 50), 2),
        "ttft_ms_p99": round(_pct(ttft, 99), 2),
    }


async def run(concurrency: list[int], tokens: int) -> dict[str, object]:
    port = _free_port()
    proc = start_server(port, max(concurrency))
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, proc)
        levels = [await run_level(url, c, tokens) for c in concurrency]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"benchmark": "frontdoor", "worker": "InstantRunner", "cpus": os.cpu_count(), "levels": levels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512], help="concurrent streams per level")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream (default %(default)s)")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.concurrency, args.tokens)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
