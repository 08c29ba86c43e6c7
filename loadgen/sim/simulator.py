"""The virtual-clock simulator: drives the real `scheduler.Scheduler` as the engine does.

No threads and no sleeping. Each iteration::

    add every arrival with arrival_time <= clock
    plan  = the plan queued last iteration; queue scheduler.schedule(clock) behind it
    clock += cost_model.step_time(plan's batch)          # the step "runs"
    scheduler.update_from_output(plan, sampled tokens, clock)

With overlap (the default, as in the engine) two plans are in flight: step N+1 is planned
before step N's output is applied, so a request can count a sampled-but-unreceived token
(a placeholder) and a request that finishes in step N may still be in plan N+1, whose
token is discarded. `overlap=False` plans one step at a time. When nothing is left to run
the clock jumps to the next arrival. The simulated worker samples a token for a request
exactly when the worker would: when the scheduled chunk reaches the end of the request's
known tokens (context + n == prompt + outputs applied before that step runs, as the worker
knows them). Outputs are exact lengths: `SamplingParams(max_tokens=output_len, ignore_eos=True)`,
or, for a request that declares a larger `max_tokens`, the simulated worker samples EOS as
its output_len-th token. A workload request's `user` is its tenant.

Every request ends finished or is reported unfinished with its state: a run stops early
on `max_steps`, `max_time` (virtual seconds) or a stall (no token for a long while).
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass

from loadgen.sim.cost_model import BatchShape, CostModel
from loadgen.sim.result import (
    KVUsage,
    RequestStat,
    ServicePoint,
    SimResult,
    TimelinePoint,
    TokenClock,
)
from loadgen.workloads import WorkloadRequest
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.step_cost_fit import OnlineStepCost
from scheduler.step_records import Record, StepRecorder, scheduler_hello

SIM_TOKEN_ID = 1  # every simulated output token but a request's EOS
SIM_EOS_ID = 0  # the last token of a request that stops before its declared max_tokens


@dataclass(frozen=True)
class SimLimits:
    """Guards so a run always ends; None means no limit."""

    max_steps: int | None = None
    max_time: float | None = None  # virtual seconds
    stall_steps: int | None = None  # steps without a sampled token; None: 2 * max_model_len + 1000


def scheduler_request(w: WorkloadRequest) -> Request:
    """The scheduler's view of a workload request. Token ids are synthesised if absent, with
    a first token of the request's own, so that no two synthetic prompts share a prefix (the
    prefix cache finds only what a workload shares on purpose, as `shared-prefix` does)."""
    ids = w.prompt_token_ids
    if ids is None:
        ids = [SIM_TOKEN_ID + 2 + zlib.crc32(w.request_id.encode())] + [SIM_TOKEN_ID + 1] * (
            w.prompt_len - 1
        )
    params = SamplingParams(
        max_tokens=w.max_tokens or w.output_len,
        ignore_eos=w.max_tokens is None,
        priority=w.priority,
    )
    req = Request(request_id=w.request_id, prompt_token_ids=list(ids), sampling_params=params,
                  arrival_time=w.arrival_time, eos_token_ids=(SIM_EOS_ID,))
    if w.user:
        req.tenant = w.user
    return req


class Simulator:
    """Runs a workload through a fresh `Scheduler` on a virtual clock."""

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: CostModel,
        limits: SimLimits | None = None,
        record_timeline: bool = False,
        check_integrity: bool = False,
        overlap: bool = True,
        record_service: bool = False,
        record_steps: bool = False,
        step_model: OnlineStepCost | None = None,
    ) -> None:
        """`overlap`: plan step N+1 when step N starts, before N's output is applied, as the
        engine does (two plans in flight); a request arriving during step N then first runs
        in step N+2. Off: each plan is made after the previous output (one in flight).
        `step_model`: the online step-cost model the config's scheduler calls; each step's
        simulated time refits it, as the engine refits it from measured times."""
        self.overlap = overlap
        self.config = config
        self.cost_model = cost_model
        self.limits = limits or SimLimits()
        self.record_timeline = record_timeline
        self.record_service = record_service  # per-step service per tenant (fairness metrics)
        self.check_integrity = check_integrity
        self.record_steps = record_steps  # step records for a timeline file (loadgen.sim.timeline)
        self.step_model = step_model

    def run(self, workload: list[WorkloadRequest]) -> SimResult:
        return _Run(self, workload).run()


class _Run:
    """The mutable state of one simulation."""

    def __init__(self, sim: Simulator, workload: list[WorkloadRequest]) -> None:
        self.sim = sim
        self.sched = Scheduler(sim.config)
        self.pending = deque(sorted(workload, key=lambda w: w.arrival_time))
        self.tokens = TokenClock(workload)
        self.known = {w.request_id: w.prompt_len for w in workload}  # tokens the worker knows
        # the known-token count at which a request samples EOS (absent: never)
        self.eos_at = {w.request_id: w.prompt_len + w.output_len - 1 for w in workload
                       if w.max_tokens is not None and w.max_tokens > w.output_len}
        self.tenant_service: list[ServicePoint] = []
        self.requests: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}
        self.queued: SchedulerOutput | None = None  # with overlap: the plan that runs next
        self.now, self.steps, self.idle_steps = 0.0, 0, 0
        self.kv = KVUsage()
        self.timeline: list[TimelinePoint] = []
        self.recorder = StepRecorder(self.sched) if sim.record_steps else None
        self.step_records: list[Record] = []
        lim = sim.limits
        self.stall_limit = lim.stall_steps or 2 * sim.config.max_model_len + 1000

    def admit_arrivals(self) -> None:
        while self.pending and self.pending[0].arrival_time <= self.now:
            w = self.pending.popleft()
            req = scheduler_request(w)
            try:
                self.sched.add_request(req)
            except ValueError as exc:
                self.rejected[w.request_id] = f"REJECTED ({exc})"
                continue
            self.requests[w.request_id] = req

    def batch_of(self, plan: SchedulerOutput) -> tuple[BatchShape, dict[str, int]]:
        """The plan's cost-model shape and the tokens the simulated worker samples."""
        context = {d.req_id: d.num_computed_tokens for d in plan.scheduled_new_reqs}
        context.update((d.req_id, d.num_computed_tokens) for d in plan.scheduled_cached_reqs)
        batch, sampled = BatchShape(), {}
        for rid, n in plan.num_scheduled_tokens.items():
            ctx = context[rid]
            samples = ctx + n == self.known[rid]
            batch.add(n, ctx, samples)
            if samples:
                sampled[rid] = SIM_EOS_ID if self.eos_at.get(rid) == ctx + n else SIM_TOKEN_ID
        batch.swap_blocks = len(plan.swap_out) + len(plan.swap_in)
        return batch, sampled

    def schedule(self) -> SchedulerOutput:
        plan = self.sched.schedule(self.now)
        if self.recorder is not None:
            self.recorder.on_plan(plan, self.now)
        return plan

    def step(self) -> None:
        if self.sim.overlap:
            if self.queued is None:  # the engine primes two plans at once
                self.queued = self.schedule()
            plan, self.queued = self.queued, self.schedule()
        else:
            plan = self.schedule()
        batch, sampled = self.batch_of(plan)
        seconds = (
            self.sim.cost_model.step_time(batch) if (batch.num_tokens or batch.swap_blocks) else 0.0
        )
        if seconds and self.sim.step_model is not None:
            self.sim.step_model.observe(batch, seconds)
        stats = self.sched.stats()
        self.now += seconds
        self.steps += 1
        self.kv.add(stats.kv_cache_usage, seconds)
        if self.sim.record_timeline:
            used = stats.num_gpu_blocks - stats.num_free_blocks
            self.timeline.append(TimelinePoint(self.now, stats.num_running, stats.num_waiting,
                                               stats.num_swapped, used, batch.num_prefill_tokens,
                                               batch.num_decode_tokens))
        outs = self.sched.update_from_output(
            plan, ModelRunnerOutput(plan.step_id, sampled), self.now
        )
        if self.sim.record_service:
            self.tenant_service.append(
                ServicePoint(
                    self.now,
                    dict(self.sched.fairness_meter.served),
                    frozenset(r.tenant for r in self.sched.waiting),
                )
            )
        if self.recorder is not None and (
            rec := self.recorder.on_output(plan, outs, self.now, seconds)
        ):
            self.step_records.append(rec)
        for out in outs:
            if out.new_token_ids:
                self.known[out.req_id] += len(out.new_token_ids)
                self.tokens.tokens(out.req_id, len(out.new_token_ids), self.now)
            if out.finished:
                self.tokens.finished(out.req_id, self.now)
        self.idle_steps = 0 if sampled else self.idle_steps + 1
        if not seconds and self.pending and (self.queued is None or self.queued.is_empty):
            self.now = max(self.now, self.pending[0].arrival_time)  # stuck until someone arrives
        if self.sim.check_integrity:
            self.sched.check_integrity()

    def stop_reason(self) -> str | None:
        """Why the run must end now, or None to keep going."""
        lim = self.sim.limits
        if not self.pending and not self.sched.has_unfinished_requests():
            return "done"
        if lim.max_steps is not None and self.steps >= lim.max_steps:
            return "max_steps"
        if lim.max_time is not None and self.now >= lim.max_time:
            return "max_time"
        if self.idle_steps >= self.stall_limit:
            return "stalled"
        return None

    def run(self) -> SimResult:
        while (reason := self.stop_reason()) is None:
            self.admit_arrivals()
            if not self.sched.has_unfinished_requests():
                self.queued = None  # whatever it held was for requests that are done
                if self.pending:
                    self.now = max(self.now, self.pending[0].arrival_time)
                continue
            self.step()
        return self.result(reason)

    def result(self, reason: str) -> SimResult:
        unfinished = dict(self.rejected)
        unfinished.update(
            (rid, r.status.name) for rid, r in self.requests.items() if not r.is_finished
        )
        unfinished.update((w.request_id, "NOT_ARRIVED") for w in self.pending)
        records = [self.tokens.record(rid, unfinished.get(rid)) for rid in self.tokens.requests]
        stats = self.sched.stats()
        hello = (
            scheduler_hello(self.sched, strategy="continuous", source="simulator")
            if self.recorder
            else None
        )
        result = SimResult("continuous", records, self.now, self.steps, stats.num_preemptions,
                           stats.num_swap_preemptions, unfinished, self.kv.mean, self.kv.max,
                           reason, self.timeline, self.kv.total_time, self.kv.busy_steps,
                           step_hello=hello, step_records=self.step_records)
        result.num_recompute_tokens = stats.num_recompute_tokens
        result.request_stats = [RequestStat.of(r) for r in self.requests.values()]
        result.tenant_service = self.tenant_service
        return result
