"""What the benchmark scripts share: starting a fresh `stepserve serve` or llama.cpp's
`llama-server` on a free port, `stepserve bench` against it (its JSON summary back), the
server's step histogram, the CPU's description, and the command that runs a benchmark
module (or its child mode) in a fresh process.

The scripts are modules of the `bench` package, run from the repository root as
`python -m bench.NAME`; a child process they start runs the same way, from `ROOT`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
# Every latency statistic `stepserve bench` can write: the scripts read any of them.
ALL_PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
LLAMA_DEFAULT = Path.home() / ".cache/stepserve-bench/build/bin/llama-server"
BUILD_HINT = (
    "build it with: bash ../shared/tools/build-llama-server.sh (it prints the binary's path)"
)


def bench_module_cmd(name: str, *args: str) -> list[str]:
    """`python -m bench.NAME ARGS` with this interpreter (run it with `cwd=ROOT`)."""
    return [sys.executable, "-m", f"bench.{name}", *args]


def cpu_info() -> dict[str, Any]:
    """The CPU model and its vector flags (reported with every run: CPUs change between
    sessions)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = text.splitlines()
    model = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        platform.processor(),
    )
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    wanted = (
        "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
        "amx_bf16",
    )
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 900) -> None:
    """Return once `url`/health answers 200; raise if `proc` exits or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy")


def metric_values(url: str) -> dict[str, float]:
    """A server's `/metrics`, sample name -> value (the last sample of each name)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def step_histogram(url: str) -> tuple[float, float, float]:
    """(count, sum in seconds) of a stepserve server's step-duration histogram, and the sum
    of the worker's own execute times over the same steps (`/metrics`)."""
    values = metric_values(url)
    return (
        values["stepserve:step_duration_seconds_count"],
        values["stepserve:step_duration_seconds_sum"],
        values["stepserve:model_execute_time_seconds_sum"],
    )


def llama_server_binary(given: str | None) -> Path | None:
    """The llama-server to run ('auto' or None: the build script's), or None if absent."""
    binary = LLAMA_DEFAULT if given in (None, "auto") else Path(given)
    return binary if binary.is_file() else None


def stepserve_cmd(port: int, threads: int, flags: list[str]) -> list[str]:
    """`stepserve serve` on `port` with `threads` worker threads and extra `flags`; healthy
    once its compiled forward is in use (a benchmark measures the steady state)."""
    return [
        sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--num-threads",
        str(threads), "--compile-wait", *flags,
    ]


def llama_cmd(binary: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """`llama-server` on the default model's GGUF file, continuous batching over `slots`."""
    from common.model_files import find_default_model

    return [
        str(binary),
        "-m",
        str(find_default_model()),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-cb",
    ]


@contextlib.contextmanager
def running(cmd: list[str], port: int, log: Path | None = None) -> Iterator[str]:
    """Start `cmd` (a server on `port`), wait for /health, yield its URL, stop it."""
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()  # type: ignore[union-attr]


def load(
    url: str, workload: list[str], out: Path, keys: tuple[str, ...], model: str | None = None
) -> dict[str, Any]:
    """`stepserve bench` with `workload` flags against `url` (statistics of every latency
    metric, at vLLM's default percentile 99); the result file's `keys` (None where absent).
    Its table goes to stderr, keeping stdout for the benchmark's JSON."""
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "bench",
        "--base-url",
        url,
        "--disable-tqdm",
        "--percentile-metrics",
        ALL_PERCENTILE_METRICS,
        "--result-json",
        str(out),
        *(["--model", model] if model else []),
        *workload,
    ]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    sys.stderr.write(done.stdout)
    data = json.loads(out.read_text())
    return {k: data.get(k) for k in keys}
