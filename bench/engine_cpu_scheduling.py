"""The server process's CPU scheduling policy, side by side: `stepserve serve
--engine-cpu-scheduling normal` (SCHED_OTHER) against `batch` (SCHED_BATCH, the default),
each a fresh server, on the same requests as `bench.vs_llamacpp`. Prints JSON.

Per scenario and policy: the load generator's summary, and from `/metrics` over the
scenario the worker's mean execute time per step and the engine's mean step time (output
to output); their difference is what the engine, the pipe and the OS add to every step.
Rounds alternate which policy goes first; ratios are batch / normal, each figure's median
over the rounds (a time ratio < 1 or a rate ratio > 1 is SCHED_BATCH winning).

    python -m bench.engine_cpu_scheduling            # single + saturating, 4 rounds
    python -m bench.engine_cpu_scheduling --scenarios single --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.servers import cpu_info, free_port, load, running, step_histogram, stepserve_cmd
from bench.vs_llamacpp import KEYS, SCENARIOS

POLICIES = ("normal", "batch")
FIGURES = (
    "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "total_token_throughput",
    "execute_ms", "step_ms", "engine_gap_ms",
)


def run_server(
    policy: str, threads: int, scenarios: list[str], tmp: Path, tag: str
) -> dict[str, Any]:
    port = free_port()
    cmd = stepserve_cmd(port, threads, ["--engine-cpu-scheduling", policy])
    out: dict[str, Any] = {}
    with running(cmd, port, tmp / f"{tag}.log") as url:
        load(
            url,
            [
                "--num-prompts", "2", "--prompt-len", "32", "--output-len", "32",
                "--max-concurrency", "1", "--request-rate", "inf",
            ],
            tmp / f"{tag}-warm.json",
            ("completed",),
        )
        for scenario in scenarios:
            before = step_histogram(url)
            seed = str(1 + list(SCENARIOS).index(scenario))
            summary = load(
                url, [*SCENARIOS[scenario], "--seed", seed], tmp / f"{tag}-{scenario}.json", KEYS
            )
            (count, step, execute), (c0, s0, e0) = step_histogram(url), before
            steps = max(count - c0, 1)
            summary["step_ms"] = round(1e3 * (step - s0) / steps, 3)
            summary["execute_ms"] = round(1e3 * (execute - e0) / steps, 3)
            summary["engine_gap_ms"] = round(summary["step_ms"] - summary["execute_ms"], 3)
            out[scenario] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--scenarios", nargs="+", default=["single", "saturating"], choices=list(SCENARIOS)
    )
    ap.add_argument(
        "--rounds", type=int, default=4, help="rounds, alternating which policy goes first"
    )
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="stepserve-engine-policy-"))
    rounds = []
    for r in range(args.rounds):
        order = POLICIES if r % 2 == 0 else POLICIES[::-1]
        done = {p: run_server(p, args.threads, args.scenarios, tmp, f"{p}-{r}") for p in order}
        ratio = {
            s: {
                f: round(done["batch"][s][f] / done["normal"][s][f], 3)
                for f in FIGURES
                if done["normal"][s].get(f) and done["batch"][s].get(f) is not None
            }
            for s in args.scenarios
        }
        rounds.append({"first": order[0], **done, "ratios_batch_over_normal": ratio})
        print(json.dumps({"round": r, "ratios_batch_over_normal": ratio}), file=sys.stderr)
    medians = {s: {f: round(statistics.median(vals), 3) for f in FIGURES
                   if (vals := [x["ratios_batch_over_normal"][s][f] for x in rounds
                                if f in x["ratios_batch_over_normal"][s]])}
               for s in args.scenarios}
    print(
        json.dumps(
            {
                "benchmark": "engine_cpu_scheduling",
                "cpu": cpu_info(),
                "threads": args.threads,
                "scenarios": {s: SCENARIOS[s] for s in args.scenarios},
                "median_ratios_batch_over_normal": medians,
                "rounds": rounds,
                "logs": str(tmp),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
