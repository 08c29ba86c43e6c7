"""Start-up side by side: how long each engine takes from its command to serving the default
model, and what its processes hold, at the same KV capacity.

    python -m bench.startup [--llama-server auto] [--openvino-python ~/ov-venv/bin/python]
        [--kv-tokens 8192] [--decode-tokens 64]

- **stepserve, first start after install** (the C++ kernels built by `make install`; an
  empty cache of compiled forwards): seconds to `/health` 200, to `"forward": "compiled"`,
  and one stream's time per token while the compiled forward is built and after it runs.
- **stepserve, restart** (the same cache): seconds to `/health` 200 and which forward runs
  then; time per token right after.
- **llama-server** on the same GGUF (`../shared/tools/build-llama-server.sh` builds it):
  seconds to `/health` 200, two starts.
- **OpenVINO GenAI** (`ContinuousBatchingPipeline` on the same GGUF, in its own
  interpreter; see `bench/vs_openvino.py`): seconds to construct the pipeline, two starts.

Each process's resident memory (RSS, MiB) is read idle after start-up; stepserve's server
and worker processes are reported apart. The KV capacity is `--kv-tokens` for each:
stepserve's `--kv-cache-memory` at its float16 cache's bytes a token, llama-server's `-c`
(one slot, float16 cache), OpenVINO's `num_kv_blocks` at its CPU block size. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.servers import ROOT, cpu_info, free_port, llama_server_binary
from bench.vs_openvino import openvino_python

# the default model's float16 KV bytes a token: 30 layers x K and V x 3 KV heads x 64 x 2 B
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
OPENVINO_BLOCK = 32  # the CPU plugin's KV block size (tokens)


def rss_mib(pid: int) -> float:
    """The resident set of one process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def worker_pid(server: int) -> int | None:
    """The worker process among the server's children (not multiprocessing's tracker)."""
    path = Path(f"/proc/{server}/task/{server}/children")
    for pid in (int(p) for p in path.read_text().split()) if path.exists() else ():
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


def health(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return dict(json.loads(resp.read() or b"{}")) if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def until_healthy(url: str, proc: subprocess.Popen[bytes], started: float) -> float:
    while health(url) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        time.sleep(0.05)
    return time.perf_counter() - started


def ms_per_token(url: str, tokens: int) -> float:
    """One greedy completion of `tokens` tokens, wall time a token (ms)."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as resp:
        resp.read()
    return (time.perf_counter() - start) / tokens * 1e3


def stepserve(cache: Path, kv_tokens: int, decode_tokens: int) -> dict[str, Any]:
    """One `stepserve serve` start with `cache` as its cache of compiled forwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port),
           "--kv-cache-memory", f"{kv_tokens * KV_BYTES_PER_TOKEN}B", "--disable-access-log"]
    env = {**os.environ, "STEPSERVE_AOT_CACHE": str(cache)}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        out: dict[str, Any] = {"healthy_s": round(until_healthy(url, proc, started), 2)}
        first = health(url) or {}
        out["forward_at_healthy"] = first.get("forward")
        time.sleep(1)
        worker = worker_pid(proc.pid)
        out["rss_mib"] = {"server": rss_mib(proc.pid),
                          "worker": rss_mib(worker) if worker is not None else None}
        during: list[float] = []
        while (health(url) or {}).get("compiling"):
            during.append(ms_per_token(url, decode_tokens))
        out["compiled_s"] = round(time.perf_counter() - started, 1)
        out["forward"] = (health(url) or {}).get("forward")
        if during:
            out["ms_per_token_while_building"] = round(statistics.median(during), 2)
        after = [ms_per_token(url, decode_tokens) for _ in range(5)]
        out["ms_per_token"] = round(statistics.median(after), 2)
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def llama_server(binary: Path, kv_tokens: int) -> dict[str, Any]:
    from common.model_files import find_default_model

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(binary), "-m", str(find_default_model()), "--port", str(port), "--host",
           "127.0.0.1", "-t", str(os.cpu_count() or 1), "-np", "1", "-c", str(kv_tokens)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        healthy = until_healthy(url, proc, started)
        time.sleep(1)
        return {"healthy_s": round(healthy, 2), "rss_mib": rss_mib(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(60)


_OPENVINO_CHILD = """
import json, sys, time
started = time.perf_counter()
import openvino_genai as ov_genai
config = ov_genai.SchedulerConfig()
config.num_kv_blocks = int(sys.argv[2])
pipe = ov_genai.ContinuousBatchingPipeline(sys.argv[1], config, "CPU", {})
loaded = time.perf_counter() - started
rss = [l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]
print(json.dumps({"loaded_s": round(loaded, 2), "rss_mib": round(int(rss) / 1024, 1)}))
"""


def openvino(python: str, kv_tokens: int) -> dict[str, Any]:
    from common.model_files import find_default_model

    blocks = -(-kv_tokens // OPENVINO_BLOCK)
    done = subprocess.run([python, "-c", _OPENVINO_CHILD, str(find_default_model()), str(blocks)],
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default="auto")
    parser.add_argument("--openvino-python", default=None)
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"cpu": cpu_info(), "kv_tokens": args.kv_tokens}
    with tempfile.TemporaryDirectory(prefix="stepserve-aot-") as cache:
        result["stepserve_first_start"] = stepserve(Path(cache), args.kv_tokens, args.decode_tokens)
        result["stepserve_restart"] = stepserve(Path(cache), args.kv_tokens, args.decode_tokens)
    binary = llama_server_binary(args.llama_server)
    result["llama_server"] = (
        [llama_server(binary, args.kv_tokens) for _ in range(2)] if binary else "not built"
    )
    python = openvino_python(args.openvino_python)
    result["openvino_genai"] = (
        [openvino(python, args.kv_tokens) for _ in range(2)] if python else "not installed"
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
