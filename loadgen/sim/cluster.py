"""The simulated cluster: N real `Scheduler`s (each its own KV pool and prefix cache) behind
a router (`loadgen/sim/routers.py`), on one virtual clock.

Each replica runs its own step loop, as one engine of the single-replica simulator does
(`loadgen/sim/simulator.py`: two plans in flight, the cost model's step time, the
simulated worker's tokens), but a step is split in two events::

    start(t):   plan = the plan queued; queue schedule(t) behind it; end = t + step time
    finish(end): scheduler.update_from_output(plan, sampled tokens, end)

One event queue holds every replica's next step end and the next arrival; the earliest
goes first (a step that ends when a request arrives finishes before it is routed). So a
request is routed to replicas as they stand at its arrival, mid-step: their plans made,
their outputs not yet applied, as a live router would see them. A routed request joins its
replica's waiting queue at once; an idle replica starts a step at once.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from loadgen.report import RequestRecord, summarize
from loadgen.sim.cost_model import BatchShape, CostModel
from loadgen.sim.result import KVUsage, TokenClock
from loadgen.sim.routers import Router
from loadgen.sim.simulator import SIM_EOS_ID, SIM_TOKEN_ID, scheduler_request
from loadgen.workloads import WorkloadRequest
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.step_cost_fit import OnlineStepCost


@dataclass
class Replica:
    """One engine: its scheduler, its step in flight, and what it has done."""

    index: int
    sched: Scheduler
    step_model: OnlineStepCost | None  # refitted from every step, as the engine's is
    processed: int = 0  # requests routed to it
    busy: bool = False  # a step is in flight
    end: float = 0.0  # when the step in flight ends
    plan: SchedulerOutput | None = None  # the step in flight
    queued: SchedulerOutput | None = None  # the plan after it (two in flight)
    sampled: dict[str, int] = field(default_factory=dict)  # tokens the step in flight samples
    idle_steps: int = 0  # consecutive steps that sampled nothing
    steps: int = 0
    kv: KVUsage = field(default_factory=KVUsage)
    finished: list[str] = field(default_factory=list)

    def start(self, now: float, cm: CostModel, known: dict[str, int],
              eos_at: dict[str, int]) -> None:
        if self.queued is None:
            self.queued = self.sched.schedule(now)
        self.plan, self.queued = self.queued, self.sched.schedule(now)
        batch, self.sampled = _batch_of(self.plan, known, eos_at)
        seconds = cm.step_time(batch) if (batch.num_tokens or batch.swap_blocks) else 0.0
        if seconds and self.step_model is not None:
            self.step_model.observe(batch, seconds)
        self.kv.add(self.sched.kv.usage, seconds)
        self.busy, self.end = True, now + seconds
        self.steps += 1
        self.idle_steps = 0 if self.sampled else self.idle_steps + 1

    def finish(self) -> list[RequestOutput]:
        assert self.plan is not None
        outs = self.sched.update_from_output(
            self.plan, ModelRunnerOutput(self.plan.step_id, self.sampled), self.end
        )
        self.busy, self.plan = False, None
        if not self.sched.has_unfinished_requests():
            self.queued = None  # it planned for requests that are done
        return outs


def _batch_of(plan: SchedulerOutput, known: dict[str, int],
              eos_at: dict[str, int]) -> tuple[BatchShape, dict[str, int]]:
    """The plan's cost-model shape and the tokens the simulated worker samples (as the
    single-replica simulator's `_Run.batch_of`)."""
    context = {d.req_id: d.num_computed_tokens for d in plan.scheduled_new_reqs}
    context.update((d.req_id, d.num_computed_tokens) for d in plan.scheduled_cached_reqs)
    batch, sampled = BatchShape(), {}
    for rid, n in plan.num_scheduled_tokens.items():
        ctx = context[rid]
        samples = ctx + n == known[rid]
        batch.add(n, ctx, samples)
        if samples:
            sampled[rid] = SIM_EOS_ID if eos_at.get(rid) == ctx + n else SIM_TOKEN_ID
    batch.swap_blocks = len(plan.swap_out) + len(plan.swap_in)
    return batch, sampled


@dataclass
class ClusterResult:
    """One cluster run: every request's record, where it went and each replica's share."""

    router: str
    records: list[RequestRecord]
    duration: float
    assignment: dict[str, int]  # request id -> replica
    replicas: list[Replica]
    unfinished: dict[str, str]  # request id -> why
    stop_reason: str = "done"

    def summary(self) -> dict[str, Any]:
        """The load generator's keys, the summed prefix-cache hit rate and the spread of
        load over replicas (requests routed, and busy time: the share of the run each
        replica spent in steps)."""
        out = summarize(self.records, self.duration)
        stats = [r.sched.stats() for r in self.replicas]
        queries = sum(s.prefix_cache_queries for s in stats)
        routed = [r.processed for r in self.replicas]
        busy = [r.kv.total_time for r in self.replicas]
        mean_routed, mean_busy = sum(routed) / len(routed), sum(busy) / len(busy)
        out.update(
            router=self.router,
            replicas=len(self.replicas),
            prefix_cache_hit_rate=sum(s.prefix_cache_hits for s in stats) / queries
            if queries else 0.0,
            num_preemptions=sum(s.num_preemptions for s in stats),
            routed_per_replica=routed,
            busy_s_per_replica=[round(b, 3) for b in busy],
            routed_spread=max(routed) / mean_routed if mean_routed else 1.0,
            busy_spread=max(busy) / mean_busy if mean_busy else 1.0,
            unfinished=len(self.unfinished),
            stop_reason=self.stop_reason,
        )
        return out


class Cluster:
    """Runs a workload through `num_replicas` fresh schedulers behind `router`.

    `configs[i]` is replica i's config; its `step_cost` must be `step_models[i]` (or None)
    so that each replica's forecast reads its own fit."""

    def __init__(self, configs: list[SchedulerConfig], step_models: list[OnlineStepCost | None],
                 cost_model: CostModel, router: Router, stall_steps: int | None = None,
                 check_integrity: bool = False) -> None:
        self.replicas = [Replica(i, Scheduler(c), m)
                         for i, (c, m) in enumerate(zip(configs, step_models, strict=True))]
        self.cm, self.router = cost_model, router
        self.stall_limit = stall_steps or 2 * configs[0].max_model_len + 1000
        self.check_integrity = check_integrity

    def run(self, workload: list[WorkloadRequest]) -> ClusterResult:
        arrivals = sorted(workload, key=lambda w: w.arrival_time)
        tokens = TokenClock(arrivals)
        known = {w.request_id: w.prompt_len for w in arrivals}
        eos_at = {w.request_id: w.prompt_len + w.output_len - 1 for w in arrivals
                  if w.max_tokens is not None and w.max_tokens > w.output_len}
        assignment: dict[str, int] = {}
        rejected: dict[str, str] = {}
        ends: list[tuple[float, int]] = []  # (step end, replica) of every busy replica
        now, i, reason = 0.0, 0, "done"
        while i < len(arrivals) or ends:
            due = arrivals[i].arrival_time if i < len(arrivals) else math.inf
            if ends and ends[0][0] <= due:
                now, k = heapq.heappop(ends)
                rep = self.replicas[k]
                self._finish(rep, tokens, known, now)
                if rep.idle_steps >= self.stall_limit:
                    reason = "stalled"
                    break
            else:
                w, now = arrivals[i], due
                i += 1
                req = scheduler_request(w)
                k = self.router.choose(req, self.replicas, now)
                rep = self.replicas[k]
                try:
                    rep.sched.add_request(req)
                except ValueError as exc:
                    rejected[w.request_id] = f"REJECTED ({exc})"
                    continue
                assignment[w.request_id] = k
                rep.processed += 1
                if rep.busy:
                    continue
            if rep.sched.has_unfinished_requests():
                rep.start(now, self.cm, known, eos_at)
                heapq.heappush(ends, (rep.end, rep.index))
        return self._result(arrivals, tokens, assignment, rejected, now, reason)

    def _finish(self, rep: Replica, tokens: TokenClock, known: dict[str, int],
                now: float) -> None:
        for out in rep.finish():
            if out.new_token_ids:
                known[out.req_id] += len(out.new_token_ids)
                tokens.tokens(out.req_id, len(out.new_token_ids), now)
            if out.finished:
                if out.req_id in tokens.finish:
                    raise RuntimeError(f"request {out.req_id} finished twice")
                tokens.finished(out.req_id, now)
                rep.finished.append(out.req_id)
        if self.check_integrity:
            rep.sched.check_integrity()

    def _result(self, arrivals: list[WorkloadRequest], tokens: TokenClock,
                assignment: dict[str, int], rejected: dict[str, str], now: float,
                reason: str) -> ClusterResult:
        unfinished = dict(rejected)
        for rep in self.replicas:
            unfinished.update((rid, r.status.name) for rid, r in rep.sched.requests.items())
        routed = set(assignment) | set(rejected)
        unfinished.update((w.request_id, "NOT_ARRIVED") for w in arrivals
                          if w.request_id not in routed)
        records = [tokens.record(w.request_id, unfinished.get(w.request_id)) for w in arrivals]
        return ClusterResult(self.router.name, records, now, assignment, self.replicas,
                             unfinished, reason)
