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

Objectives: a workload request's `slo_ttft_ms` / `slo_tpot_ms` become its `Request.slo`
(the scheduler fills what it leaves open from its classes). With `reject_unmeetable` each
arrival first goes through `Scheduler.admission_check`, as the server's HTTP layer does: a
refused request's client sends it again after the Retry-After, as the server's header
states it (whole seconds, rounded up, at least 1: `service/engine/stream.py`), at most
`max_retries` times, then gives up. Refusals spread over the run (at most one every
`retry_after_every` virtual seconds) are re-simulated from the moment of the refusal to
find the wait that would actually have sufficed (`Refusal.actual_wait`; docs/simulator.md,
"Refusals and Retry-After").

Every request ends finished or is reported unfinished with its state: a run stops early
on `max_steps`, `max_time` (virtual seconds) or a stall (no token for a long while). A
request whose client gave up after refusals is a failed record, not an unfinished one.
"""

from __future__ import annotations

import copy
import heapq
import io
import math
import pickle
import types
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loadgen.sim.cost_model import BatchShape, CostModel
from loadgen.sim.result import (
    KVUsage,
    Refusal,
    RequestStat,
    ServicePoint,
    SimResult,
    TimelinePoint,
    TokenClock,
)
from loadgen.workloads import WorkloadRequest
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.queues import WaitingQueue
from scheduler.request import Request
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.slo import SLO
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


DEFAULT_MAX_RETRIES = 3  # a refused client's retries before it gives up
PROBE = -1  # the attempt number of a re-simulation's probe: never refused
# Re-simulating a refusal: resolution of the wait found (seconds, share of it) and how far
# past the predicted wait to look before calling it unmeetable.
PROBE_TOLERANCE_S = 0.02
PROBE_TOLERANCE = 0.05
PROBE_HORIZON_S = 120.0


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def scheduler_request(w: WorkloadRequest, arrival: float | None = None) -> Request:
    """The scheduler's view of a workload request (arriving at `arrival`, default its own
    arrival time: a retry arrives later). Token ids are synthesised if absent, with
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
                  arrival_time=w.arrival_time if arrival is None else arrival,
                  eos_token_ids=(SIM_EOS_ID,))
    if w.user:
        req.tenant = w.user
    if w.slo_ttft_ms is not None or w.slo_tpot_ms is not None:
        req.slo = SLO(_ms_to_s(w.slo_ttft_ms), _ms_to_s(w.slo_tpot_ms))
    return req


class _Arrivals:
    """Sends still to come, in time order: the workload's, and refused clients' retries.
    Each is (time, tie-break, request, attempt): attempt 0 is the first send."""

    def __init__(self, workload: list[WorkloadRequest]) -> None:
        ordered = sorted(workload, key=lambda w: w.arrival_time)
        self._heap = [(w.arrival_time, i, w, 0) for i, w in enumerate(ordered)]
        self._seq = len(ordered)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return (w for _, _, w, _ in self._heap)

    def next_time(self) -> float:
        return self._heap[0][0]

    def push(self, when: float, w: WorkloadRequest, attempt: int) -> None:
        heapq.heappush(self._heap, (when, self._seq, w, attempt))
        self._seq += 1

    def pop_due(self, now: float) -> tuple[float, WorkloadRequest, int] | None:
        """The next send at or before `now`, if any."""
        if not self._heap or self._heap[0][0] > now:
            return None
        when, _, w, attempt = heapq.heappop(self._heap)
        return when, w, attempt

    def copy(self) -> _Arrivals:
        out = copy.copy(self)
        out._heap = list(self._heap)
        return out


# Waiting queues that key their requests by id() (scheduler/queues.py, scheduler/fairness.py):
# a copied queue must see its copies' ids.
_ID_KEYED = ("_live", "_removed", "_order")
_SHARED: dict[int, Any] = {}  # functions a fork shares with its original, while it is made


def _shared(key: int) -> Any:
    return _SHARED[key]


class _ForkPickler(pickle.Pickler):
    """Copies the scheduler's state at C speed; functions (the queues' and the scheduler's
    closures over the step-cost model) are shared, as `copy.deepcopy` would share them, and
    so is each object in `share` (what no run changes)."""

    def __init__(self, file: io.BytesIO, share: tuple[object, ...]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.share = {id(x) for x in share}

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, types.FunctionType) and obj is not _shared) or id(obj) in self.share:
            _SHARED[id(obj)] = obj
            return _shared, (id(obj),)
        return NotImplemented


def _copy(obj: Any, share: tuple[object, ...] = ()) -> Any:
    buf = io.BytesIO()
    try:
        _ForkPickler(buf, share).dump(obj)
        return pickle.loads(buf.getvalue())
    finally:
        _SHARED.clear()


def _pair_requests(a: Any, b: Any, out: dict[int, Request], depth: int = 0) -> None:
    """Map id(request in `a`) -> the request at the same place in its copy `b`."""
    if isinstance(a, Request):
        out[id(a)] = b
    elif depth > 4:
        return
    elif isinstance(a, list | tuple | deque):
        for x, y in zip(a, b, strict=True):
            _pair_requests(x, y, out, depth + 1)
    elif isinstance(a, dict):
        for key, value in a.items():
            _pair_requests(value, b[key], out, depth + 1)
    elif depth == 0:
        for name, value in vars(a).items():
            _pair_requests(value, getattr(b, name), out, depth + 1)


def _remap_ids(original: WaitingQueue, queue: WaitingQueue) -> None:
    pairs: dict[int, Request] = {}
    _pair_requests(original, queue, pairs)
    new_id = {old: id(new) for old, new in pairs.items()}
    for name in _ID_KEYED:
        table = getattr(queue, name, None)
        if isinstance(table, dict):
            setattr(queue, name, {new_id[k]: v for k, v in table.items() if k in new_id})
        elif isinstance(table, set):
            setattr(queue, name, {new_id[k] for k in table if k in new_id})
    if sum(1 for _ in queue) != len(queue):
        raise RuntimeError(f"a copied {type(queue).__name__} lost track of its requests")


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
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_after_every: float | None = None,
        whole_second_retry: bool = True,
    ) -> None:
        """`overlap`: plan step N+1 when step N starts, before N's output is applied, as the
        engine does (two plans in flight); a request arriving during step N then first runs
        in step N+2. Off: each plan is made after the previous output (one in flight).
        `step_model`: the online step-cost model the config's scheduler calls; each step's
        simulated time refits it, as the engine refits it from measured times.
        With `config.reject_unmeetable`: a refused client retries after the Retry-After (as
        the header states it with `whole_second_retry`, else the scheduler's exact seconds) at
        most `max_retries` times; a refusal at least `retry_after_every` virtual seconds after
        the last one measured has its actual wait measured by re-simulation (None: none; 0:
        every one; each costs a dozen short simulations)."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if retry_after_every is not None and not retry_after_every >= 0:
            raise ValueError(f"retry_after_every must be >= 0 s, got {retry_after_every}")
        self.max_retries = max_retries
        self.retry_after_every = retry_after_every
        self.whole_second_retry = whole_second_retry
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
        self.pending = _Arrivals(workload)
        self.tokens = TokenClock(workload)
        self.known = {w.request_id: w.prompt_len for w in workload}  # tokens the worker knows
        # the known-token count at which a request samples EOS (absent: never)
        self.eos_at = {w.request_id: w.prompt_len + w.output_len - 1 for w in workload
                       if w.max_tokens is not None and w.max_tokens > w.output_len}
        self.tenant_service: list[ServicePoint] = []
        self.requests: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}
        self.refusals: list[Refusal] = []
        self.retries: dict[str, int] = {}  # request id -> refusals before it was admitted
        self.gave_up: dict[str, RequestStat] = {}
        self.measure_every = sim.retry_after_every  # None: measure no refusal
        self.last_measured = -math.inf
        self.probe: str | None = None  # a re-simulation: the probe's id
        self.probe_first_token: float | None = None
        self.queued: SchedulerOutput | None = None  # with overlap: the plan that runs next
        self.now, self.steps, self.idle_steps = 0.0, 0, 0
        self.kv = KVUsage()
        self.timeline: list[TimelinePoint] = []
        self.recorder = StepRecorder(self.sched) if sim.record_steps else None
        self.step_records: list[Record] = []
        lim = sim.limits
        self.stall_limit = lim.stall_steps or 2 * sim.config.max_model_len + 1000

    def admit_arrivals(self) -> None:
        while (due := self.pending.pop_due(self.now)) is not None:
            when, w, attempt = due
            req = scheduler_request(w, when)
            if self.sim.config.reject_unmeetable and attempt != PROBE:
                # As the server's HTTP layer does on arrival, with the scheduler as it stands
                wait = self.sched.admission_check(req, when)
                if wait is not None:
                    self.refuse(w, req, attempt, when, wait)
                    continue
                # Admit the request as the client sent it (the check resolved its
                # objectives in place), with the forecast the check made.
                checked, req = req, scheduler_request(w, when)
                req.predicted_ttft = checked.predicted_ttft
            try:
                self.sched.add_request(req)
            except ValueError as exc:
                self.rejected[w.request_id] = f"REJECTED ({exc})"
                continue
            self.requests[w.request_id] = req
            if attempt > 0:
                self.retries[w.request_id] = attempt

    def refuse(self, w: WorkloadRequest, req: Request, attempt: int, when: float,
               wait: float) -> None:
        """The admission check refused `req` (the 429): its client retries after `wait`
        seconds, or gives up when its retries are spent."""
        retried = attempt < self.sim.max_retries
        actual = None
        every = self.measure_every
        if every is not None and when >= self.last_measured + every:
            assert req.slo.ttft_s is not None  # only a TTFT objective is refused
            self.last_measured = when
            actual = self.actual_wait(w, when, wait, req.slo.ttft_s)
        header = retry_after_header(wait)
        self.refusals.append(Refusal(w.request_id, req.tenant, req.slo, attempt, when, wait,
                                     header, req.predicted_ttft, retried, actual))
        if retried:
            self.pending.push(when + (header if self.sim.whole_second_retry else wait), w,
                              attempt + 1)
        else:
            self.gave_up[w.request_id] = RequestStat.of(req, w.arrival_time, attempt)

    # ---- re-simulating a refusal --------------------------------------------------------
    def actual_wait(self, w: WorkloadRequest, when: float, predicted: float,
                    ttft: float) -> float:
        """The shortest wait d after which `w`, sent again at `when + d` and admitted
        without a check, gets its first token within `ttft` of being sent, with everyone
        else behaving as in this run (refused, retrying); by bisection on d, taking the
        outcome to be monotone in d. 0: it would have met it had it been admitted;
        math.inf: not by `PROBE_HORIZON_S` (or 8x the predicted wait, if more)."""
        probe = _WaitProbe(self, w, when, ttft)
        if probe.met(0.0):
            return 0.0
        horizon = max(PROBE_HORIZON_S, 8 * predicted)
        lo, hi = 0.0, max(predicted, PROBE_TOLERANCE_S)
        while not probe.met(hi):
            lo, hi = hi, 2 * hi
            if lo > horizon:
                return math.inf
        while hi - lo > max(PROBE_TOLERANCE_S, PROBE_TOLERANCE * hi):
            mid = (lo + hi) / 2
            if probe.met(mid):
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    def advance(self, until: float) -> None:
        """Run on until the clock reaches `until`: the next iteration would admit what was
        sent by then (and nothing has been admitted that was sent later)."""
        while self.now < until and self.stop_reason() is None:
            self.admit_arrivals()
            if not self.sched.has_unfinished_requests():
                self.queued = None
                nxt = self.pending.next_time() if self.pending else until
                self.now = max(self.now, min(nxt, until))
                continue
            self.step()

    def fork(self) -> _Run:
        """A copy of this run's scheduling state that can run on without touching it:
        no records, timelines or measurements of its own."""
        sim = copy.copy(self.sim)
        sim.record_timeline = sim.record_service = sim.record_steps = False
        sim.check_integrity = False
        # the scheduler's step-cost model changes only where it is the one the run refits
        cost = self.sched.config.step_cost
        fixed = (cost,) if cost is not None and cost is not self.sim.step_model else ()
        sched, queued, sim.step_model = _copy(
            (self.sched, self.queued, self.sim.step_model), fixed
        )
        _remap_ids(self.sched.waiting, sched.waiting)
        out = copy.copy(self)
        out.sim, out.sched, out.queued = sim, sched, queued
        out.pending = self.pending.copy()
        out.tokens = TokenClock([])
        out.known, out.eos_at = dict(self.known), self.eos_at
        out.requests, out.rejected, out.retries = {}, {}, {}
        out.refusals, out.gave_up = [], {}
        out.measure_every = None
        out.kv = KVUsage()
        out.timeline, out.tenant_service, out.step_records = [], [], []
        out.recorder = None
        out.probe, out.probe_first_token = None, None
        return out

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
                if out.req_id == self.probe and self.probe_first_token is None:
                    self.probe_first_token = self.now
                self.known[out.req_id] += len(out.new_token_ids)
                self.tokens.tokens(out.req_id, len(out.new_token_ids), self.now)
            if out.finished:
                self.tokens.finished(out.req_id, self.now)
        self.idle_steps = 0 if sampled else self.idle_steps + 1
        if not seconds and self.pending and (self.queued is None or self.queued.is_empty):
            self.now = max(self.now, self.pending.next_time())  # stuck until someone arrives
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
                    self.now = max(self.now, self.pending.next_time())
                continue
            self.step()
        return self.result(reason)

    def result(self, reason: str) -> SimResult:
        unfinished = dict(self.rejected)
        unfinished.update(
            (rid, r.status.name) for rid, r in self.requests.items() if not r.is_finished
        )
        unfinished.update((w.request_id, "NOT_ARRIVED") for w in self.pending)
        refused = {rid: f"refused: TTFT objective unmeetable; gave up after {s.retries} "
                        f"retries" for rid, s in self.gave_up.items()}
        records = [self.tokens.record(rid, unfinished.get(rid), refused.get(rid))
                   for rid in self.tokens.requests]
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
        sent = {rid: w.arrival_time for rid, w in self.tokens.requests.items()}
        result.request_stats = [
            RequestStat.of(r, sent[rid] if rid in self.retries else None,
                           self.retries.get(rid, 0))
            for rid, r in self.requests.items()
        ]
        result.tenant_service = self.tenant_service
        result.refusals = self.refusals
        result.gave_up = self.gave_up
        return result


class _WaitProbe:
    """Re-simulations of one refused request sent again after different waits. The run
    before the request is sent again does not depend on when that will be, so each
    re-simulation starts from the latest state kept at or before its send time, and keeps
    the state it reaches there for the next."""

    def __init__(self, run: _Run, w: WorkloadRequest, when: float, ttft: float) -> None:
        self.w, self.when, self.ttft = w, when, ttft
        self.kept = [run.fork()]  # states without the request, by time

    def met(self, delay: float) -> bool:
        """Sent again `delay` after the refusal: does its first token come within its TTFT
        objective?"""
        send = self.when + delay
        base = max((k for k in self.kept if k.now <= send), key=lambda k: k.now,
                   default=self.kept[0])
        fork = base.fork()
        if fork.now < send:
            fork.advance(send)
            self.kept.append(fork.fork())
        fork.probe = self.w.request_id
        fork.pending.push(send, self.w, PROBE)
        deadline = send + self.ttft
        while fork.probe_first_token is None:
            if fork.now >= deadline or fork.stop_reason() is not None:
                return False
            fork.admit_arrivals()
            if not fork.sched.has_unfinished_requests():
                fork.queued = None
                if fork.pending:
                    fork.now = max(fork.now, fork.pending.next_time())
                continue
            fork.step()
        return fork.probe_first_token <= deadline


def retry_after_header(seconds: float) -> int:
    """A wait as the server's `Retry-After` states it: whole seconds, rounded up, at least 1
    (the rule of `service.engine.stream.whole_seconds`)."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


