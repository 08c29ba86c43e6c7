"""What a simulated run produces, whatever the batching strategy: per-request token times,
a per-step timeline, and a summary under the load generator's key names plus the
simulator's own (`num_preemptions`, `unfinished`, KV utilisation).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from loadgen.report import RequestRecord, summarize
from loadgen.workloads import WorkloadRequest
from scheduler.request import Request
from scheduler.slo import NO_SLO, SLO


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """The state during one step, stamped with the time the step ended."""

    time: float
    running: int
    waiting: int
    swapped: int
    kv_blocks_used: int
    prefill_tokens: int
    decode_tokens: int


@dataclass(frozen=True, slots=True)
class RequestStat:
    """What the scheduler knew of one request: who, when it first ran, what was predicted."""

    request_id: str
    tenant: str
    arrival_time: float
    first_scheduled_time: float | None
    prompt_len: int
    output_len: int  # tokens it generated
    predicted_output: int | None
    num_preemptions: int
    # Objectives (as the scheduler resolved them) and what was forecast and happened. The
    # arrival above is the admitted attempt's; `sent_time` is the client's first send
    # (earlier when refusals made it retry, `retries` times).
    slo: SLO = NO_SLO
    predicted_ttft: float | None = None  # seconds from the admitted attempt's arrival
    first_token_time: float | None = None
    finished_time: float | None = None
    sent_time: float | None = None  # None: the arrival above
    retries: int = 0

    @classmethod
    def of(cls, req: Request, sent_time: float | None = None, retries: int = 0) -> RequestStat:
        m = req.metrics
        return cls(req.request_id, req.tenant, req.arrival_time, m.first_scheduled_time,
                   req.num_prompt_tokens, req.num_output_tokens, req.predicted_output_tokens,
                   m.num_preemptions, req.slo, req.predicted_ttft, m.first_token_time,
                   m.finished_time, sent_time, retries)

    @property
    def sent(self) -> float:
        """When the client first sent it."""
        return self.arrival_time if self.sent_time is None else self.sent_time


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refusal by the admission check (`--reject-unmeetable`): the server's 429 with
    Retry-After. `actual_wait`, when measured (`Simulator(retry_after_every=...)`), is the
    shortest wait after which the same request, sent again, would have met its TTFT
    objective, found by re-simulating from the moment of the refusal
    (docs/simulator.md, "Refusals and Retry-After"); math.inf: not within the horizon."""

    request_id: str
    tenant: str
    slo: SLO
    attempt: int  # 0: the first send; k: the k-th retry
    time: float  # when it was refused (that attempt's arrival)
    retry_after: float  # the predicted wait, seconds (the scheduler's)
    retry_after_header: int  # as the server's Retry-After header states it (whole seconds)
    predicted_ttft: float | None  # the forecast behind it, seconds from `time`
    retried: bool  # False: the client gave up (its retries were spent)
    actual_wait: float | None = None


@dataclass(frozen=True, slots=True)
class ServicePoint:
    """Weighted tokens served per tenant so far, and the tenants with requests waiting, at
    the end of one step (see scheduler/fairness.py for what counts as service)."""

    time: float
    served: dict[str, float]
    backlogged: frozenset[str]


class TokenClock:
    """When each request received each of its tokens (virtual seconds)."""

    def __init__(self, workload: list[WorkloadRequest]) -> None:
        self.requests = {w.request_id: w for w in workload}
        self.times: dict[str, array[float]] = {}
        self.finish: dict[str, float] = {}

    def tokens(self, request_id: str, count: int, now: float) -> None:
        """`count` tokens of `request_id` became visible to the client at `now`."""
        times = self.times.get(request_id)
        if times is None:
            times = self.times[request_id] = array("d")
        times.extend([now] * count)

    def finished(self, request_id: str, now: float) -> None:
        self.finish[request_id] = now

    def record(
        self, request_id: str, unfinished_state: str | None = None, error: str | None = None
    ) -> RequestRecord:
        """The client's view of one request; an unfinished one is a failure with its state,
        a refused one (`error`) a failure with that message."""
        w = self.requests[request_id]
        times = self.times.get(request_id, array("d"))
        done = request_id in self.finish and unfinished_state is None and error is None
        rec = RequestRecord(
            request_id=request_id,
            success=done,
            prompt_tokens=w.prompt_len,
            output_tokens=len(times),
            start_time=w.arrival_time,
            priority=w.priority,
            arrival_time=w.arrival_time,
            group=w.group,
            user=w.user,
        )
        if not done:
            rec.error = error or f"unfinished: {unfinished_state or 'UNKNOWN'}"
            return rec
        if times:
            rec.ttft = times[0] - w.arrival_time
            rec.itls = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
        rec.e2el = self.finish[request_id] - w.arrival_time
        return rec


@dataclass
class SimResult:
    """One simulated run."""

    strategy: str
    records: list[RequestRecord]
    duration: float  # virtual seconds from time 0 to the end of the last step
    num_steps: int
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    unfinished: dict[str, str] = field(default_factory=dict)  # request id -> state
    mean_kv_cache_usage: float = 0.0  # step-duration weighted
    max_kv_cache_usage: float = 0.0
    stop_reason: str = "done"  # "done" | "max_steps" | "max_time" | "stalled"
    timeline: list[TimelinePoint] = field(default_factory=list)
    busy_time: float = 0.0  # virtual seconds spent in steps that computed something
    num_busy_steps: int = 0  # steps that took time (what a live engine's step histogram counts)
    num_recompute_tokens: int = 0  # computed tokens dropped by recompute preemptions
    request_stats: list[RequestStat] = field(default_factory=list)  # continuous batching only
    # --reject-unmeetable: every refusal, and the requests whose client gave up after its
    # retries (request id -> the objectives it was refused under)
    refusals: list[Refusal] = field(default_factory=list)
    gave_up: dict[str, RequestStat] = field(default_factory=dict)
    tenant_service: list[ServicePoint] = field(default_factory=list)  # with record_service
    # with record_steps: the run's step records (`scheduler.step_records`) and their hello
    step_hello: dict[str, Any] | None = None
    step_records: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, goodput: dict[str, float] | None = None) -> dict[str, Any]:
        """`loadgen.report.summarize` keys plus the simulator's own."""
        out = summarize(self.records, self.duration, goodput)
        out.update(
            strategy=self.strategy,
            num_steps=self.num_steps,
            num_preemptions=self.num_preemptions,
            num_swap_preemptions=self.num_swap_preemptions,
            num_recompute_tokens=self.num_recompute_tokens,
            unfinished=len(self.unfinished),
            unfinished_states=dict(Counter(self.unfinished.values())),
            mean_kv_cache_usage=self.mean_kv_cache_usage,
            max_kv_cache_usage=self.max_kv_cache_usage,
            stop_reason=self.stop_reason,
            num_busy_steps=self.num_busy_steps,
            mean_step_ms=self.busy_time / self.num_busy_steps * 1e3 if self.num_busy_steps else 0.0,
        )
        if self.request_stats or self.gave_up:
            from loadgen.sim.slo_metrics import has_objectives, slo_summary

            if has_objectives(self):
                out["slo"] = slo_summary(self)
        return out


class KVUsage:
    """Step-duration weighted mean and the max of the KV cache usage fraction, and the
    time and number of steps that computed something."""

    def __init__(self) -> None:
        self.weighted = 0.0
        self.total_time = 0.0
        self.busy_steps = 0
        self.max = 0.0

    def add(self, usage: float, seconds: float) -> None:
        self.weighted += usage * seconds
        self.total_time += seconds
        self.busy_steps += seconds > 0
        self.max = max(self.max, usage)

    @property
    def mean(self) -> float:
        return self.weighted / self.total_time if self.total_time else 0.0
