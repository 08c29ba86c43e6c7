"""`stepserve simulate compare-policies`: every queue policy x victim policy on the same
traces (`policy_traces`), one row of `policy_metrics` per run, written as Markdown, JSON
and (with matplotlib) plots.

Queue policies: fcfs, priority, sjf (learned predictor), sjf-max_tokens (the bound as the
prediction) and fair (VTC); victim policies: all five. The preemption mode is recompute
unless `--preemption-modes` adds swap and auto (swap space = the KV cache's size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from loadgen.report import parse_goodput
from loadgen.sim.cost_model import CostModel
from loadgen.sim.policy_metrics import policy_row
from loadgen.sim.policy_traces import (
    TRACES,
    VARIANCE_RATE,
    Trace,
    TracePoint,
    build_trace,
    variance_args,
    variance_workload,
)
from loadgen.sim.result import ServicePoint
from loadgen.sim.setup import cost_model_from_args, scheduler_config_from_args
from loadgen.sim.simulator import SimLimits, Simulator
from scheduler.config import VICTIM_POLICIES, SchedulerConfig, VictimPolicy

QUEUE_POLICIES: dict[str, dict[str, Any]] = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "priority": {"scheduling_policy": "priority"},
    "sjf": {"scheduling_policy": "sjf", "output_len_predictor": "learned"},
    "sjf-max_tokens": {"scheduling_policy": "sjf", "output_len_predictor": "max_tokens"},
    "fair": {"scheduling_policy": "fair"},
}
DEFAULT_SLO = ("ttft:2000", "tpot:100")
Name = TypeVar("Name", bound=str)  # a policy, trace or mode name


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    trace: str
    point: str
    queue: str
    victim: VictimPolicy
    mode: str


def cell_config(point: TracePoint, cm: CostModel, cell: Cell) -> SchedulerConfig:
    args = argparse.Namespace(**vars(point.args))
    args.preemption_mode = cell.mode  # swap and auto get as many host blocks as device blocks
    base = scheduler_config_from_args(args, point.workload, cm)
    return dataclasses.replace(base, victim_policy=cell.victim, **QUEUE_POLICIES[cell.queue])


def run_cell(
    trace: Trace, point: TracePoint, cell: Cell, slo: dict[str, float]
) -> tuple[dict[str, Any], list[ServicePoint]]:
    cm = cost_model_from_args(point.args)
    config = cell_config(point, cm, cell)
    sim = Simulator(config, cm, SimLimits(), record_service=trace.record_service)
    result = sim.run(point.workload)
    row = {**dataclasses.asdict(cell), **policy_row(result, config, slo)}
    return row, result.tenant_service


def mix_capacity(spread: float, n: int = 1200, seed: int = 0) -> float:
    """Requests per second FCFS serves of the length-variance trace's spread mix (victim
    newest, recompute, as every cell runs) when all n arrive at once: the capacity the
    length-variance rate and the variance-load loads are fractions of."""
    point = TracePoint(
        str(spread), variance_args(n, math.inf), variance_workload(n, spread, math.inf, seed)
    )
    trace = Trace("capacity", "spread", "every request at once", [point])
    row, _ = run_cell(
        trace, point, Cell(trace.name, point.label, "fcfs", "newest", "recompute"), {}
    )
    if row["unfinished"]:
        raise RuntimeError(f"the capacity run left {row['unfinished']} of {n} requests unfinished")
    return n / float(row["duration_s"])


def parse_list(text: str, allowed: Sequence[Name], what: str) -> list[Name]:
    """The comma-separated names in `text`, each one of `allowed`."""
    by_name: dict[str, Name] = {a: a for a in allowed}
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in by_name]
    if bad or not items:
        raise ValueError(
            f"{what}: {', '.join(bad) or 'none given'}; choose from {', '.join(allowed)}"
        )
    return [by_name[s] for s in items]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stepserve simulate compare-policies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--traces", default=",".join(TRACES), help=f"comma-separated: {', '.join(TRACES)}"
    )
    p.add_argument("--queue-policies", default=",".join(QUEUE_POLICIES))
    p.add_argument("--victim-policies", default=",".join(VICTIM_POLICIES))
    p.add_argument(
        "--preemption-modes", default="recompute", help="comma-separated: recompute, swap, auto"
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply every trace's request count")
    p.add_argument(
        "--variance-rate",
        type=float,
        default=VARIANCE_RATE,
        help="length-variance arrivals, req/s "
        "(default %(default)s: 90%% of the spread-1 mix's capacity)",
    )
    p.add_argument("--goodput", nargs="+", default=list(DEFAULT_SLO), metavar="SLO",
                   help="SLOs in ms (default %(default)s)")
    p.add_argument(
        "--out-dir", default="policy-lab", help="policies.md, policies.json and PNGs go here"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def run_grid(
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], dict[str, list[ServicePoint]]]:
    """Every cell of the grid: the rows, and the flood trace's service timelines per queue
    policy (victim newest, the first preemption mode) for the plots."""
    traces = [
        build_trace(t, args.scale, args.variance_rate)
        for t in parse_list(args.traces, TRACES, "traces")
    ]
    queues = parse_list(args.queue_policies, list(QUEUE_POLICIES), "queue policies")
    victims = parse_list(args.victim_policies, VICTIM_POLICIES, "victim policies")
    modes = parse_list(args.preemption_modes, ("recompute", "swap", "auto"), "preemption modes")
    slo = parse_goodput(args.goodput)
    cells = [(t, p, Cell(t.name, p.label, q, v, m)) for t in traces for p in t.points
             for q in queues if t.queues is None or q in t.queues
             for v in victims if t.victims is None or v in t.victims for m in modes]
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[ServicePoint]] = {}
    for trace, point, cell in tqdm(
        cells, disable=args.disable_tqdm, unit="run", desc="compare-policies"
    ):
        row, service = run_cell(trace, point, cell, slo)
        rows.append(row)
        if service and cell.victim == victims[0] and cell.mode == modes[0]:
            timelines[cell.queue] = service
    return rows, timelines


def main(argv: list[str]) -> int:
    from loadgen.plotting import require_plots
    from loadgen.sim.policy_report import format_report

    args = build_parser().parse_args(argv)
    if not args.no_plots:
        require_plots()
    out = Path(args.out_dir)
    rows, timelines = run_grid(args)
    out.mkdir(parents=True, exist_ok=True)
    report = format_report(rows, args)
    (out / "policies.md").write_text(report)
    (out / "policies.json").write_text(
        json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str)
    )
    if not args.no_plots:
        from loadgen.sim.policy_plots import write_plots

        write_plots(rows, timelines, out)
    print(report)
    return 0 if all(r["unfinished"] == 0 for r in rows) else 1
