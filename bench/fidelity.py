"""Simulator fidelity: predict a live load run with the calibrated CPU profile, then measure it.

One run does everything, side by side:
  1. `python -m bench.worker_step` on the default model -> the CPU's step times (JSON);
  2. `stepserve simulate calibrate` fits a hardware profile to them;
  3. `stepserve serve` starts on a free port; `stepserve bench` loads it with a seeded
     Poisson workload and measures;
  4. `stepserve simulate` replays the same workload (same generator, same seed, same
     scheduler flags and KV block count) on the calibrated profile.
Prints JSON with both summaries' throughput, TTFT, TPOT and latency, the number of steps
and the mean step time (the server's from its /metrics step histogram), and their ratios.
Per run it also reports what the engine adds to the worker's execute time per step
(`engine_overhead_ms`, step minus execute) and `execute_fits_in_step`: whether the worker's
own time is within the server's step time (5% slack for the two clocks); false means the
step or execute timing is wrong, so read the ratios of that run with suspicion.

    python -m bench.fidelity                              # rates 0.3 and 0.6 req/s
    python -m bench.fidelity --bench-json steps.json --worker-args='--enforce-eager'

With `--replicas N` (N > 1) step 3 starts N servers behind SGLang's model gateway (`smg
launch --policy ROUTER`, the `test` extra installs it) and loads the router, and step 4 is
`stepserve simulate cluster --replicas N --router ROUTER` with the same workload: the
simulated cluster against the live one. The replicas share this machine's cores (each with
`--threads` worker threads), which the calibration, taken on one worker alone, does not see.

    python -m bench.fidelity --replicas 2 --router round_robin --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.router import served_model, smg_executable, start_router
from bench.servers import ROOT, bench_module_cmd, free_port, load, step_histogram, wait_healthy

KEYS = (
    "request_throughput", "output_throughput", "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms",
    "median_e2el_ms", "num_busy_steps", "mean_step_ms",
)
# The calibration grid: decode batches at a short and a long context, prefill chunks fresh and
# after a cached prefix, so the fit can tell per-step, per-request and per-KV-token costs apart.
CALIBRATION = ["--batches", "1", "2", "4", "8", "16", "--context", "64", "512",
               "--chunks", "32", "128", "512", "--chunk-context", "0", "256", "--repeat", "5"]


def _run(args: list[str]) -> None:
    """Run a stepserve command; its report goes to our stderr, keeping stdout for the JSON."""
    done = subprocess.run(
        [sys.executable, *args], check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    sys.stderr.write(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument(
        "--request-rates",
        type=float,
        nargs="+",
        default=[0.3, 0.6],
        help="one load run per rate; keep them under the server's capacity (~0.8 req/s with one "
        "worker thread here), where TTFT is not mostly queueing",
    )
    ap.add_argument("--prompt-len", default="uniform:64:256")
    ap.add_argument("--output-len", default="uniform:16:64")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="worker threads, for calibration and server alike (default: all cores but one, "
        "which the engine, the HTTP front end and the load generator need)",
    )
    ap.add_argument(
        "--bench-json", default=None, help="reuse a bench.worker_step output instead of running it"
    )
    ap.add_argument(
        "--worker-args",
        type=shlex.split,
        default=[],
        help="worker flags for calibration and server alike, one string given with '=', e.g. "
        "--worker-args='--dtype float32 --enforce-eager' (default: the server's defaults)",
    )
    ap.add_argument("--replicas", type=int, default=1,
                    help="servers behind smg, simulated as a cluster (default 1: one server, "
                    "no router)")
    ap.add_argument("--router", default="round_robin",
                    help="the routing policy, smg's name, which the simulator's cluster shares "
                    "(round_robin, power_of_two, cache_aware)")
    args = ap.parse_args(argv)
    smg = smg_executable() if args.replicas > 1 else None
    if args.replicas > 1 and smg is None:
        print("--replicas needs smg (SGLang's model gateway): pip install -e '.[test]'",
              file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="stepserve-fidelity-"))
    step_json = Path(args.bench_json) if args.bench_json else tmp / "worker_step.json"
    if not args.bench_json:
        with step_json.open("w") as f:
            subprocess.run(
                bench_module_cmd(
                    "worker_step", "--threads", str(args.threads), *CALIBRATION, *args.worker_args
                ),
                check=True,
                cwd=ROOT,
                stdout=f,
            )
    profile = tmp / "cpu_profile.json"
    _run(
        [
            "-m", "service.cli", "simulate", "calibrate", "--from", str(step_json), "--out",
            str(profile),
        ]
    )

    sched = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", "16"]
    servers = [_start_server(args, sched) for _ in range(args.replicas)]
    router: subprocess.Popen[bytes] | None = None
    measured: dict[float, dict[str, float]] = {}
    try:
        for url, proc in servers:
            wait_healthy(url, proc, timeout=600)
        url = servers[0][0]
        with urllib.request.urlopen(f"{url}/debug/kv") as r:
            num_blocks = int(json.load(r)["num_gpu_blocks"])
        model = None
        if smg is not None:
            router, url = start_router(smg, [u for u, _ in servers], tmp / "smg.log", args.router)
            model = served_model(servers[0][0])  # the router picks a worker by it
        for rate in args.request_rates:  # each rate its own seed: no prefix-cache hits across runs
            out = tmp / f"measured-{rate}.json"
            before = _steps([u for u, _ in servers])
            measured[rate] = load(url, _workload(args, rate), out, KEYS, model=model)
            after = _steps([u for u, _ in servers])
            steps = after[0] - before[0]
            per_step = 1e3 / steps if steps else 0.0
            measured[rate].update(
                num_busy_steps=steps,
                mean_step_ms=(after[1] - before[1]) * per_step,
                mean_execute_ms=(after[2] - before[2]) * per_step,
            )
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        for _, proc in servers:
            proc.terminate()
        for _, proc in servers:
            proc.wait(timeout=60)
    runs = []
    for rate in args.request_rates:
        simulated = _simulate(args, rate, profile, num_blocks, sched, tmp)
        rows = {k: {"measured": measured[rate].get(k), "simulated": simulated.get(k)} for k in KEYS}
        # the worker's own time per step, against the same simulated step time
        rows["mean_execute_ms"] = {
            "measured": measured[rate]["mean_execute_ms"],
            "simulated": simulated.get("mean_step_ms"),
        }
        for row in rows.values():
            m, sim = row["measured"], row["simulated"]
            row["ratio_sim_over_measured"] = (sim / m) if m and sim is not None else None
        step, execute = measured[rate]["mean_step_ms"], measured[rate]["mean_execute_ms"]
        runs.append({"request_rate": rate, "results": rows, "engine_overhead_ms": step - execute,
                     "execute_fits_in_step": execute <= step * 1.05})
    print(
        json.dumps(
            {
                "benchmark": "fidelity",
                "replicas": args.replicas,
                "router": args.router if args.replicas > 1 else None,
                "workload": _workload(args, None),
                "scheduler": sched,
                "num_gpu_blocks": num_blocks,
                "profile": json.loads(profile.read_text()),
                "runs": runs,
            },
            indent=2,
        )
    )
    return 0


def _start_server(
    args: argparse.Namespace, sched: list[str]
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "service.cli", "serve", "--port", str(port),
            "--enable-debug-endpoints", "--num-threads", str(args.threads), "--compile-wait",
            *sched,
            *args.worker_args,
        ],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
    )
    return f"http://127.0.0.1:{port}", proc


def _steps(urls: list[str]) -> tuple[float, float, float]:
    """The servers' step histograms summed: steps, seconds of steps, seconds executing."""
    counts = [step_histogram(u) for u in urls]
    return (sum(c[0] for c in counts), sum(c[1] for c in counts), sum(c[2] for c in counts))


def _simulate(
    args: argparse.Namespace, rate: float, profile: Path, num_blocks: int, sched: list[str],
    tmp: Path,
) -> dict[str, float]:
    """The simulator's summary of the same workload: one server, or the cluster."""
    common = [
        "--model-shape", "smollm2-135m", "--hardware", str(profile), "--num-gpu-blocks",
        str(num_blocks), *_workload(args, rate), *sched,
    ]
    if args.replicas > 1:
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", "simulate", "cluster", "--trace", "workload",
             "--replicas", str(args.replicas), "--router", args.router, "--json", *common],
            check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        row: dict[str, float] = json.loads(done.stdout)[0]
        return row
    out = tmp / f"simulated-{rate}.json"
    _run(["-m", "service.cli", "simulate", "--result-json", str(out), *common])
    summary: dict[str, float] = json.loads(out.read_text())["summaries"]["continuous"]
    return summary


def _workload(args: argparse.Namespace, rate: float | None) -> list[str]:
    seed = args.seed if rate is None else args.seed + args.request_rates.index(rate)
    out = ["--num-prompts", str(args.num_prompts), "--prompt-len", args.prompt_len,
           "--output-len", args.output_len, "--seed", str(seed)]
    return out + ["--request-rate", str(rate)] if rate is not None else out


if __name__ == "__main__":
    sys.exit(main())
