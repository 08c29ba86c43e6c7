"""The server process's CPU scheduling policy, side by side: `stepserve serve
--engine-sched-policy normal` (SCHED_OTHER) against `batch` (SCHED_BATCH, the default),
each a fresh server, on the same requests as `bench/vs_llamacpp.py`. Prints JSON.

Per scenario and policy: the load generator's summary, and from `/metrics` over the
scenario the worker's mean execute time per step and the engine's mean step time (output
to output); their difference is what the engine, the pipe and the OS add to every step.
Rounds alternate which policy goes first; ratios are batch / normal, each figure's median
over the rounds (a time ratio < 1 or a rate ratio > 1 is SCHED_BATCH winning).

    python bench/engine_policy.py                                   # single + saturating, 4 rounds
    python bench/engine_policy.py --scenarios single --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.servers import free_port, load, running, stepserve_cmd  # noqa: E402
from bench.vs_llamacpp import KEYS, SCENARIOS, cpu_info  # noqa: E402

POLICIES = ("normal", "batch")
_HISTOGRAMS = {"execute_ms": "model_execute_time_seconds", "step_ms": "step_duration_seconds"}
# figure -> higher is better
FIGURES = {"median_tpot_ms": False, "median_itl_ms": False, "p99_itl_ms": False, "median_ttft_ms": False,
           "total_token_throughput": True, "execute_ms": False, "step_ms": False, "engine_gap_ms": False}


def histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the step histograms in `/metrics`."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for name, metric in _HISTOGRAMS.items():
        found = [re.search(rf"^\S*{metric}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M) for part in ("sum", "count")]
        if all(found):
            out[name] = (float(found[0].group(1)), float(found[1].group(1)))  # type: ignore[union-attr]
    return out


def run_server(policy: str, threads: int, scenarios: list[str], tmp: Path, tag: str) -> dict[str, Any]:
    port = free_port()
    cmd = stepserve_cmd(port, threads, ["--engine-sched-policy", policy])
    out: dict[str, Any] = {}
    with running(cmd, port, tmp / f"{tag}.log") as url:
        load(url, ["--num-prompts", "2", "--prompt-len", "32", "--output-len", "32", "--max-concurrency", "1",
                   "--request-rate", "inf"], tmp / f"{tag}-warm.json", ("completed",))
        for scenario in scenarios:
            before = histogram_sums(url)
            seed = str(1 + list(SCENARIOS).index(scenario))
            summary = load(url, [*SCENARIOS[scenario], "--seed", seed], tmp / f"{tag}-{scenario}.json", KEYS)
            after = histogram_sums(url)
            for name, (total, count) in after.items():
                t0, c0 = before.get(name, (0.0, 0.0))
                summary[name] = round(1e3 * (total - t0) / max(count - c0, 1), 3)
            if "execute_ms" in summary and "step_ms" in summary:
                summary["engine_gap_ms"] = round(summary["step_ms"] - summary["execute_ms"], 3)
            out[scenario] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--scenarios", nargs="+", default=["single", "saturating"], choices=list(SCENARIOS))
    ap.add_argument("--rounds", type=int, default=4, help="rounds, alternating which policy goes first")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="stepserve-engine-policy-"))
    rounds = []
    for r in range(args.rounds):
        order = POLICIES if r % 2 == 0 else POLICIES[::-1]
        done = {p: run_server(p, args.threads, args.scenarios, tmp, f"{p}-{r}") for p in order}
        ratio = {s: {f: round(done["batch"][s][f] / done["normal"][s][f], 3)
                     for f in FIGURES if done["normal"][s].get(f) and done["batch"][s].get(f) is not None}
                 for s in args.scenarios}
        rounds.append({"first": order[0], **done, "ratios_batch_over_normal": ratio})
        print(json.dumps({"round": r, "ratios_batch_over_normal": ratio}), file=sys.stderr)
    medians = {s: {f: round(statistics.median(vals), 3) for f in FIGURES
                   if (vals := [x["ratios_batch_over_normal"][s][f] for x in rounds
                                if f in x["ratios_batch_over_normal"][s]])}
               for s in args.scenarios}
    print(json.dumps({"benchmark": "engine_policy", "cpu": cpu_info(), "threads": args.threads,
                      "scenarios": {s: SCENARIOS[s] for s in args.scenarios},
                      "median_ratios_batch_over_normal": medians, "rounds": rounds, "logs": str(tmp)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
