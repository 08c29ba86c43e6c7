"""`stepserve simulate compare-policies`: every queue policy x victim policy on the same
traces (`policy_traces`), one row of `policy_metrics` per run, written as Markdown, JSON
and (with matplotlib) plots.

Queue policies: fcfs, priority, sjf (learned predictor), sjf-max_tokens (the bound as the
prediction), fair (VTC), slo (least slack first, steps held to the tightest TPOT) and,
where a trace asks for it, slo-reject and fcfs-reject (with `--reject-unmeetable`: refused
clients retry after the Retry-After); victim policies: all six. A trace may name its own (queue,
victim) pairs instead of the grid (filtered by `--queue-policies`). The preemption mode is
recompute unless `--preemption-modes` adds swap and auto (swap space = the KV cache's size).

Every run refits the scheduler's step-cost model from its simulated steps, as the engine
does from measured ones, and every request's default objectives are the `--goodput` SLO.
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
    capacity,
    variance_args,
    variance_workload,
)
from loadgen.sim.result import ServicePoint
from loadgen.sim.setup import cost_model_from_args, scheduler_config_from_args
from loadgen.sim.simulator import SimLimits, Simulator
from loadgen.sim.step_cost import seeded_model
from scheduler.config import VICTIM_POLICIES, SchedulerConfig, VictimPolicy
from scheduler.slo import SLO
from scheduler.step_cost import recompute_time
from scheduler.step_cost_fit import OnlineStepCost

QUEUE_POLICIES: dict[str, dict[str, Any]] = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "priority": {"scheduling_policy": "priority"},
    "sjf": {"scheduling_policy": "sjf", "output_len_predictor": "learned"},
    "sjf-max_tokens": {"scheduling_policy": "sjf", "output_len_predictor": "max_tokens"},
    "fair": {"scheduling_policy": "fair"},
    "slo": {"scheduling_policy": "slo"},
    "slo-reject": {"scheduling_policy": "slo", "reject_unmeetable": True},
    "fcfs-reject": {"scheduling_policy": "fcfs", "reject_unmeetable": True},
}
# the queues of traces without pairs of their own: the refusing variants only where named
GRID_QUEUES = tuple(q for q in QUEUE_POLICIES if not q.endswith("-reject"))
DEFAULT_SLO = ("ttft:2000", "tpot:100")
RETRY_AFTER_EVERY = 4.0  # *-reject runs: re-simulate a refusal at most every 4 virtual s
Name = TypeVar("Name", bound=str)  # a policy, trace or mode name


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    trace: str
    point: str
    queue: str
    victim: VictimPolicy
    mode: str


def default_objectives(slo: dict[str, float]) -> SLO:
    """The lab's goodput SLO (ms) as every request's default objectives."""
    ttft, tpot = slo.get("ttft"), slo.get("tpot")
    return SLO(ttft / 1e3 if ttft else None, tpot / 1e3 if tpot else None)


def cell_config(point: TracePoint, cm: CostModel, cell: Cell,
                slo: dict[str, float] | None = None,
                step_model: OnlineStepCost | None = None) -> SchedulerConfig:
    args = argparse.Namespace(**vars(point.args))
    args.preemption_mode = cell.mode  # swap and auto get as many host blocks as device blocks
    if slo and args.default_slo.empty:
        args.default_slo = default_objectives(slo)
    base = scheduler_config_from_args(args, point.workload, cm, step_model)
    return dataclasses.replace(base, victim_policy=cell.victim, **QUEUE_POLICIES[cell.queue])


def run_cell(
    trace: Trace, point: TracePoint, cell: Cell, slo: dict[str, float],
    retry_after_every: float | None = RETRY_AFTER_EVERY,
) -> tuple[dict[str, Any], list[ServicePoint]]:
    cm = cost_model_from_args(point.args)
    # The step-cost model refits from every simulated step, as the engine's does from the
    # measured ones: seeded by the start-up calibration's small steps alone, it would price
    # a long prefill at a tenth of its time (the time budget, slo's keys and forecasts).
    model = seeded_model(cm)
    config = cell_config(point, cm, cell, slo, model)
    sim = Simulator(config, cm, SimLimits(), record_service=trace.record_service,
                    step_model=model,
                    retry_after_every=retry_after_every if config.reject_unmeetable else None)
    result = sim.run(point.workload)
    longest = max((w.prompt_len for w in point.workload), default=1)
    prefill = recompute_time(cm.step_time, longest)  # by the simulator's clock
    row = {**dataclasses.asdict(cell), **policy_row(result, config, slo, prefill)}
    return row, result.tenant_service


def mix_capacity(spread: float, n: int = 1200, seed: int = 0) -> float:
    """Requests per second FCFS serves of the length-variance trace's spread mix (victim
    newest, recompute, as every cell runs) when all n arrive at once: the capacity the
    length-variance rate and the variance-load loads are fractions of."""
    return capacity(variance_args(n, math.inf), variance_workload(n, spread, math.inf, seed))


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
    p.add_argument("--queue-policies", default=",".join(QUEUE_POLICIES),
                   help="comma-separated (default: all; the *-reject ones run only where a "
                        "trace names them)")
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
    p.add_argument("--retry-after-every", type=float, default=RETRY_AFTER_EVERY,
                   help="*-reject: re-simulate a refusal to check its Retry-After at most every "
                        "this many virtual seconds (default %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    p.add_argument("--report-from", nargs="+", default=None, metavar="POLICIES_JSON",
                   help="simulate nothing: write the report (and one policies.json) from the "
                        "rows of these files, e.g. runs of separate --traces")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def trace_pairs(
    trace: Trace, queues: list[str], victims: list[VictimPolicy], point: TracePoint | None = None
) -> list[tuple[str, VictimPolicy]]:
    """The (queue, victim) pairs `trace` runs (at `point`): the point's or trace's own, among
    `queues`; else the grid of `queues` (the *-reject ones only where a trace names them) x
    `victims`."""
    own = point.pairs if point is not None and point.pairs is not None else trace.pairs
    if own is not None:
        by_name: dict[str, VictimPolicy] = {v: v for v in VICTIM_POLICIES}
        return [(q, by_name[v]) for q, v in own if q in queues]
    return [(q, v) for q in queues if q in GRID_QUEUES for v in victims]


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
             for q, v in trace_pairs(t, queues, victims, p) for m in modes]
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[ServicePoint]] = {}
    for trace, point, cell in tqdm(
        cells, disable=args.disable_tqdm, unit="run", desc="compare-policies"
    ):
        row, service = run_cell(trace, point, cell, slo, args.retry_after_every)
        if trace.capacity:
            row["capacity"] = trace.capacity
        rows.append(row)
        if service and cell.victim == victims[0] and cell.mode == modes[0]:
            timelines[cell.queue] = service
    return rows, timelines


def merged_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], argparse.Namespace]:
    """The rows of every --report-from file, by trace and point in the order they first
    appear, then by queue, victim and mode; and the flags of the first file (what the
    report's header states), with this command's output flags."""
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for path in args.report_from:
        data = json.loads(Path(path).read_text())
        first = first or data["args"]
        rows += data["rows"]
    assert first is not None
    traces = {t: i for i, t in enumerate(dict.fromkeys(r["trace"] for r in rows))}
    points = {key: i for i, key in enumerate(dict.fromkeys((r["trace"], r["point"]) for r in rows))}
    queues = {q: i for i, q in enumerate(QUEUE_POLICIES)}
    victims = {v: i for i, v in enumerate(VICTIM_POLICIES)}
    modes = {m: i for i, m in enumerate(("recompute", "swap", "auto"))}
    rows.sort(key=lambda r: (traces[r["trace"]], points[(r["trace"], r["point"])],
                             queues.get(r["queue"], len(queues)),
                             victims.get(r["victim"], len(victims)), modes.get(r["mode"], 3)))
    merged = argparse.Namespace(**{**first, "out_dir": args.out_dir, "no_plots": args.no_plots,
                                   "report_from": args.report_from})
    return rows, merged


def main(argv: list[str]) -> int:
    from loadgen.plotting import require_plots
    from loadgen.sim.policy_report import format_report

    args = build_parser().parse_args(argv)
    if not args.no_plots:
        require_plots()
    out = Path(args.out_dir)
    if args.report_from:
        rows, args = merged_rows(args)
        timelines: dict[str, list[ServicePoint]] = {}
    else:
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
