"""What a router in front costs: the same streams sent to one stepserve replica directly and
through `smg launch` (SGLang's model gateway, PyPI `smg`), in one run. Prints JSON.

The replica runs the instant stand-in as its worker (`InstantRunner`: a token per request per
step, instantly), so every millisecond measured is the server's or the router's own; with a
real model the same absolute overhead is a smaller share of each step. The router and the
replica share this machine's cores, as they would in a pod with a sidecar router; say so
when quoting the figures.

Per arm, `--concurrency` streaming completions at once (greedy, ignore_eos, `--tokens`
tokens each), read as fast as they come (the front-door benchmark's client,
`bench.frontdoor`): ITL p50/p99 per token, TTFT p50/p99 and tokens/s. The arms alternate
(`--repeats` rounds of direct then router) on one replica and one router, so drift in the
machine falls on both; ratios are router / direct, from the medians over rounds.

    python -m bench.router                       # 64 streams x 1,024 tokens, 5 rounds
    python -m bench.router --concurrency 8 --tokens 16 --repeats 1   # toy size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.frontdoor import run_level, start_server, stop_server
from bench.servers import cpu_info, free_port, wait_healthy

METRICS = ("tokens_per_s", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "ttft_ms_p99")


def smg_executable() -> str | None:
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


def smg_version(smg: str) -> str:
    out = subprocess.run([smg, "--version"], capture_output=True, text=True, check=False)
    return (
        (out.stdout or out.stderr).strip().splitlines()[-1]
        if (out.stdout or out.stderr)
        else "unknown"
    )


def start_router(
    smg: str, worker_urls: list[str], log: Path, policy: str = "round_robin"
) -> tuple[subprocess.Popen[bytes], str]:
    """`smg launch` in front of `worker_urls` with `policy` (round robin over one worker:
    routing decides nothing, so what is measured is the proxy), waited until it counts
    every worker healthy."""
    port, metrics_port = free_port(), free_port()
    cmd = [
        smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
        "127.0.0.1", "--prometheus-port", str(metrics_port), "--worker-urls", *worker_urls,
        "--policy", policy, "--backend", "vllm", "--log-level", "warn",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"smg exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url + "/workers", timeout=5) as resp:
                workers = json.loads(resp.read())["workers"]
            if len(workers) == len(worker_urls) and all(w["is_healthy"] for w in workers):
                return proc, url
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("smg did not count every replica healthy within 120 s")


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in METRICS}


def run(args: argparse.Namespace, smg: str) -> dict[str, Any]:
    server = start_server(max(args.concurrency, 1), [])
    router: subprocess.Popen[bytes] | None = None
    rounds: dict[str, list[dict[str, float]]] = {"direct": [], "router": []}
    try:
        wait_healthy(server.url, server.proc)
        with tempfile.TemporaryDirectory() as tmp:
            router, router_url = start_router(smg, [server.url], Path(tmp) / "smg.log")
            model = served_model(server.url)  # the router picks a worker by it
            for _ in range(args.repeats):
                for arm, url in (("direct", server.url), ("router", router_url)):
                    result = asyncio.run(run_level(url, args.concurrency, args.tokens, model))
                    expected = args.concurrency * args.tokens
                    if result["total_tokens"] != expected:
                        raise RuntimeError(
                            f"{arm}: {result['total_tokens']} of {expected} tokens streamed"
                        )
                    rounds[arm].append(result)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        stop_server(server)
    direct, routed = median_of(rounds["direct"]), median_of(rounds["router"])
    return {
        "benchmark": "router",
        "cpu": cpu_info(),
        "smg_version": smg_version(smg),
        "concurrency": args.concurrency,
        "tokens_per_stream": args.tokens,
        "repeats": args.repeats,
        "direct": direct,
        "router": routed,
        "ratio_router_over_direct": {
            k: round(routed[k] / direct[k], 3) if direct[k] else None for k in METRICS
        },
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    smg = smg_executable()
    if smg is None:
        print(
            "smg (SGLang's model gateway) is not installed: pip install -e '.[test]' installs it",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(run(args, smg), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
