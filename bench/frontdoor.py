"""Front-door benchmark: what the HTTP server, SSE streaming, the engine loop and the worker
pipe cost when the model costs nothing, and what slow and stalled clients cost the others.
Prints JSON.

A `stepserve serve` subprocess runs with `InstantRunner` as its worker (a token per request
per step, instantly), so every millisecond measured is the server's own. The client records
when each SSE event arrives (an event carries one or more tokens: a reader that falls
behind gets coalesced events):

- tokens_per_s: streamed tokens per second, all streams together, first byte to last;
- itl_ms p50/p99: gap between consecutive events of one stream, per token (an event that
  carries k tokens counts k gaps of gap/k): the latency the front door adds per token;
- ttft_ms p50/p99: request sent to first content event.

Levels (`--concurrency`): that many streaming completions at once (greedy, ignore_eos).

Reader scenarios (`--scenarios`), each on a fresh server: `--normal-streams` streams of
`--scenario-tokens` tokens read as fast as they can, alone ("baseline"), next to
`--special-streams` readers that read `--slowdown` times slower than a normal stream
receives bytes ("slow"), or that read their first event and then nothing while keeping the
socket open ("stalled"). Reported: the normal streams' ITL and throughput, the server
process's peak RSS (sampled every 50 ms), both as ratios to the baseline, and what the
special readers received.

    python -m bench.frontdoor                     # levels 64 and 512, then the three scenarios
    python -m bench.frontdoor --concurrency 64 --tokens 128 --scenarios none
    python -m bench.frontdoor --concurrency 16 --tokens 16 --scenario-tokens 16 \
        --normal-streams 8 --special-streams 2    # toy size
    python -m bench.frontdoor ... --profile DIR   # each server under cProfile: DIR/<run>.prof
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import orjson

from bench.servers import ROOT, free_port, wait_healthy

T = TypeVar("T")


@dataclass
class Server:
    """One `stepserve serve` subprocess on a free port."""

    proc: subprocess.Popen[bytes]
    url: str


def start_server(max_seqs: int, extra: list[str], profile: Path | None = None) -> Server:
    """`stepserve serve` with an InstantRunner worker, sized so no stream ever waits for KV."""
    port = free_port()
    python = [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else [sys.executable]
    cmd = [
        *python, "-m", "service.cli", "serve", "--port", str(port), "--log-level", "warning",
        "--worker-runner", "worker.execution.instant_runner:InstantRunner", "--kv-cache-memory",
        "16GiB", "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", "8192",
        "--max-waiting-requests", "100000", *extra,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    return Server(proc, f"http://127.0.0.1:{port}")


def stop_server(server: Server) -> None:
    # SIGINT drains like SIGTERM, and cProfile writes its file on this exit
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(120)


@dataclass
class StreamRecord:
    """One streamed request as the client saw it."""

    sent: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the event)
    num_bytes: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)


def _body(prompt: str, tokens: int, model: str | None = None) -> dict[str, object]:
    return {
        **({"model": model} if model else {}),
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }


def _record_line(rec: StreamRecord, line: bytes) -> None:
    if not line.startswith(b"data: {"):
        return
    chunk = orjson.loads(line[6:])
    if "error" in chunk:
        rec.error = chunk["error"]["message"]
        return
    choice = chunk["choices"][0]
    # (arrival, tokens carried by this event)
    rec.events.append((time.perf_counter(), len(choice["logprobs"]["tokens"])))
    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int,
                     bytes_per_s: float | None = None, stall: asyncio.Event | None = None,
                     rec: StreamRecord | None = None, model: str | None = None) -> StreamRecord:
    """Read one streamed request: as fast as possible, at most `bytes_per_s`, or (with
    `stall`) the first event and then nothing until `stall` is set. Into `rec` if given, so
    a reader cancelled midway leaves what it had received."""
    rec = rec or StreamRecord(time.perf_counter())
    try:
        await _read(session, url, prompt, tokens, bytes_per_s, stall, rec, model)
    except (aiohttp.ClientError, ConnectionError) as exc:
        rec.error = f"connection lost: {type(exc).__name__}"
    return rec


async def _read(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    tokens: int,
    bytes_per_s: float | None,
    stall: asyncio.Event | None,
    rec: StreamRecord,
    model: str | None = None,
) -> None:
    async with session.post(url + "/v1/completions", json=_body(prompt, tokens, model)) as resp:
        resp.raise_for_status()
        pending = b""
        while True:
            chunk = await resp.content.read(4096 if bytes_per_s else 65536)
            if not chunk:
                break
            rec.num_bytes += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                _record_line(rec, line.strip())
            if stall is not None and rec.events:
                await stall.wait()
                stall = None
            if bytes_per_s:
                await asyncio.sleep(len(chunk) / bytes_per_s)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
        if len(values) > 1
        else values[0]
    )


def summarize(records: list[StreamRecord], wall: float) -> dict[str, float]:
    itl: list[float] = []
    ttft = [(r.events[0][0] - r.sent) * 1e3 for r in records if r.events]
    for r in records:
        for (prev, _), (now, k) in zip(r.events, r.events[1:], strict=False):
            itl.extend([(now - prev) * 1e3 / k] * k)
    total = sum(r.tokens for r in records)
    return {
        "total_tokens": total,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total / wall, 1),
        "itl_ms_p50": round(_pct(itl, 50), 3),
        "itl_ms_p99": round(_pct(itl, 99), 3),
        "ttft_ms_p50": round(_pct(ttft, 50), 2),
        "ttft_ms_p99": round(_pct(ttft, 99), 2),
    }


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=900)
    )


async def run_level(
    url: str, concurrency: int, tokens: int, model: str | None = None
) -> dict[str, float]:
    """`concurrency` streams of `tokens` tokens at once (after one to warm up), naming
    `model` when given (a router needs it to pick a worker)."""
    async with _session() as session:
        await one_stream(session, url, "warm up", 4, model=model)
        start = time.perf_counter()
        records = await asyncio.gather(*[
            one_stream(session, url, f"Stream {i} says", tokens, model=model)
            for i in range(concurrency)
        ])
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "tokens_per_stream": tokens, **summarize(records, wall)}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


async def _peak_rss(pid: int, done: asyncio.Event) -> float:
    peak = _rss_mib(pid)
    while not done.is_set():
        await asyncio.sleep(0.05)
        peak = max(peak, _rss_mib(pid))
    return peak


async def run_scenario(
    server: Server, kind: str, args: argparse.Namespace, bytes_per_s: float | None
) -> dict[str, object]:
    """`--normal-streams` fast readers, plus (unless "baseline") the special readers."""
    done, stall = asyncio.Event(), asyncio.Event()
    specials = [
        StreamRecord(time.perf_counter())
        for _ in range(args.special_streams if kind != "baseline" else 0)
    ]
    slow_rate = bytes_per_s / args.slowdown if kind == "slow" and bytes_per_s else None
    async with _session() as session:
        await one_stream(session, server.url, "warm up", 4)
        rss = asyncio.create_task(_peak_rss(server.proc.pid, done))
        special = [
            asyncio.create_task(
                one_stream(
                    session,
                    server.url,
                    f"Special {i} says",
                    args.special_tokens,
                    slow_rate,
                    stall if kind == "stalled" else None,
                    rec,
                )
            )
            for i, rec in enumerate(specials)
        ]
        if special:  # the special readers are running before the measured ones start
            await asyncio.sleep(0.2)
        start = time.perf_counter()
        normal = await asyncio.gather(
            *[
                one_stream(session, server.url, f"Stream {i} says", args.scenario_tokens)
                for i in range(args.normal_streams)
            ]
        )
        wall = time.perf_counter() - start
        done.set()
        peak = await rss
        stall.set()  # the stalled readers read on, to see how the server ended their streams
        if kind == "slow":  # they would take many times the run to finish: stop them here
            for task in special:
                task.cancel()
        await asyncio.gather(*special, return_exceptions=True)
    result: dict[str, object] = {
        "normal": summarize(normal, wall),
        "server_rss_peak_mib": round(peak, 1),
        "normal_bytes_per_s_per_stream": round(
            statistics.mean(r.num_bytes for r in normal) / wall, 1
        ),
    }
    if specials:
        result["special"] = {
            "tokens_received": [r.tokens for r in specials],
            "events_received": [len(r.events) for r in specials],
            # stalled: how the server ended each stream; slow: "stopped" (by this benchmark)
            "ended": [r.error or r.finish_reason or "stopped" for r in specials],
        }
    return result


def _ratios(run: dict[str, object], base: dict[str, object]) -> dict[str, float]:
    n: dict[str, float] = run["normal"]  # type: ignore[assignment]
    b: dict[str, float] = base["normal"]  # type: ignore[assignment]
    rss: float = run["server_rss_peak_mib"]  # type: ignore[assignment]
    base_rss: float = base["server_rss_peak_mib"]  # type: ignore[assignment]
    return {
        "itl_p99_vs_baseline": round(n["itl_ms_p99"] / b["itl_ms_p99"], 3),
        "tokens_per_s_vs_baseline": round(n["tokens_per_s"] / b["tokens_per_s"], 3),
        "rss_vs_baseline": round(rss / base_rss, 3),
    }


async def _on_server(name: str, max_seqs: int, args: argparse.Namespace,
                     work: Callable[[Server], Awaitable[T]]) -> T:
    """Run `work` against a fresh server (its cProfile stats in --profile DIR/<name>.prof)."""
    profile = args.profile / f"{name}.prof" if args.profile else None
    server = start_server(
        max_seqs, ["--stream-stall-timeout", str(args.stream_stall_timeout)], profile
    )
    try:
        await asyncio.to_thread(wait_healthy, server.url, server.proc, 300.0)
        return await work(server)
    finally:
        stop_server(server)


async def run(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {
        "benchmark": "frontdoor",
        "worker": "InstantRunner",
        "cpus": os.cpu_count(),
    }
    if args.concurrency:
        async def levels(server: Server) -> list[dict[str, float]]:
            return [await run_level(server.url, c, args.tokens) for c in args.concurrency]
        out["levels"] = await _on_server("levels", max(args.concurrency), args, levels)
    if args.scenarios:
        runs: dict[str, dict[str, object]] = {}
        max_seqs = args.normal_streams + args.special_streams + 1
        for kind in ["baseline", *[k for k in args.scenarios if k != "baseline"]]:
            rate = runs["baseline"]["normal_bytes_per_s_per_stream"] if runs else None

            async def scenario(
                server: Server, kind: str = kind, rate: object = rate
            ) -> dict[str, object]:
                return await run_scenario(server, kind, args, rate)  # type: ignore[arg-type]

            runs[kind] = await _on_server(kind, max_seqs, args, scenario)
            if kind != "baseline":
                runs[kind].update(_ratios(runs[kind], runs["baseline"]))
        out["readers"] = {
            "normal_streams": args.normal_streams,
            "special_streams": args.special_streams,
            "slowdown": args.slowdown,
            "tokens": args.scenario_tokens,
            "special_tokens": args.special_tokens,
            "stream_stall_timeout": args.stream_stall_timeout,
            "runs": runs,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[64, 512],
        help="concurrent streams per level (none: skip)",
    )
    parser.add_argument(
        "--tokens", type=int, default=256, help="tokens per stream (default %(default)s)"
    )
    parser.add_argument(
        "--scenarios",
        nargs="*",
        default=["baseline", "slow", "stalled"],
        choices=["baseline", "slow", "stalled", "none"],
        help="reader scenarios (none: skip)",
    )
    parser.add_argument("--normal-streams", type=int, default=64)
    parser.add_argument(
        "--special-streams",
        type=int,
        default=8,
        help="slow or stalled readers (default %(default)s)",
    )
    parser.add_argument(
        "--slowdown", type=float, default=10.0, help="how many times slower the slow readers read"
    )
    parser.add_argument(
        "--scenario-tokens",
        type=int,
        default=1024,
        help="tokens per normal stream in the reader scenarios (default %(default)s: ~1.5 s "
        "runs; at 256 a run lasts half a second and its p99 is a handful of gaps)",
    )
    parser.add_argument("--special-tokens", type=int, default=None,
                        help="tokens per special stream (default 4x --scenario-tokens)")
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="the server's flag (default %(default)s)",
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="directory for each server's cProfile stats"
    )
    args = parser.parse_args(argv)
    args.scenarios = [s for s in args.scenarios if s != "none"]
    args.special_tokens = args.special_tokens or 4 * args.scenario_tokens
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
