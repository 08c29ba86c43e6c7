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

    @classmethod
    def of(cls, req: Request) -> RequestStat:
        m = req.metrics
        return cls(req.request_id, req.tenant, req.arrival_time, m.first_scheduled_time,
                   req.num_prompt_tokens, req.num_output_tokens, req.predicted_output_tokens,
                   m.num_preemptions)


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

    def record(self, request_id: str, unfinished_state: str | None = None) -> RequestRecord:
        """The client's view of one request; an unfinished one is a failure with its state."""
        w = self.requests[request_id]
        times = self.times.get(request_id, array("d"))
        done = request_id in self.finish and unfinished_state is None
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
            rec.error = f"unfinished: {unfinished_state or 'UNKNOWN'}"
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
