"""`stepserve simulate`: the virtual-clock simulator's command line.

stepserve simulate [run flags]                  one run (--strategy continuous|static|padding|all)
stepserve simulate compare [run flags]          the three strategies side by side
stepserve simulate sweep --param NAME V1,V2,...
                         | --preset token-budget|kv-capacity|prompt-len|step-time
stepserve simulate roofline --model-shape llama-3.1-8b --hardware a100
stepserve simulate calibrate --from bench_output.json [--out profile.json]
stepserve simulate compare-policies [--traces ...] [--scale X] [--out-dir DIR]
stepserve simulate cluster --replicas N --router NAME [--load X] [--sweep] [run flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadgen.plotting import PlotsUnavailable, require_plots
from loadgen.report import format_table
from loadgen.sim import cluster_lab, policy_lab
from loadgen.sim.calibrate import calibrate_bench
from loadgen.sim.cost_model import get_hardware
from loadgen.sim.result import SimResult
from loadgen.sim.roofline import format_roofline, roofline
from loadgen.sim.scenarios import add_scenario_arg, parse_with_scenario, scenario_workload
from loadgen.sim.setup import (
    STRATEGIES,
    add_cost_args,
    add_run_args,
    build_workload,
    cost_model_from_args,
    goodput_of,
    run_config,
    run_strategy,
)
from loadgen.sim.slo_metrics import format_slo
from loadgen.sim.sweep import PRESETS, companion_rows, format_rows, sweep
from loadgen.sim.timeline import timeline_run, write_timeline

COMPARE_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "num_preemptions", "unfinished",
                "mean_kv_cache_usage", "num_steps")


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def _run_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    return parser


def format_compare(summaries: dict[str, dict[str, Any]]) -> str:
    """One column per strategy, one row per summary key."""
    names = list(summaries)
    lines = [f"{'':<22}" + "".join(f"{n:>14}" for n in names)]
    for key in COMPARE_KEYS:
        cells = [summaries[n].get(key) for n in names]
        lines.append(f"{key:<22}" + "".join(
            f"{c:>14.3f}" if isinstance(c, float) else f"{c!s:>14}" for c in cells))
    return "\n".join(lines)


def _write_result(path: str, args: argparse.Namespace, results: list[SimResult],
                  summaries: dict[str, dict[str, Any]]) -> None:
    data = {"config": run_config(args), "summaries": summaries,
            "unfinished": {r.strategy: r.unfinished for r in results},
            "records": {r.strategy: [_record(x) for x in r.records] for r in results}}
    refusals = {r.strategy: [dataclasses.asdict(x) for x in r.refusals]
                for r in results if r.refusals}
    if refusals:
        data["refusals"] = refusals
    Path(path).write_text(_dump(data))


def _record(rec: Any) -> dict[str, Any]:
    return {"request_id": rec.request_id, "success": rec.success, "error": rec.error,
            "prompt_tokens": rec.prompt_tokens, "output_tokens": rec.output_tokens,
            "arrival_time": rec.arrival_time, "ttft": rec.ttft, "e2el": rec.e2el, "itls": rec.itls}


def cmd_run(argv: list[str], compare: bool = False) -> int:
    parser = _run_parser("stepserve simulate")
    add_scenario_arg(parser)
    args = parse_with_scenario(parser, argv)
    if args.timeline:
        require_plots()
    strategies = list(STRATEGIES) if compare or args.strategy == "all" else [args.strategy]
    workload = scenario_workload(args) or build_workload(args)
    goodput = goodput_of(args)
    results = [
        run_strategy(
            args, s, workload, timeline=bool(args.timeline), record_steps=bool(args.timeline_json)
        )
        for s in strategies
    ]
    summaries = {r.strategy: r.summary(goodput) for r in results}
    if args.timeline_json:
        runs = [timeline_run(r.strategy, r.step_hello or {}, r.step_records) for r in results]
        write_timeline(args.timeline_json, runs, run_config(args))
    if args.timeline:
        from loadgen.sim.plots import plot_timeline

        for r in results:
            path = args.timeline if len(results) == 1 else _suffixed(args.timeline, r.strategy)
            plot_timeline(r.timeline, path, f"{r.strategy}: {args.model_shape} on {args.hardware}")
    if args.result_json:
        _write_result(args.result_json, args, results, summaries)
    if args.json:
        print(_dump(summaries[strategies[0]] if len(results) == 1 else summaries))
    elif len(results) == 1:
        print(format_table(summaries[strategies[0]]))
        s = summaries[strategies[0]]
        print(f"preemptions: {s['num_preemptions']}, unfinished: {s['unfinished']}, "
              f"mean KV usage: {s['mean_kv_cache_usage']:.1%}, steps: {s['num_steps']}")
        if "slo" in s:
            print(format_slo(s["slo"]))
    else:
        print(format_compare(summaries))
    return 0 if all(not r.unfinished for r in results) else 1


def _suffixed(path: str, tag: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{tag}{p.suffix or '.png'}"))


def cmd_sweep(argv: list[str]) -> int:
    parser = _run_parser("stepserve simulate sweep")
    parser.add_argument(
        "--param",
        nargs=2,
        metavar=("NAME", "VALUES"),
        default=None,
        help="a SchedulerConfig field or workload parameter, and comma-separated values",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--plot", default=None, help="PNG file of the curves")
    pre, _ = parser.parse_known_args(argv)
    preset = PRESETS.get(pre.preset) if pre.preset else None
    if preset is not None:
        parser.set_defaults(**preset.defaults)
    args = parser.parse_args(argv)
    if args.param:
        name, values = args.param[0], args.param[1].split(",")
    elif preset is not None:
        name, values = preset.param, list(preset.values)
    else:
        parser.error("give --param NAME V1,V2,... or --preset")
    if args.plot:
        require_plots()
    rows = sweep(args, name, values)
    # The preset's second sweep, with the step-time target off: (its parameter, its rows).
    companion = ((preset.companion[0], companion_rows(args, preset))
                 if preset is not None and preset.companion is not None else None)
    title = f"{preset.name if preset else 'sweep'}: {args.model_shape} on {args.hardware}"
    if args.plot:
        from loadgen.sim.plots import plot_budget_vs_target, plot_sweep

        if companion is not None:
            plot_budget_vs_target(companion[1], rows, args.plot, title)
        else:
            plot_sweep(rows, name, args.plot, title)
    out: dict[str, Any] = {"config": run_config(args), "param": name, "rows": rows}
    if companion is not None:
        out["companion"] = {"param": companion[0], "max_step_ms": 0, "rows": companion[1]}
    if args.json:
        print(_dump(out if companion is not None else rows))
    else:
        print(format_rows(rows, name))
        if companion is not None:
            print(f"\nwith --max-step-ms 0:\n{format_rows(companion[1], companion[0])}")
    if args.result_json:
        Path(args.result_json).write_text(_dump(out))
    return 0


def cmd_roofline(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stepserve simulate roofline")
    add_cost_args(parser)
    parser.add_argument("--context", default="1024,4096", help="decode contexts T, comma-separated")
    parser.add_argument("--prefill", default="512,4096", help="prefill lengths N, comma-separated")
    parser.add_argument(
        "--preempt", default="4000:100", help="PROMPT:GENERATED of a preempted request"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.block_size = 16
    cm = cost_model_from_args(args)
    prompt, _, generated = args.preempt.partition(":")
    table = roofline(cm, [int(x) for x in args.context.split(",")],
                     [int(x) for x in args.prefill.split(",")], (int(prompt), int(generated or 0)))
    print(_dump(table) if args.json else format_roofline(table))
    return 0


def cmd_calibrate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stepserve simulate calibrate")
    parser.add_argument(
        "--from", dest="source", required=True, help="bench/worker_step.py JSON output"
    )
    parser.add_argument("--model-shape", default=None, help="default: from the bench's model name")
    parser.add_argument(
        "--dtype", default=None, help="which of the bench's results; default: the first"
    )
    parser.add_argument(
        "--base", default="cpu", help="profile whose host link (and unmeasured roofs) to keep"
    )
    parser.add_argument("--name", default=None, help="the fitted profile's name")
    parser.add_argument("--out", default=None, help="write the fitted profile JSON here")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.source).read_text())
    fit, shape = calibrate_bench(
        data, get_hardware(args.base), args.model_shape, args.dtype, args.name
    )
    out = {
        "profile": fit.profile.to_dict(),
        "model_shape": shape.name,
        "dtype_bytes": shape.dtype_bytes,
        "rel_rmse": fit.rel_rmse,
        "num_samples": fit.num_samples,
        "num_compute_bound": fit.num_compute_bound,
    }
    if args.out:
        Path(args.out).write_text(_dump(out))
    print(_dump(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `stepserve simulate`; returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    commands: dict[str, Callable[[list[str]], int]] = {
        "sweep": cmd_sweep, "roofline": cmd_roofline, "calibrate": cmd_calibrate,
        "compare-policies": policy_lab.main, "cluster": cluster_lab.main,
        "compare": lambda rest: cmd_run(rest, compare=True), "run": cmd_run}
    try:
        if args and args[0] in commands:
            return commands[args[0]](args[1:])
        return cmd_run(args)
    except (ValueError, PlotsUnavailable) as exc:
        print(f"stepserve simulate: error: {exc}", file=sys.stderr)
        return 2

