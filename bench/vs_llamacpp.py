"""stepserve against llama.cpp's `llama-server`, side by side in one run, on the same GGUF file.

Each server is started fresh, in turn, with the same number of threads, and gets the same
seeded requests from `stepserve bench` (OpenAI /v1/completions, streamed, exact output
lengths):

    single      one stream at a time: 32-token prompts -> 128 tokens (TPOT, TTFT)
    prefill     one at a time: 1,000-token prompts -> 1 token (prefill tokens/s from TTFT)
    saturating  64 requests of mixed lengths sent at once (total and output tokens/s, ITL, TTFT)
    poisson     48 requests at a Poisson rate (TTFT, ITL, TPOT)
    structured  16 chat requests at once, each constrained by one JSON schema
                (`response_format`, which llama-server enforces too) that runs the whole
                128-token budget (TPOT, output tokens/s)

Prints JSON: both summaries per scenario and stepserve / llama-server ratios. With `--rounds
N` both servers run N times, which goes first alternating, and each ratio is the median of
the rounds' (every round's summaries under "rounds"): on a shared machine whose speed drifts
within minutes, one server's turn can fall in a slow stretch the other's misses. The binary is
the one `../shared/tools/build-llama-server.sh` builds (or `--llama-server PATH`); when it is
absent the bench says how to build it and exits 2.

    python -m bench.vs_llamacpp                     # all scenarios (a quiet machine: ~10 min)
    python -m bench.vs_llamacpp --scenarios single --stepserve-flags --enforce-eager
    python -m bench.vs_llamacpp --scenarios single saturating --rounds 4
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
    cpu_info,
    free_port,
    llama_cmd,
    llama_server_binary,
    load,
    running,
    stepserve_cmd,
)
from bench.structured import RESPONSE_FORMAT

KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "total_token_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "median_itl_ms", "p99_itl_ms",
)
SCENARIOS: dict[str, list[str]] = {
    "single": [
        "--num-prompts", "8", "--prompt-len", "32", "--output-len", "128", "--max-concurrency", "1",
        "--request-rate", "inf",
    ],
    "prefill": [
        "--num-prompts", "6", "--prompt-len", "1000", "--output-len", "1", "--max-concurrency", "1",
        "--request-rate", "inf",
    ],
    "saturating": [
        "--num-prompts", "64", "--prompt-len", "uniform:20:600", "--output-len", "uniform:32:256",
        "--request-rate", "inf",
    ],
    "poisson": [
        "--num-prompts", "48", "--prompt-len", "uniform:20:600", "--output-len", "uniform:32:256",
        "--request-rate", "1.5",
    ],
    "structured": [
        "--endpoint", "/v1/chat/completions", "--num-prompts", "16", "--prompt-len", "64",
        "--output-len", "128", "--request-rate", "inf", "--no-ignore-eos",
        "--extra-body", json.dumps({"response_format": RESPONSE_FORMAT}),
    ],
}
# ratio name -> (summary key, scenario, higher is better)
RATIOS = {
    "single_tpot": ("median_tpot_ms", "single", False),
    "single_ttft": ("median_ttft_ms", "single", False),
    "prefill_tokens_per_s": ("prefill_tokens_per_s", "prefill", True),
    "saturating_total_tokens_per_s": ("total_token_throughput", "saturating", True),
    "saturating_output_tokens_per_s": ("output_throughput", "saturating", True),
    "saturating_itl_p50": ("median_itl_ms", "saturating", False),
    "saturating_itl_p99": ("p99_itl_ms", "saturating", False),
    "saturating_ttft_p50": ("median_ttft_ms", "saturating", False),
    "poisson_ttft_p50": ("median_ttft_ms", "poisson", False),
    "poisson_itl_p99": ("p99_itl_ms", "poisson", False),
    "poisson_tpot": ("median_tpot_ms", "poisson", False),
    "structured_tpot": ("median_tpot_ms", "structured", False),
    "structured_output_tokens_per_s": ("output_throughput", "structured", True),
}


def _with_prefill_rate(summary: dict[str, Any], scenario: str) -> dict[str, Any]:
    if scenario == "prefill" and summary.get("median_ttft_ms") and summary.get("completed"):
        prompt = summary["total_input_tokens"] / summary["completed"]
        summary["prefill_tokens_per_s"] = round(prompt / (summary["median_ttft_ms"] / 1e3), 1)
    return summary


def run_all(
    cmd: list[str], port: int, scenarios: list[str], tmp: Path, name: str
) -> dict[str, Any]:
    """One fresh server for all scenarios, in order. Each scenario has its own seed: with one
    seed the Poisson prompts were the saturating run's first 48, and llama-server's slots
    (which keep their last prompt's KV) answered them from cache."""
    out: dict[str, Any] = {}
    with running(cmd, port, tmp / f"{name}.log") as url:
        for scenario in scenarios:
            seed = str(1 + list(SCENARIOS).index(scenario))
            summary = load(
                url, [*SCENARIOS[scenario], "--seed", seed], tmp / f"{name}-{scenario}.json", KEYS
            )
            out[scenario] = _with_prefill_rate(summary, scenario)
    return out


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """stepserve / llama-server for each figure (a time ratio < 1 or a rate ratio > 1 is ours
    winning)."""
    out: dict[str, Any] = {}
    for name, (key, scenario, _) in RATIOS.items():
        a, b = ours.get(scenario, {}).get(key), theirs.get(scenario, {}).get(key)
        out[name] = round(a / b, 3) if a is not None and b else None
    return out


def median_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds' ratios (None where no round has it)."""
    out: dict[str, Any] = {}
    for name in RATIOS:
        values = [r[name] for r in rounds if r.get(name) is not None]
        out[name] = round(statistics.median(values), 3) if values else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--llama-server", default="auto", help="path to llama-server ('auto': the build script's)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="each server's threads (default: all cores)",
    )
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--stepserve-flags", nargs=argparse.REMAINDER, default=[],
                    help="extra `stepserve serve` flags (last on the command line)")
    ap.add_argument("--slots", type=int, default=64, help="llama-server's parallel slots (-np)")
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run both servers this many times, alternating which goes first (llama-server in even "
        "rounds), and report each figure's median ratio: the machine's drift between the two "
        "servers' turns then falls on both sides",
    )
    args = ap.parse_args(argv)
    binary = llama_server_binary(args.llama_server)
    if binary is None:
        print(
            f"bench.vs_llamacpp: no llama-server at {args.llama_server}; {BUILD_HINT}",
            file=sys.stderr,
        )
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="stepserve-vs-llamacpp-"))
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        done: dict[str, Any] = {}
        for name in ("llama-server", "stepserve") if r % 2 == 0 else ("stepserve", "llama-server"):
            port = free_port()
            cmd = (
                llama_cmd(binary, port, args.threads, args.slots, args.ctx_per_slot)
                if name == "llama-server"
                else stepserve_cmd(port, args.threads, args.stepserve_flags)
            )
            done[name] = run_all(cmd, port, args.scenarios, tmp, name if r == 0 else f"{name}-{r}")
        rounds.append(
            {
                "first": "llama-server" if r % 2 == 0 else "stepserve",
                "llama_server": done["llama-server"],
                "stepserve": done["stepserve"],
                "ratios": ratios(done["stepserve"], done["llama-server"]),
            }
        )
    llama, ours = rounds[0]["llama_server"], rounds[0]["stepserve"]
    log = (tmp / "stepserve.log").read_text(errors="replace")
    chosen = [line.split("stepserve.worker: ", 1)[1] for line in log.splitlines()
              if "stepserve.worker: kernels:" in line or "stepserve.worker: forward:" in line]
    print(
        json.dumps(
            {
                "benchmark": "vs_llamacpp",
                "cpu": cpu_info(),
                "threads": args.threads,
                "stepserve_flags": args.stepserve_flags,
                "stepserve_worker": chosen,
                "scenarios": {s: SCENARIOS[s] for s in args.scenarios},
                "llama_server": llama,
                "stepserve": ours,
                "ratios_stepserve_over_llama": median_ratios([r["ratios"] for r in rounds]),
                **({"rounds": rounds} if args.rounds > 1 else {}),
                "logs": str(tmp),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
