"""Fixed token budgets against step-time targets, on one saturating mixed workload.

For each configuration a fresh `stepserve serve` (default model) is started on a free port
and `stepserve bench` sends the same seeded workload all at once (`--request-rate inf`):
fixed budgets run with `--max-step-ms 0`, time targets with the default token budget.
Optionally the same workload goes to llama.cpp's `llama-server` on the same GGUF file.
Prints JSON: per configuration total throughput, TTFT p50/p99 and ITL p50/p99, and the
ratios the issue asks about (each target against the best fixed budget, and against
llama-server when it ran).

    python bench/step_budget.py                               # the full run (quiet machine)
    python bench/step_budget.py --num-prompts 4 --output-len 8 --budgets 256 --targets default
    python bench/step_budget.py --llama-server auto           # also llama-server (build it first:
                                                              #   bash /work/shared/tools/build-llama-server.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.servers import (  # noqa: E402
    BUILD_HINT,
    free_port,
    llama_cmd,
    llama_server_binary,
    load,
    running,
    stepserve_cmd,
)
from scheduler.config import DEFAULT_MAX_STEP_MS  # noqa: E402

KEYS = ("total_token_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
        "p99_itl_ms", "completed", "failed", "duration")


def _workload(args: argparse.Namespace) -> list[str]:
    return ["--num-prompts", str(args.num_prompts), "--prompt-len", args.prompt_len, "--output-len", args.output_len,
            "--seed", str(args.seed), "--request-rate", "inf"]


def run_stepserve(args: argparse.Namespace, flags: list[str], out: Path) -> dict[str, Any]:
    port = free_port()
    with running(stepserve_cmd(port, args.threads, flags), port) as url:
        return load(url, _workload(args), out, KEYS)


def run_llama_server(args: argparse.Namespace, binary: Path, out: Path) -> dict[str, Any]:
    port, slots = free_port(), min(args.num_prompts, 64)
    with running(llama_cmd(binary, port, args.threads, slots, args.llama_ctx_per_slot), port) as url:
        return load(url, _workload(args), out, KEYS)


def _configs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    fixed = [(f"budget-{b}", ["--max-num-batched-tokens", str(b), "--max-step-ms", "0"]) for b in args.budgets]
    targets = []
    for t in args.targets:
        ms = DEFAULT_MAX_STEP_MS if t == "default" else float(t)
        targets.append((f"target-{t}" if t != "default" else f"target-default-{ms:g}", ["--max-step-ms", f"{ms:g}"]))
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
                out[name] = {"throughput_vs_best_fixed": _div(r["total_token_throughput"], fixed[best]["total_token_throughput"]),
                             "itl_p99_vs_lowest_fixed": _div(r["p99_itl_ms"], lowest_itl),
                             "beats_every_fixed_on_itl_p99": (r["p99_itl_ms"] or float("inf")) < lowest_itl}
    if "llama-server" in results:
        ref = results["llama-server"]
        out["vs_llama_server"] = {name: {"throughput": _div(r["total_token_throughput"], ref["total_token_throughput"]),
                                         "itl_p99": _div(r["p99_itl_ms"], ref["p99_itl_ms"])}
                                  for name, r in results.items() if name != "llama-server"}
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prompt-len", default="uniform:20:600")
    ap.add_argument("--output-len", default="uniform:32:256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=int, nargs="*", default=[256, 512, 1024, 2048])
    ap.add_argument("--targets", nargs="*", default=["100", "200", "400", "default"], help="ms, or 'default'")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="worker (and llama-server) threads; default all cores but one, for the load client")
    ap.add_argument("--llama-server", default=None, help="path to llama-server, or 'auto' for the build script's")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    args = ap.parse_args(argv)
    binary = None
    if args.llama_server is not None:
        binary = llama_server_binary(args.llama_server)
        if binary is None:
            print(f"bench/step_budget.py: no llama-server at {args.llama_server}; {BUILD_HINT}", file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="stepserve-step-budget-"))
    results: dict[str, dict[str, Any]] = {}
    for name, flags in _configs(args):
        results[name] = {"flags": flags, **run_stepserve(args, flags, tmp / f"{name}.json")}
    if binary is not None:
        results["llama-server"] = run_llama_server(args, binary, tmp / "llama-server.json")
    print(json.dumps({"benchmark": "step_budget", "workload": _workload(args), "threads": args.threads,
                      "results": results, "ratios": ratios(results)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
