"""The engine's view of the worker: the client calls it makes, and a plan in flight.

`worker.process.client.WorkerClient` satisfies `WorkerClientLike`; tests may wrap it (to record
pipeline depth or inject a failed step) without the engine knowing.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from scheduler.output import ModelRunnerOutput, SchedulerOutput


class InFlightStep(NamedTuple):
    """A plan the worker has not answered yet, with what the metrics need of it."""

    plan: SchedulerOutput
    submitted: float
    prefill_tokens: int
    decode_tokens: int


class WorkerClientLike(Protocol):
    """The part of `worker.process.client.WorkerClient` the engine uses."""

    def submit(self, plan: SchedulerOutput) -> None: ...

    async def get_output(self) -> ModelRunnerOutput: ...

    async def shutdown(self) -> None: ...

    @property
    def is_alive(self) -> bool: ...
