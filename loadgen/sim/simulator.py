"""The virtual-clock simulator: drives the real `scheduler.Scheduler`, one plan at a time.

No threads and no sleeping. Each iteration::

    add every arrival with arrival_time <= clock
    plan  = scheduler.schedule(clock)
    clock += cost_model.step_time(plan's batch)          # the step "runs"
    scheduler.update_from_output(plan, sampled tokens, clock)

and when nothing is left to run the clock jumps to the next arrival. The simulated worker
samples a token for a request exactly when the worker would: when the scheduled chunk
reaches the end of the request's known tokens (context + n == prompt + outputs so far;
with one plan in flight nothing is ever sampled-but-unreceived). Outputs are exact
lengths: `SamplingParams(max_tokens=output_len, ignore_eos=True)`.

Every request ends finished or is reported unfinished with its state: a run stops early
on `max_steps`, `max_time` (virtual seconds) or a stall (no token for a long while).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loadgen.sim.cost_model import BatchShape, CostModel
from loadgen.sim.result import KVUsage, SimResult, TimelinePoint, TokenClock
from loadgen.workloads import WorkloadRequest
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.step_fit import OnlineStepCost

SIM_TOKEN_ID = 1  # every simulated output token; never a stop token (ignore_eos, no stop ids)


@dataclass(frozen=True)
class SimLimits:
    """Guards so a run always ends; None means no limit."""

    max_steps: int | None = None
    max_time: float | None = None  # virtual seconds
    stall_steps: int | None = None  # steps without a sampled token; None: 2 * max_model_len + 1000


def scheduler_request(w: WorkloadRequest) -> Request:
    """The scheduler's view of a workload request; token ids are synthesised if absent."""
    ids = w.prompt_token_ids if w.prompt_token_ids is not None else [SIM_TOKEN_ID + 1] * w.prompt_len
    params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, priority=w.priority)
    return Request(request_id=w.request_id, prompt_token_ids=list(ids), sampling_params=params,
                   arrival_time=w.arrival_time)


class Simulator:
    """Runs a workload through a fresh `Scheduler` on a virtual clock."""

    def __init__(self, config: SchedulerConfig, cost_model: CostModel, limits: SimLimits | None = None,
                 record_timeline: bool = False, check_integrity: bool = False, overlap: bool = True,
                 step_model: OnlineStepCost | None = None) -> None:
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
        self.check_integrity = check_integrity
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
        self.requests: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}
        self.queued: SchedulerOutput | None = None  # with overlap: the plan that runs next
        self.now, self.steps, self.idle_steps = 0.0, 0, 0
        self.kv = KVUsage()
        self.timeline: list[TimelinePoint] = []
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
                sampled[rid] = SIM_TOKEN_ID
        batch.swap_blocks = len(plan.swap_out) + len(plan.swap_in)
        return batch, sampled

    def step(self) -> None:
        if self.sim.overlap:
            if self.queued is None:  # the engine primes two plans at once
                self.queued = self.sched.schedule(self.now)
            plan, self.queued = self.queued, self.sched.schedule(self.now)
        else:
            plan = self.sched.schedule(self.now)
        batch, sampled = self.batch_of(plan)
        seconds = self.sim.cost_model.step_time(batch) if (batch.num_tokens or batch.swap_blocks) else 0.0
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
        outs = self.sched.update_from_output(plan, ModelRunnerOutput(plan.step_id, sampled), self.now)
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
        unfinished.update((rid, r.status.name) for rid, r in self.requests.items() if not r.is_finished)
        unfinished.update((w.request_id, "NOT_ARRIVED") for w in self.pending)
        records = [self.tokens.record(rid, unfinished.get(rid)) for rid in self.tokens.requests]
        stats = self.sched.stats()
        return SimResult("continuous", records, self.now, self.steps, stats.num_preemptions,
                         stats.num_swap_preemptions, unfinished, self.kv.mean, self.kv.max,
                         reason, self.timeline, self.kv.total_time, self.kv.busy_steps)
