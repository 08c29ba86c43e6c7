"""The engine's live step-record stream: `StepRecordHub` turns each plan and its output into
a record (`scheduler.step_records`) and hands it to every subscriber, without ever making
the engine loop wait.

The engine calls two hooks, both plain synchronous functions (they cannot await)::

    on_plan(plan, now)                      after the plan went to the worker
    on_output(plan, output, outputs, now)   after update_from_output applied its answer

With no subscriber, both only note the time (no record is built). Each subscriber has a
bounded buffer: when it is full the oldest record is folded into a *gap* (the dropped
steps' tokens, admissions, first tokens, preemptions, lost deadlines and finishes survive;
their batch composition, slack and block maps do not), so a slow viewer loses detail,
never blocks anything and never grows memory past its bound. Records are encoded to JSON
once, by whichever subscriber reads them first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from scheduler.interface import SchedulerInterface
from scheduler.output import ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.step_records import Predictor, Record, StepRecorder, compact, scheduler_hello
from service.engine.output_processor import StepDelivery


def event(body: Record) -> bytes:
    """One server-sent event, encoded once however many viewers receive it."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


BUFFER_RECORDS = 512  # per subscriber: ~1 s of steps at 64 streams on the instant worker
MAP_INTERVAL_S = 0.25  # the live block map: at most 4 a second (a map costs ~100x a record)
GAP_EVENT_CAP = 20_000  # lifecycle events one gap keeps before it only counts steps
_GAP_LISTS = ("new", "first", "finished", "preempted", "aborted", "resumed", "swapped_in",
              "lost")


class _Entry:
    """A record shared by every subscriber's buffer, encoded at most once."""

    __slots__ = ("record", "_bytes")

    def __init__(self, record: Record) -> None:
        self.record = record
        self._bytes: bytes | None = None

    def encoded(self) -> bytes:
        if self._bytes is None:
            self._bytes = event(compact(self.record))
        return self._bytes


def _new_gap(first: Record) -> Record:
    gap: Record = {"type": "gap", "from_step": first["step"], "to_step": first["step"], "steps": 0,
                   "t0": first["t"], "t": first["t"], "tokens": 0, "truncated": False}
    for key in _GAP_LISTS:
        gap[key] = []
    return gap


def fold_into_gap(gap: Record, rec: Record) -> None:
    """Fold a dropped step record into `gap`, keeping its lifecycle events (up to a cap)."""
    gap["to_step"], gap["t"], gap["steps"] = rec["step"], rec["t"], gap["steps"] + 1
    gap["tokens"] += rec["tokens"]
    for key in ("running", "waiting", "swapped", "kv"):
        gap[key] = rec[key]
    if gap["truncated"]:
        return
    events = 0
    for key in _GAP_LISTS:
        gap[key].extend(rec[key])
        events += len(gap[key])
    if events > GAP_EVENT_CAP:
        gap["truncated"] = True  # the viewer says events were lost; counts stay right


class Subscription:
    """One viewer's bounded buffer of records, read by its stream handler."""

    def __init__(self, hub: StepRecordHub, maxlen: int) -> None:
        self.hub = hub
        self.maxlen = maxlen
        self.buffer: deque[_Entry] = deque()
        self.gap: Record | None = None
        self.dropped = 0  # records folded into gaps so far
        self.closed = False
        self._ready = asyncio.Event()

    def push(self, entry: _Entry) -> None:
        """Called by the publisher: never blocks, never grows past `maxlen`."""
        if len(self.buffer) >= self.maxlen:
            oldest = self.buffer.popleft().record
            if self.gap is None:
                self.gap = _new_gap(oldest)
            fold_into_gap(self.gap, oldest)
            self.dropped += 1
        self.buffer.append(entry)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    def take(self) -> list[bytes]:
        """Everything buffered, encoded, the gap (if any) first.

        Viewers that flush on the same tick (the stream handlers align their flushes) hold
        the same run of entries: the first of them joins it, the others reuse its bytes."""
        self._ready.clear()
        out = [] if self.gap is None else [event(self.gap)]
        self.gap = None
        if self.buffer:
            span = (self.buffer[0], self.buffer[-1], len(self.buffer))
            shared = self.hub.joined
            if shared is None or shared[:3] != span:
                shared = self.hub.joined = (
                    *span,
                    b"".join(entry.encoded() for entry in self.buffer),
                )
            self.buffer.clear()
            out.append(shared[3])
        return out

    async def wait(self, timeout: float) -> list[bytes] | None:
        """The next batch of events ([] after `timeout` with nothing new; None once closed)."""
        if not self.buffer and self.gap is None and not self.closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
        if self.closed:
            return None
        return self.take()


class StepRecordHub:
    """The engine's recorder plus its subscribers (see the module docstring)."""

    def __init__(
        self,
        scheduler: SchedulerInterface,
        clock: Callable[[], float] = time.monotonic,
        buffer_records: int = BUFFER_RECORDS,
        map_interval: float = MAP_INTERVAL_S,
    ) -> None:
        self.clock = clock
        self.buffer_records = buffer_records
        # Any other SchedulerInterface (a test double) gets no live view.
        self.recorder = (StepRecorder(scheduler, clock(), map_interval, short_ids=True)
                         if isinstance(scheduler, Scheduler) else None)
        self.subscribers: list[Subscription] = []
        self.time_target_ms: float | None = (
            None  # the scheduler's step-time target, once it has one
        )
        self.published = 0
        # how many requests wait for their grammar's compile (structured outputs), if any can
        self.grammar_waiting: Callable[[], int] | None = None
        # the last joined run of entries: (first, last, count, bytes), for viewers in step
        self.joined: tuple[_Entry, _Entry, int, bytes] | None = None
        self._submitted: dict[int, float] = {}
        self._last_output = clock()

    @property
    def available(self) -> bool:
        return self.recorder is not None

    def set_predictor(self, predictor: Predictor | None) -> None:
        """The step-cost model's prediction of a plan, recorded next to the measured time."""
        if self.recorder is not None:
            self.recorder.predictor = predictor

    def hello(self, **extra: Any) -> Record:
        """The stream's first message: the config, and the state right now."""
        assert self.recorder is not None
        epoch_unix = time.time() - (self.clock() - self.recorder.epoch)
        return {**scheduler_hello(self.recorder.sched, epoch_unix=epoch_unix, **extra),
                "time_target_ms": self.time_target_ms, "state": self.recorder.state()}

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self.buffer_records)
        self.subscribers.append(sub)
        if self.recorder is not None:
            self.recorder.force_map()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with contextlib.suppress(ValueError):
            self.subscribers.remove(sub)
        sub.close()
        if not self.subscribers and self.recorder is not None:
            self.recorder.reset()
            self._submitted.clear()

    def close(self) -> None:
        """End every subscription (the server is shutting down)."""
        for sub in self.subscribers:
            sub.close()
        self.subscribers.clear()

    # -- the engine's hooks -----------------------------------------------------------------

    def on_plan(self, plan: SchedulerOutput, now: float) -> None:
        if self.subscribers and self.recorder is not None:
            self._submitted[plan.step_id] = now
            self.recorder.on_plan(plan, now)

    @property
    def recording(self) -> bool:
        """Somebody listens: records are being built."""
        return bool(self.subscribers) and self.recorder is not None

    def on_output(
        self,
        plan: SchedulerOutput,
        output: ModelRunnerOutput,
        outputs: Sequence[RequestOutput],
        now: float,
        delivered: StepDelivery | None = None,
    ) -> None:
        """`delivered`: the output processor's summary of the step (tokens, first tokens and
        ends as the clients saw them); without it the record is built from `outputs`."""
        last, self._last_output = self._last_output, now
        submitted = self._submitted.pop(plan.step_id, None)
        if submitted is None or self.recorder is None:
            return
        # the engine's step time, as its step_duration metric counts it
        rec = self.recorder.on_output(
            plan, outputs, now, now - max(submitted, last), output.execute_time, delivered
        )
        if rec is not None:
            if self.grammar_waiting is not None and (held := self.grammar_waiting()):
                rec["waiting_for_grammar"] = held
            self.publish(rec)

    def publish(self, rec: Record) -> None:
        """Hand a record to every subscriber (synchronous: the engine never waits here)."""
        entry = _Entry(rec)
        for sub in self.subscribers:
            sub.push(entry)
        self.published += 1
