"""`Request`: one sequence's state as the scheduler sees it.

Token accounting (the one invariant of chunked prefill and overlap)::

    all_token_ids:  [ prompt ........ | outputs ...... ]        known to the scheduler
                    0                 P                 num_tokens
    in flight:                                          + num_placeholders (sampled by
                                                          plans not yet answered)
    num_computed_tokens: KV written (or planned) for positions [0, num_computed_tokens)

A request needs `num_tokens + num_placeholders - num_computed_tokens` more tokens computed;
it samples a new token in the step whose chunk reaches that end. No prefill/decode flag.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.sampling import SamplingParams
from scheduler.slo import NO_SLO, SLO

DEFAULT_TENANT = "default"  # the tenant of a request that names none (no OpenAI `user`)


class RequestStatus(enum.IntEnum):
    """Ordered so that every finished state compares greater than every live one."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    PREEMPTED = 3  # recompute-preempted: back in the waiting queue, KV dropped
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestMetrics:
    """Timestamps (scheduler clock) and counters for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission


@dataclass(eq=False)
class Request:
    """A sequence being served. Mutated only by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_placeholders: int = 0  # tokens sampled by in-flight plans, not yet received
    stop_token_id: int | None = None  # the token that stopped it, when one did
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full known blocks
    admit_seq: int = -1  # order of (re)admission to the running set; larger = newer
    tenant: str = DEFAULT_TENANT  # who is served (the OpenAI `user`), for fair share and prediction
    predicted_output_tokens: int | None = None  # set once when queued (scheduler/predictor.py)
    num_charged_tokens: int = 0  # positions already counted as service (scheduler/fairness.py)
    # objectives: those given on arrival; add_request fills the rest from the server's classes
    slo: SLO = NO_SLO
    slo_resolved: bool = False  # `slo` holds the resolved objectives (resolved once)
    predicted_ttft: float | None = None  # seconds, forecast on arrival when there is a cost model
    # (num_tokens, preemptions, prompt tokens the prefix cache held) when a forecast last
    # looked it up
    forecast_hit: tuple[int, int, int] = (-1, 0, 0)
    last_step: int = -1  # the last step that computed for it (loose decodes take turns by it)
    metrics: RequestMetrics = field(init=False)
    num_tokens: int = field(init=False)  # prompt + outputs; kept by append_output (hot path)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt must contain at least one token")
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, lo: int, hi: int) -> tuple[int, ...]:
        """Token ids at positions [lo, hi) without building the whole list."""
        p = len(self.prompt_token_ids)
        if hi <= p:
            return tuple(self.prompt_token_ids[lo:hi])
        if lo >= p:
            return tuple(self.output_token_ids[lo - p : hi - p])
        return tuple(self.prompt_token_ids[lo:]) + tuple(self.output_token_ids[: hi - p])

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens still to compute before the next sample (1 for a plain decode)."""
        return self.num_tokens + self.num_placeholders - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)
