"""The scheduler's contract, written once: the engine loop and the simulator code against it."""

from __future__ import annotations

from typing import Protocol

from scheduler.output import ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.stats import SchedulerStats


class SchedulerInterface(Protocol):
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError on a duplicate id or a request that can
        never fit (prompt + max_tokens over max_model_len, or more blocks than the pool)."""

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan one step. May be called again before the previous plan's output is applied
        (two plans in flight); `now` is the clock used for aging and metrics."""

    def update_from_output(
        self, plan: SchedulerOutput, output: ModelRunnerOutput, now: float | None = None
    ) -> list[RequestOutput]:
        """Apply the worker's answer to `plan`: append tokens, check stops, free finished."""

    def abort(self, request_id: str) -> None:
        """Abort a request in any state; its blocks are free in the next plan. Unknown ids
        are ignored."""

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped."""

    def needs_plan(self) -> bool:
        """True while requests are unfinished or finished/aborted ids await publication."""

    def check_integrity(self) -> None:
        """Raise AssertionError if KV accounting or the queues are inconsistent."""

    def stats(self) -> SchedulerStats:
        """A snapshot of queue sizes, KV usage, prefix-cache and preemption counters."""
