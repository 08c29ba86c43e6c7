"""Fixed token budgets against step-time targets, on one saturating mixed workload.

For each configuration a fresh `stepserve serve` (default model) is started on a free port
and `stepserve bench` sends the same seeded workload all at once (`--request-rate inf`):
fixed budgets run with `--max-step-ms 0`, time targets with the default token budget.
Optionally the same workload goes to llama.cpp's `llama-server` on the same GGUF file.
Prints JSON: per configuration total throughput, TTFT p50/p99 and ITL p50/p99, and the
ratios that decide whether a time target pays (each target against the best fixed budget,
and against llama-server when it ran). With `--rounds N` every configuration runs N times, the order
reversed every other round (a shared machine drifts within minutes: one pass in order puts
the last configurations in whatever stretch the machine is in by then); each figure is then
the median over rounds, each ratio the median of the rounds' own ratios, and every round's
results are kept under "rounds".

    python -m bench.step_time_budget                  # the full run (quiet machine)
    python -m bench.step_time_budget --num-prompts 4 --output-len 8 --budgets 256 \
        --targets default
    python -m bench.step_time_budget --budgets 256 512 --targets 100 default --rounds 3
    python -m bench.step_time_budget --budgets 256 --targets 100:0 100:0.5   # ms:share
    python -m bench.step_time_budget --llama-server auto  # also llama-server (build it
                                       # first: bash ../shared/tools/build-llama-server.sh)
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

from bench.servers import (
    BUILD_HINT,
    free_port,
    llama_cmd,
    llama_server_binary,
    load,
    running,
    stepserve_cmd,
)
from scheduler.config import SchedulerConfig

KEYS = (
    "total_token_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
    "p99_itl_ms", "completed", "failed", "duration",
)


def _workload(args: argparse.Namespace) -> list[str]:
    return [
        "--num-prompts", str(args.num_prompts), "--prompt-len", args.prompt_len, "--output-len",
        args.output_len, "--seed", str(args.seed), "--request-rate", "inf",
    ]


def run_stepserve(args: argparse.Namespace, flags: list[str], out: Path) -> dict[str, Any]:
    port = free_port()
    with running(stepserve_cmd(port, args.threads, flags), port) as url:
        return load(url, _workload(args), out, KEYS)


def run_llama_server(args: argparse.Namespace, binary: Path, out: Path) -> dict[str, Any]:
    port, slots = free_port(), min(args.num_prompts, 64)
    with running(
        llama_cmd(binary, port, args.threads, slots, args.llama_ctx_per_slot), port
    ) as url:
        return load(url, _workload(args), out, KEYS)


def _configs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    fixed = [
        (f"budget-{b}", ["--max-num-batched-tokens", str(b), "--max-step-ms", "0"])
        for b in args.budgets
    ]
    targets = []
    default = SchedulerConfig()
    for t in args.targets:  # "default", "MS" (the default --min-prefill-share) or "MS:SHARE"
        if t == "default":
            ms, share = f"{default.max_step_ms:g}", f"{default.min_prefill_share:g}"
            targets.append((f"target-default-{ms}-share-{share}",
                            ["--max-step-ms", ms, "--min-prefill-share", share]))
            continue
        ms, _, share = t.partition(":")
        flags = ["--max-step-ms", f"{float(ms):g}"] + (
            ["--min-prefill-share", f"{float(share):g}"] if share else []
        )
        targets.append(
            (f"target-{float(ms):g}" + (f"-share-{float(share):g}" if share else ""), flags)
        )
    return fixed + targets


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each target against the best fixed budget (and against llama-server when present)."""
    fixed = {k: v for k, v in results.items() if k.startswith("budget-")}
    out: dict[str, Any] = {}
    if fixed:
        best = max(fixed, key=lambda k: fixed[k]["total_token_throughput"] or 0)
        lowest_itl = min(v["p99_itl_ms"] or float("inf") for v in fixed.values())
        out["best_fixed_budget"] = best
        for name, r in results.items():
            if name.startswith("target-"):
                out[name] = {
                    "throughput_vs_best_fixed": _div(
                        r["total_token_throughput"], fixed[best]["total_token_throughput"]
                    ),
                    "itl_p99_vs_lowest_fixed": _div(r["p99_itl_ms"], lowest_itl),
                    "beats_every_fixed_on_itl_p99": (r["p99_itl_ms"] or float("inf")) < lowest_itl,
                }
    if "llama-server" in results:
        ref = results["llama-server"]
        out["vs_llama_server"] = {
            name: {
                "throughput": _div(r["total_token_throughput"], ref["total_token_throughput"]),
                "itl_p99": _div(r["p99_itl_ms"], ref["p99_itl_ms"]),
            }
            for name, r in results.items()
            if name != "llama-server"
        }
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_results(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration, each figure's median over the rounds (None where no round has it)."""
    out: dict[str, dict[str, Any]] = {}
    for name, first in rounds[0].items():
        merged: dict[str, Any] = {"flags": first["flags"]} if "flags" in first else {}
        for key in KEYS:
            values = [r[name][key] for r in rounds if r[name].get(key) is not None]
            merged[key] = statistics.median(values) if values else None
        out[name] = merged
    return out


def median_ratios(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' ratios merged: numbers by their median, flags by how many rounds hold them,
    the best fixed budget as each round's pick."""
    def merge(values: list[Any]) -> Any:
        present = [v for v in values if v is not None]
        if not present:
            return None
        if isinstance(present[0], dict):
            return {k: merge([v.get(k) for v in present]) for k in present[0]}
        if isinstance(present[0], bool):
            return f"{sum(present)} of {len(present)} rounds"
        if isinstance(present[0], (int, float)):
            return statistics.median(present)
        return present if len(set(present)) > 1 else present[0]
    return merge(per_round)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prompt-len", default="uniform:20:600")
    ap.add_argument("--output-len", default="uniform:32:256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=int, nargs="*", default=[256, 512, 1024, 2048])
    ap.add_argument("--targets", nargs="*", default=["100", "200", "400", "default"],
                    help="ms (with the default --min-prefill-share), ms:share, or 'default'")
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="worker (and llama-server) threads; default all cores but one, for the load client",
    )
    ap.add_argument(
        "--llama-server",
        default=None,
        help="path to llama-server, or 'auto' for the build script's",
    )
    ap.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, the order reversed "
        "every other round; report medians (the machine drifts between configurations)",
    )
    args = ap.parse_args(argv)
    binary = None
    if args.llama_server is not None:
        binary = llama_server_binary(args.llama_server)
        if binary is None:
            print(
                f"bench.step_time_budget: no llama-server at {args.llama_server}; {BUILD_HINT}",
                file=sys.stderr,
            )
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="stepserve-step-budget-"))
    runs: list[tuple[str, list[str] | None]] = list(_configs(args))
    if binary is not None:
        runs.append(("llama-server", None))
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(max(1, args.rounds)):
        done: dict[str, dict[str, Any]] = {}
        for name, flags in runs if r % 2 == 0 else runs[::-1]:
            out = tmp / f"{name}-{r}.json"
            done[name] = (
                run_llama_server(args, binary, out)
                if flags is None and binary is not None
                else {"flags": flags, **run_stepserve(args, flags or [], out)}
            )
        rounds.append({name: done[name] for name, _ in runs})
    results = median_results(rounds) if len(rounds) > 1 else rounds[0]
    per_round = [ratios(r) for r in rounds]
    print(
        json.dumps(
            {
                "benchmark": "step_time_budget",
                "workload": _workload(args),
                "threads": args.threads,
                "rounds": len(rounds),
                "results": results,
                "ratios": median_ratios(per_round) if len(rounds) > 1 else per_round[0],
                **(
                    {
                        "per_round": [
                            {"results": r, "ratios": q}
                            for r, q in zip(rounds, per_round, strict=True)
                        ]
                    }
                    if len(rounds) > 1
                    else {}
                ),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
