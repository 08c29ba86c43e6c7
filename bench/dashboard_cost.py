"""What the live dashboard costs the engine: the engine's step period with and without N
connected dashboards (real SSE clients reading /dashboard/stream), under a closed loop of
streaming requests on the instant worker (a model that costs nothing, so every microsecond
is the server's own). Prints JSON. The goal: <= 2 % difference at 64 streams and 5 viewers.

A `stepserve serve` subprocess (InstantRunner worker) runs `--streams` streaming completions
at all times (each finished one is replaced). Rounds alternate without / with dashboards;
each round waits `--warmup` s, then reads the server's step-duration histogram
(`stepserve:step_duration_seconds` sum and count) before and after `--duration` s. The step
period is sum/count over the window. Each (without, with) pair gives a ratio; the median of
the ratios is the result (pairs cancel the slow drift of a shared machine; the median, its
outliers). The server process's CPU time per step is reported too.

The viewers read in a process of their own, at `--viewer-nice` (default 19): the cost of the
dashboard *to the engine* is the records it builds, encodes and writes; the browsers that
read them normally run on other machines. On a 2-core box a viewer at the server's priority
takes its CPU from the server and the worker (`--viewer-nice 0` measures that too). The
engine's process runs alone on the first CPU, its worker and every client on the others
(`--no-pin`: the OS places them): three busy processes trading two cores at random made
rounds differ by more than the effect measured.

    python -m bench.dashboard_cost                    # 64 streams, 5 viewers, 16 pairs
    python -m bench.dashboard_cost --streams 8 --rounds 1 --duration 2 --warmup 1  # toy size

The viewers' process is `python -m bench.dashboard_cost --viewers-process URL N SECONDS`.
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
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import ROOT, bench_module_cmd, free_port, wait_healthy

STEP = "stepserve:step_duration_seconds"


def start_server(port: int, streams: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--log-level", "warning",
        "--worker-runner", "worker.execution.instant_runner:InstantRunner", "--kv-cache-memory",
        "4GiB", "--max-num-seqs", str(streams), "--max-waiting-requests", "100000",
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


async def step_histogram(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(sum, count) of the server's step-duration histogram."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == STEP + "_sum":
                total = s.value
            elif s.name == STEP + "_count":
                count = s.value
    return total, count


async def stream_forever(
    session: aiohttp.ClientSession, url: str, tokens: int, stop: asyncio.Event
) -> None:
    body = {
        "model": "instant",
        "prompt": "Tell me about continuous batching " * 4,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    while not stop.is_set():
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for _ in resp.content.iter_any():
                pass


async def dashboard(session: aiohttp.ClientSession, url: str, stats: dict[str, int]) -> None:
    """A viewer: reads the record stream as fast as it comes (and counts it)."""
    async with session.get(url + "/dashboard/stream") as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in resp.content.iter_any():
            stats["bytes"] += len(chunk)
            stats["events"] += chunk.count(b"\n\n")


async def _viewers(url: str, viewers: int, seconds: float) -> None:
    """The viewer process: `viewers` dashboards for `seconds`, then their counts as JSON."""
    stats = {"bytes": 0, "events": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(dashboard(session, url, stats)) for _ in range(viewers)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(stats), flush=True)


async def start_viewers(
    url: str, viewers: int, seconds: float, nice: int
) -> asyncio.subprocess.Process:
    cmd = bench_module_cmd("dashboard_cost", "--viewers-process", url, str(viewers), str(seconds))
    return await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        preexec_fn=(lambda: os.nice(nice)) if nice else None)


def _children(pid: int) -> list[int]:
    """The process's children, as Linux lists them per thread."""
    return [
        int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()
    ]


def pin(server_pid: int) -> dict[str, list[int]] | None:
    """The engine's process alone on the first CPU; its worker, this process and the viewers
    (started later, they inherit it) on the others. On 2 cores three busy processes
    otherwise trade the cores at random, and that noise is larger than the effect."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    engine, rest = {cpus[0]}, set(cpus[1:])
    os.sched_setaffinity(server_pid, engine)
    for child in _children(server_pid):
        os.sched_setaffinity(child, rest)
    os.sched_setaffinity(0, rest)
    return {"engine": sorted(engine), "worker_and_clients": sorted(rest)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(session: aiohttp.ClientSession, url: str, args: argparse.Namespace, viewers: int,
                  pid: int) -> dict[str, float]:
    proc = (
        await start_viewers(url, viewers, args.warmup + args.duration, args.viewer_nice)
        if viewers
        else None
    )
    await asyncio.sleep(args.warmup)
    s0, c0 = await step_histogram(session, url)
    t0, cpu0 = time.monotonic(), cpu_seconds(pid)
    await asyncio.sleep(args.duration)
    s1, c1 = await step_histogram(session, url)
    elapsed, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    stats = {"bytes": 0, "events": 0}
    if proc is not None:
        out, _ = await proc.communicate()
        assert proc.returncode == 0, f"the viewers exited with {proc.returncode}"
        stats = json.loads(out)
    steps = c1 - c0
    return {
        "viewers": viewers,
        "steps": steps,
        "step_period_ms": (s1 - s0) / steps * 1e3 if steps else float("nan"),
        "steps_per_s": steps / elapsed,
        "server_cpu_ms_per_step": cpu / steps * 1e3 if steps else float("nan"),
        "viewer_events_per_s": stats["events"] / (args.warmup + args.duration) / max(viewers, 1),
        "viewer_kb_per_s": stats["bytes"] / 1024 / (args.warmup + args.duration) / max(viewers, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, args.streams)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    pinned = None
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            await asyncio.to_thread(wait_healthy, url, proc)
            pinned = pin(proc.pid) if args.pin else None
            load = [
                asyncio.create_task(stream_forever(session, url, args.tokens, stop))
                for _ in range(args.streams)
            ]
            rounds = []
            for _ in range(args.rounds):
                for viewers in (0, args.viewers):
                    rounds.append(await measure(session, url, args, viewers, proc.pid))
            stop.set()
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    pairs = [(rounds[i], rounds[i + 1]) for i in range(0, len(rounds), 2)]
    period = [w["step_period_ms"] / wo["step_period_ms"] for wo, w in pairs]
    cpu = [w["server_cpu_ms_per_step"] / wo["server_cpu_ms_per_step"] for wo, w in pairs]
    return {
        "config": vars(args),
        "pinned": pinned,
        "rounds": rounds,
        "step_period_ms_without": statistics.median(wo["step_period_ms"] for wo, _ in pairs),
        "step_period_ms_with": statistics.median(w["step_period_ms"] for _, w in pairs),
        "pair_ratios": [round(r, 4) for r in period],
        "difference_pct": (statistics.median(period) - 1) * 100,
        # the spread a single pair shows: the quartiles of the pairs' differences
        "pair_difference_pct_quartiles": (
            [round((q - 1) * 100, 2) for q in statistics.quantiles(period, n=4)]
            if len(period) > 1
            else None
        ),
        "server_cpu_difference_pct": (statistics.median(cpu) - 1) * 100,
        "goal_pct": 2.0,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 4 and argv[0] == "--viewers-process":
        asyncio.run(_viewers(argv[1], int(argv[2]), float(argv[3])))
        return 0
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--streams", type=int, default=64, help="streaming requests in flight at all times"
    )
    p.add_argument(
        "--viewers", type=int, default=5, help="dashboards connected in the 'with' rounds"
    )
    p.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--rounds", type=int, default=16, help="pairs of (without, with) rounds")
    p.add_argument("--duration", type=float, default=6.0, help="seconds measured per round")
    p.add_argument(
        "--warmup", type=float, default=2.0, help="seconds before each round's measurement"
    )
    p.add_argument(
        "--viewer-nice",
        type=int,
        default=19,
        help="niceness of the viewers' process (0: as the server)",
    )
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave CPU placement to the OS (default: the engine alone on the first CPU)",
    )
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
