"""Worker threads against a busy neighbour: one decode step of the default model (batch 1 and
8, 128 tokens of context), with 1 or all threads, under OpenMP wait policies (the default,
PASSIVE, or a bounded spin `spin:N` = GOMP_SPINCOUNT=N), alone or beside a process that
keeps one core busy (as the front door does under load), and under the worker's helper
policies (`--helper-cpu-scheduling`: normal, idle, auto; `--helper-policies`).

Spinning OpenMP barriers are the known way this collapses: a thread that spins while its
sibling is preempted wastes the core the sibling needs. Each combination runs in a fresh
process (the wait policy is read at OpenMP start-up). Prints JSON, with each combination's
step time relative to the all-threads, default-policy, no-neighbour one.

    python -m bench.threads [--enforce-eager] [--policies default PASSIVE spin:10000] [--threads 2]
    python -m bench.threads --threads 2 --policies default --helper-policies normal idle auto

Each combination is `python -m bench.threads --child --threads N --helper-policies H
[--enforce-eager]` under the wait policy's environment: it prints its step times as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from typing import Any

from bench.servers import ROOT, bench_module_cmd
from worker.config import HELPER_CPU_SCHEDULING

DECODE_BATCHES = (1, 8)
CONTEXT = 128
WARMUP_STEPS, TIMED_STEPS = 3, 25


def child(threads: int, eager: bool, helper: str) -> dict[str, Any]:
    """In this process: build the default model's runner with `threads` threads, apply the
    helper CPU scheduling `helper`, and time decode steps at each of `DECODE_BATCHES`
    (seconds: median, max and mean) with the watchdog's counts."""
    import torch

    from bench.worker_step import Bench, median, start_decodes, time_once
    from worker.config import WorkerConfig
    from worker.execution.model_runner import ModelRunner
    from worker.process.cpu_scheduling import apply_helper_cpu_scheduling, watchdog_stats

    runner = ModelRunner(WorkerConfig(device="cpu", max_model_len=1024, kv_cache_memory=1 << 28,
                                      num_threads=threads, enforce_eager=eager, compile_wait=True))
    bench = Bench(runner)
    apply_helper_cpu_scheduling(helper)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for batch in DECODE_BATCHES:
            ids = start_decodes(bench, batch, CONTEXT)

            def step(ids: list[str] = ids) -> None:
                runner.execute(bench.plan({}, dict.fromkeys(ids, 1)))

            for _ in range(WARMUP_STEPS):
                step()
            times = [time_once(step, runner.device) for _ in range(TIMED_STEPS)]
            out[str(batch)] = median(times)
            out[f"{batch}_max"] = max(times)
            out[f"{batch}_mean"] = sum(times) / len(times)
            bench.finish(ids)
    out["watchdog"] = watchdog_stats()
    return out


def _spin(stop: float) -> None:
    while time.monotonic() < stop:
        pass


def measure(
    threads: int, policy: str, neighbour: bool, eager: bool, helper: str = "normal"
) -> dict[str, Any]:
    env = dict(os.environ)
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(key, None)
    if policy == "PASSIVE":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
    elif policy != "default":
        raise SystemExit(f"unknown policy {policy!r} (default, PASSIVE or spin:N)")
    cmd = bench_module_cmd(
        "threads", "--child", "--threads", str(threads), "--helper-policies", helper,
        *(["--enforce-eager"] if eager else []),
    )
    spinner = None
    if neighbour:
        spinner = multiprocessing.Process(target=_spin, args=(time.monotonic() + 600,), daemon=True)
        spinner.start()
    try:
        # a combination that hangs (spinning barriers starved by the neighbour) is reported,
        # not waited for
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=300,
        )
    except subprocess.TimeoutExpired:
        return {"error": "no result in 300 s"}
    finally:
        if spinner is not None:
            spinner.terminate()
            spinner.join()
    got = json.loads(done.stdout.strip().splitlines()[-1])
    watchdog = got.pop("watchdog")
    return {**{f"batch_{k}_ms": round(v * 1e3, 2) for k, v in got.items()},
            **({"watchdog": watchdog} if helper == "auto" else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--enforce-eager", action="store_true", help="time the eager forward (quicker start-up)"
    )
    ap.add_argument(
        "--policies",
        nargs="+",
        default=["default", "PASSIVE"],
        help="OpenMP wait policies: default, PASSIVE, spin:N (GOMP_SPINCOUNT=N); the first is "
        "the baseline",
    )
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="thread counts (default: 1 and all cores)",
    )
    ap.add_argument(
        "--helper-policies",
        nargs="+",
        default=["normal"],
        choices=HELPER_CPU_SCHEDULING,
        help="--helper-cpu-scheduling values to time (default: normal)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one combination in this process: one thread count, one helper policy
        if len(args.threads or []) != 1 or len(args.helper_policies) != 1:
            ap.error("--child takes one --threads value and one --helper-policies value")
        print(json.dumps(child(args.threads[0], args.enforce_eager, args.helper_policies[0])))
        return 0
    cores = os.cpu_count() or 2
    counts = sorted(set(args.threads or {1, cores}))
    rows = []
    for neighbour in (False, True):
        for threads in counts:
            for policy in args.policies:
                for helper in args.helper_policies:
                    rows.append(
                        {
                            "threads": threads,
                            "omp_wait_policy": policy,
                            "helper_cpu_scheduling": helper,
                            "busy_neighbour": neighbour,
                            **measure(threads, policy, neighbour, args.enforce_eager, helper),
                        }
                    )
                    print(
                        json.dumps(rows[-1]), file=sys.stderr, flush=True
                    )  # progress, kept if the run is cut short
    base = next(
        r
        for r in rows
        if r["threads"] == counts[-1]
        and r["omp_wait_policy"] == args.policies[0]
        and r["helper_cpu_scheduling"] == args.helper_policies[0]
        and not r["busy_neighbour"]
    )
    for r in rows:
        if "error" in r:
            continue
        for key in ("batch_1_ms", "batch_8_ms"):
            r[key.replace("_ms", "_vs_base")] = round(r[key] / base[key], 3)
    print(
        json.dumps(
            {
                "benchmark": "threads",
                "cores": cores,
                "compiled": not args.enforce_eager,
                "rows": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
