"""Two classes of traffic on one server, live, on the default model: FCFS with the default
step-time target against the slo policy, the same load sent to each.

- interactive: short prompts and outputs, Poisson arrivals, objectives TTFT and TPOT
  (body fields `slo_ttft_ms` / `slo_tpot_ms`);
- batch: long prompts and outputs, a closed loop of `--batch-concurrency` clients (it keeps
  the server saturated), a loose TTFT objective and no TPOT.

Both classes are sent by `stepserve bench` at the same time (two processes), to a fresh
server per arm. Prints JSON: per arm and class the bench summary (TTFT / ITL / TPOT
percentiles, throughput, goodput against the class's objectives), and slo / fcfs ratios.

    python -m bench.slo                       # ~6 min on 2 cores
    python -m bench.slo --interactive-rate 3 --duration 90 --batch-prompts 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.servers import (
    ALL_PERCENTILE_METRICS,
    ROOT,
    cpu_info,
    free_port,
    metric_values,
    running,
    stepserve_cmd,
)

KEYS = (
    "completed", "failed", "duration", "total_output_tokens", "output_throughput",
    "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
    "median_tpot_ms", "p99_tpot_ms",
)


def bench_cmd(url: str, out: Path, flags: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "service.cli", "bench", "--base-url", url, "--disable-tqdm",
        "--percentile-metrics", ALL_PERCENTILE_METRICS, "--result-json", str(out), *flags,
    ]


def classes(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each class's `stepserve bench` flags."""
    n_inter = max(1, round(args.interactive_rate * args.duration))
    interactive = {"slo_ttft_ms": args.ttft_ms, "slo_tpot_ms": args.tpot_ms}
    batch = {"slo_ttft_ms": args.batch_ttft_ms}
    return {
        "interactive": [
            "--num-prompts", str(n_inter), "--prompt-len", str(args.interactive_prompt_len),
            "--output-len", str(args.interactive_output_len), "--request-rate",
            str(args.interactive_rate), "--ignore-eos", "--seed", "1",
            "--extra-body", json.dumps(interactive),
            "--goodput", f"ttft:{args.ttft_ms}", f"tpot:{args.tpot_ms}",
        ],
        "batch": [
            "--num-prompts", str(args.batch_prompts), "--prompt-len", str(args.batch_prompt_len),
            "--output-len", str(args.batch_output_len), "--request-rate", "inf",
            "--max-concurrency", str(args.batch_concurrency), "--ignore-eos", "--seed", "2",
            "--extra-body", json.dumps(batch), "--goodput", f"ttft:{args.batch_ttft_ms}",
        ],
    }


def one_arm(url: str, args: argparse.Namespace, tmp: Path, arm: str) -> dict[str, Any]:
    """Both classes at once; the batch clients are stopped when the interactive run ends
    (their summary covers what finished by then)."""
    procs = {}
    outs = {}
    for name, flags in classes(args).items():
        outs[name] = tmp / f"{arm}-{name}.json"
        procs[name] = subprocess.Popen(bench_cmd(url, outs[name], flags), cwd=ROOT,
                                       stdout=subprocess.PIPE, text=True)
    result: dict[str, Any] = {}
    for name in ("interactive", "batch"):
        stdout, _ = procs[name].communicate()
        sys.stderr.write(stdout)
        if procs[name].returncode:
            raise RuntimeError(f"{arm}/{name}: stepserve bench failed")
        data = json.loads(outs[name].read_text())
        result[name] = {k: data.get(k) for k in KEYS}
        ttfts = [(t, i) for i, t in enumerate(data.get("ttfts", [])) if t is not None]
        # the slowest first tokens and their place in the run (a p99 of 68 requests is
        # about its largest): warm-up, or the run's busiest moment?
        result[name]["slowest_ttfts_ms"] = [
            {"request": i, "ms": round(t * 1000, 1)} for t, i in sorted(ttfts)[-3:]
        ]
    total = sum(result[c]["total_output_tokens"] or 0 for c in result)
    span = max(result[c]["duration"] or 0 for c in result)
    result["total_output_throughput"] = total / span if span else None
    values = metric_values(url)  # how well the step-cost model predicted the run's steps
    result["step_time"] = {k: values.get(f"stepserve:step_time_{k}")
                           for k in ("overrun", "relative_error")}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=45.0, help="interactive arrivals, seconds")
    ap.add_argument("--interactive-rate", type=float, default=1.5, help="requests/s")
    ap.add_argument("--interactive-prompt-len", type=int, default=48)
    ap.add_argument("--interactive-output-len", type=int, default=48)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--batch-prompt-len", type=int, default=512)
    ap.add_argument("--batch-output-len", type=int, default=128)
    ap.add_argument("--batch-concurrency", type=int, default=8)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--batch-ttft-ms", type=float, default=60000.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", default="fcfs,slo")
    args = ap.parse_args(argv)
    arms: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            port = free_port()
            cmd = stepserve_cmd(port, args.threads, ["--scheduling-policy", policy])
            with running(cmd, port) as url:
                warm = classes(args)["interactive"][:]
                warm[1] = "4"
                subprocess.run(bench_cmd(url, Path(tmp) / "warm.json", warm), cwd=ROOT,
                               stdout=subprocess.DEVNULL, check=True)
                arms[policy] = one_arm(url, args, Path(tmp), policy)
    ratios: dict[str, float | None] = {}
    if "fcfs" in arms and "slo" in arms:
        f, s = arms["fcfs"], arms["slo"]
        for cls, key in (("interactive", "p99_ttft_ms"), ("interactive", "p99_itl_ms"),
                         ("interactive", "p99_tpot_ms"), ("interactive", "request_goodput"),
                         ("batch", "output_throughput")):
            a, b = f[cls].get(key), s[cls].get(key)
            ratios[f"{cls}.{key}"] = round(b / a, 3) if a and b is not None else None
        a, b = f["total_output_throughput"], s["total_output_throughput"]
        ratios["total_output_throughput"] = round(b / a, 3) if a and b else None
    print(json.dumps({"cpu": cpu_info(), "config": vars(args), "arms": arms,
                      "slo_over_fcfs": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
