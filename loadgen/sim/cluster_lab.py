"""`stepserve simulate cluster`: traces, loads, sweeps and reports of the simulated cluster
(`loadgen/sim/cluster.py`, routers in `loadgen/sim/routers.py`).

Traces:

- `workload`: the requests the run flags describe (`--dataset`, `--num-prompts`, ...: the
  single-replica simulator's workloads).
- `multi-turn`: chat sessions with shared system prompts. `--system-prompts` distinct
  system prompts of `--system-len` tokens; each session picks one at random and runs
  `--turns LO:HI` turns; a turn's prompt is the previous turn's prompt + its answer (the
  simulated worker's tokens) + new user text (`--user-len`); answers are `--answer-len`.
  Sessions start as a Poisson process; turn k+1 is sent a think time after turn k was sent
  (2 s + exponential, mean `--think-s`). The trace is open loop: under load a turn may
  arrive before its predecessor's answer is cached.

Load: `--load X` offers X times the cluster's capacity: one replica's, times the number of
replicas. `--capacity goodput` (the default) is DistServe's goodput capacity: the highest
rate one replica is offered at which 90% of the requests (`--capacity-attainment`) meet
the SLO (`--goodput`, default the policy lab's ttft:2000 tpot:100), found by bisection
over runs of the same trace; the rate is the trace's nominal one (a multi-turn trace's
session rate times its mean turns, which its arrivals reach once sessions overlap).
`--capacity all-at-once` is the policy lab's measure (`policy_traces.capacity`: FCFS
serves the trace with every request queued at once): what a replica serves with a queue
that never empties, whatever the requests wait, 1.3x the goodput capacity on the
multi-turn trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from loadgen.distributions import arrival_times
from loadgen.plotting import require_plots
from loadgen.report import meets_slos, parse_goodput
from loadgen.sim.cluster import Cluster, ClusterResult
from loadgen.sim.policy_lab import DEFAULT_SLO
from loadgen.sim.policy_traces import at_rate, capacity
from loadgen.sim.routers import LOAD_SIGNALS, ROUTERS, make_router
from loadgen.sim.setup import (
    add_run_args,
    build_workload,
    cost_model_from_args,
    scheduler_config_from_args,
)
from loadgen.sim.step_cost import seeded_model
from loadgen.workloads import WorkloadRequest

TRACES = ("multi-turn", "workload")
CAPACITIES = ("goodput", "all-at-once")
TOKEN_ID_RANGE = (10, 32000)  # user and system text ids: clear of the simulator's 0 and 1


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    """The multi-turn trace's shape."""

    sessions: int = 240
    system_prompts: int = 4
    system_len: int = 1024
    turns: tuple[int, int] = (2, 6)  # uniform, inclusive
    user_len: tuple[int, int] = (32, 256)
    answer_len: tuple[int, int] = (32, 256)
    think_s: float = 6.0

    @property
    def mean_turns(self) -> float:
        return sum(self.turns) / 2

    @property
    def max_len(self) -> int:
        """The longest prompt + answer a session can reach."""
        return self.system_len + self.turns[1] * (self.user_len[1] + self.answer_len[1])


def multi_turn_workload(shape: MultiTurn, session_rate: float,
                        seed: int = 0) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 40])
    starts = arrival_times(shape.sessions, session_rate, 1.0, np.random.default_rng([seed, 41]))
    systems = [rng.integers(*TOKEN_ID_RANGE, size=shape.system_len).tolist()
               for _ in range(shape.system_prompts)]
    out: list[WorkloadRequest] = []
    for s in range(shape.sessions):
        prompt = list(systems[int(rng.integers(shape.system_prompts))])
        sent = float(starts[s])
        for t in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            prompt += rng.integers(*TOKEN_ID_RANGE, size=int(rng.integers(
                shape.user_len[0], shape.user_len[1] + 1))).tolist()
            answer = int(rng.integers(shape.answer_len[0], shape.answer_len[1] + 1))
            out.append(WorkloadRequest(f"s{s}-t{t}", sent, len(prompt), answer,
                                       prompt_token_ids=list(prompt), user=f"s{s}"))
            prompt += [1] * answer  # the simulated worker's answer (SIM_TOKEN_ID)
            sent += 2.0 + float(rng.exponential(shape.think_s))
    return sorted(out, key=lambda w: w.arrival_time)


def shape_of(args: argparse.Namespace, replicas: int) -> MultiTurn:
    return MultiTurn(sessions=args.sessions_per_replica * replicas,
                     system_prompts=args.system_prompts, system_len=args.system_len,
                     turns=_pair(args.turns), user_len=_pair(args.user_len),
                     answer_len=_pair(args.answer_len), think_s=args.think_s)


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def trace_at(args: argparse.Namespace, replicas: int, load: float | None,
             unit_capacity: float | None) -> list[WorkloadRequest]:
    """The trace for `replicas` replicas at `load` x their capacity (`unit_capacity`:
    one replica's, req/s); without a load, at the rate the flags give."""
    rate = None if load is None or unit_capacity is None else load * unit_capacity * replicas
    if args.trace == "multi-turn":
        shape = shape_of(args, replicas)
        session_rate = args.session_rate if rate is None else rate / shape.mean_turns
        return multi_turn_workload(shape, session_rate, args.seed)
    if rate is None:
        return build_workload(args)
    unit = argparse.Namespace(**vars(args))
    unit.request_rate = 1.0
    unit.num_prompts = args.num_prompts * replicas
    return at_rate(build_workload(unit), rate)


def offered_rate(workload: list[WorkloadRequest]) -> float:
    """Requests per second over the span of the arrivals (a multi-turn trace reaches its
    nominal rate only once sessions overlap: starts must span several session lifetimes)."""
    times = [w.arrival_time for w in workload]
    span = max(times) - min(times)
    return len(times) / span if span > 0 else float("inf")


def replica_capacity(args: argparse.Namespace) -> float:
    """One replica's capacity for the trace (req/s), by `args.capacity`."""
    if args.capacity == "goodput":
        return goodput_capacity(args)
    return all_at_once_capacity(args)


def all_at_once_capacity(args: argparse.Namespace) -> float:
    """Requests per second one replica serves of the trace, everything queued at once."""
    flags = _flags_for(args, trace_at(args, 1, None, None))
    return capacity(flags, trace_at(flags, 1, None, None))


def attainment(args: argparse.Namespace, rate: float, slo: dict[str, float]) -> float:
    """The share of the trace's requests that meet `slo` (ms) when one replica is offered
    them at `rate` req/s (a request left unfinished misses)."""
    workload = trace_at(args, 1, 1.0, rate)
    records = run_cluster(args, 1, "round_robin", workload).records
    return sum(r.success and meets_slos(r, slo) for r in records) / len(records)


def goodput_capacity(args: argparse.Namespace, rel_tol: float = 0.02,
                     max_runs: int = 16) -> float:
    """DistServe's per-replica goodput capacity: the highest offered rate (req/s) at which
    the share of requests meeting the SLO is at least `args.capacity_attainment`, to
    within `rel_tol`, by bisection below the all-at-once capacity. A trace that meets the
    SLO even when offered at that rate is bounded by throughput, not by the SLO: its
    capacity is the all-at-once one."""
    slo = parse_goodput(args.goodput or list(DEFAULT_SLO))
    target = float(args.capacity_attainment)

    def meets(rate: float) -> bool:
        return attainment(args, rate, slo) >= target

    hi = all_at_once_capacity(args)
    if meets(hi):
        return hi
    lo, runs = hi / 2, 1
    while not meets(lo):
        if runs == max_runs:
            raise ValueError(
                f"--capacity goodput: fewer than {target:.0%} of the requests meet the SLO "
                f"{' '.join(args.goodput or DEFAULT_SLO)} even at {lo:.3g} req/s")
        hi, lo, runs = lo, lo / 2, runs + 1
    while hi / lo > 1 + rel_tol and runs < max_runs:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        runs += 1
    return lo


def _flags_for(args: argparse.Namespace, workload: list[WorkloadRequest]) -> argparse.Namespace:
    flags = argparse.Namespace(**vars(args))
    if args.trace == "multi-turn" and not args.max_model_len:
        flags.max_model_len = shape_of(args, 1).max_len
    flags.max_model_len = flags.max_model_len or max(
        w.prompt_len + (w.max_tokens or w.output_len) for w in workload)
    return flags


def run_cluster(args: argparse.Namespace, replicas: int, router: str,
                workload: list[WorkloadRequest], check_integrity: bool = False) -> ClusterResult:
    """One run of `workload` on `replicas` replicas behind `router`, with the run flags."""
    flags = _flags_for(args, workload)
    cm = cost_model_from_args(flags)
    models = [seeded_model(cm) for _ in range(replicas)]
    configs = [scheduler_config_from_args(flags, workload, cm, m) for m in models]
    cluster = Cluster(configs, list(models), cm,
                      make_router(router, replicas, args.seed, args.load_signal,
                                  cm.step_time if args.forecast_cost == "model" else None),
                      check_integrity=check_integrity)
    return cluster.run(workload)


def sweep(args: argparse.Namespace, replica_counts: Sequence[int], loads: Sequence[float],
          routers: Sequence[str]) -> list[dict[str, Any]]:
    """One summary row per (replicas, load, router)."""
    unit = replica_capacity(args)
    rows = []
    cells = [(n, load) for n in replica_counts for load in loads]
    bar = tqdm(total=len(cells) * len(routers), disable=args.disable_tqdm, unit="run")
    for n, load in cells:
        workload = trace_at(args, n, load, unit)
        for router in routers:
            bar.set_description(f"{n} x {router} @ {load:g}")
            summary = run_cluster(args, n, router, workload).summary()
            rows.append({"replicas": n, "load": load, "capacity": args.capacity,
                         "replica_capacity": unit, "offered_req_s": offered_rate(workload),
                         **summary})
            bar.update()
    bar.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows' headline numbers."""
    head = ("| replicas | load | offered req/s | router | req/s | TTFT p50 (ms) | TTFT p99 (ms) "
            "| E2E p99 (ms) | prefix hit | routed max/mean | busy max/mean |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['load']} | {r['offered_req_s']:.1f} | {r['router']} "
            f"| {r['request_throughput']:.2f} "
            f"| {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['p99_e2el_ms']:.0f} "
            f"| {r['prefix_cache_hit_rate']:.1%} | {r['routed_spread']:.2f} "
            f"| {r['busy_spread']:.2f} |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT p99 and the prefix-cache hit rate against replicas, a column per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows})
    fig, axes = plt.subplots(2, len(loads), figsize=(5 * len(loads), 7), squeeze=False)
    for col, load in enumerate(loads):
        for router in dict.fromkeys(r["router"] for r in rows):
            mine = sorted((r for r in rows if r["load"] == load and r["router"] == router),
                          key=lambda r: r["replicas"])
            xs = [r["replicas"] for r in mine]
            axes[0][col].plot(xs, [r["p99_ttft_ms"] for r in mine], marker="o", label=router)
            axes[1][col].plot(xs, [r["prefix_cache_hit_rate"] for r in mine], marker="o")
        axes[0][col].set_title(f"load {load}x capacity")
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("TTFT p99 (ms)")
        axes[1][col].set_ylabel("prefix-cache hit rate")
        axes[1][col].set_xlabel("replicas")
        axes[1][col].set_xscale("log", base=2)
        axes[0][col].set_xscale("log", base=2)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stepserve simulate cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", default=None,
                   help="replicas (default 4); with --sweep comma-separated (default 1,2,4,8)")
    c.add_argument("--router", default="round_robin",
                   help=f"comma-separated, or all: {', '.join(ROUTERS)}")
    c.add_argument("--load-signal", choices=LOAD_SIGNALS, default="requests",
                   help="what least_load and power_of_two compare: live requests or KV usage")
    c.add_argument("--forecast-cost", choices=("fit", "model"), default="fit",
                   help="predicted_ttft's step cost: each replica's online fit (what a "
                        "server has), or the simulator's cost model (a perfect fit)")
    c.add_argument("--trace", choices=TRACES, default="multi-turn")
    c.add_argument("--capacity", choices=CAPACITIES, default="goodput",
                   help="what --load is a fraction of: goodput (the highest rate at which "
                        "--capacity-attainment of one replica's requests meet --goodput), "
                        "or all-at-once (FCFS serving every request queued at once)")
    c.add_argument("--capacity-attainment", type=_share, default=0.9,
                   help="the share of requests meeting the SLO at goodput capacity")
    c.add_argument("--load", default=None,
                   help="offered load as a fraction of cluster capacity; with --sweep "
                        "comma-separated (default: the flags' rate; sweep: 0.5,0.9)")
    c.add_argument("--sweep", action="store_true",
                   help="every replicas x load x router (replicas default 1,2,4,8)")
    c.add_argument("--out-dir", default=None, help="cluster.md, cluster.json and cluster.png")
    c.add_argument("--no-plots", action="store_true")
    c.add_argument("--disable-tqdm", action="store_true")
    m = p.add_argument_group("multi-turn trace")
    m.add_argument("--sessions-per-replica", type=int, default=400,
                   help="sessions per replica (enough that, at the loads swept, session "
                        "starts span several session lifetimes)")
    m.add_argument("--session-rate", type=float, default=1.0, help="sessions/s without --load")
    m.add_argument("--system-prompts", type=int, default=4)
    m.add_argument("--system-len", type=int, default=1024)
    m.add_argument("--turns", default="2:6", help="LO:HI turns per session")
    m.add_argument("--user-len", default="32:256", help="LO:HI tokens of new user text")
    m.add_argument("--answer-len", default="32:256", help="LO:HI tokens per answer")
    m.add_argument("--think-s", type=float, default=6.0, help="mean think time past 2 s")
    p.set_defaults(num_gpu_blocks=4096)
    return p


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _routers(text: str) -> list[str]:
    names = list(ROUTERS) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in ROUTERS]
    if bad or not names:
        raise ValueError(f"--router: {', '.join(bad) or 'none given'}; choose from "
                         f"{', '.join(ROUTERS)} or all")
    return names


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    routers = _routers(args.router)
    out_dir = Path(args.out_dir) if args.out_dir else None
    plots = out_dir is not None and not args.no_plots
    if plots:
        require_plots()
    if args.sweep:
        counts = [int(x) for x in (args.replicas or "1,2,4,8").split(",")]
        loads = [float(x) for x in (args.load or "0.5,0.9").split(",")]
        rows = sweep(args, counts, loads, routers)
    else:
        n, load = int(args.replicas or 4), None if args.load is None else float(args.load)
        unit = replica_capacity(args) if load is not None else None
        workload = trace_at(args, n, load, unit)
        rows = []
        for router in tqdm(routers, disable=args.disable_tqdm or len(routers) == 1, unit="run"):
            summary = run_cluster(args, n, router, workload).summary()
            rows.append({"replicas": n, "load": load, "capacity": args.capacity,
                         "replica_capacity": unit, "offered_req_s": offered_rate(workload),
                         **summary})
    table = format_table(rows)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(table)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cluster.md").write_text(table + "\n")
        (out_dir / "cluster.json").write_text(json.dumps(rows, indent=2, default=str))
        if plots:
            plot_sweep(rows, out_dir / "cluster.png",
                       f"{args.trace}: {args.model_shape} on {args.hardware}")
    return 0 if all(r["unfinished"] == 0 for r in rows) else 1
