"""`RequestStream`: one request's output channel from the engine loop to its HTTP handler.

The engine loop's router calls `put()` with each `RequestOutput` (cheap: a queue push and
a few metric observations). The handler iterates the stream; detokenization and
stop-string matching run there, in the handler's task, so one slow or large stream never
holds up the router. A stop string ends the request from this side: the stream asks the
engine to abort it in the scheduler and reports finish reason "stop".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.output import RequestOutput, TokenLogprobs
from service.detokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from service.metrics import ServiceMetrics


class EngineError(Exception):
    """Base of the errors a stream or `submit` can raise."""


class EngineDeadError(EngineError):
    """The worker died or the engine stopped; the request cannot finish."""


class EngineOverloadedError(EngineError):
    """Too many waiting requests; retry later."""


class RequestRejectedError(EngineError):
    """The scheduler refused the request (it can never fit)."""


class StepFailedError(EngineError):
    """A worker step raised: worker and scheduler may disagree, so the engine stops."""


@dataclass(frozen=True)
class StreamDelta:
    """What a request produced since the last delta its consumer saw."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: str | int | None  # the stop string or stop token id, when one ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


class RequestStream:
    """Per-request queue plus the consumer-side text state; iterate it for `StreamDelta`s."""

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        tokenizer: Tokenizer,
        *,
        stop: tuple[str, ...],
        include_stop_str_in_output: bool,
        arrival_time: float,
        abort: Callable[[str], None],
        metrics: ServiceMetrics | None,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self._queue: asyncio.Queue[tuple[RequestOutput, float] | EngineError] = asyncio.Queue()
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stop, include_stop_str_in_output)
        self._abort = abort
        self._metrics = metrics
        self._first_token_time: float | None = None
        self._last_token_time = arrival_time
        self._num_output = 0
        self._recorded_finish = False
        self._carried_ids: tuple[int, ...] = ()
        self._carried_lps: tuple[TokenLogprobs, ...] = ()
        self.finished = False  # the consumer has seen (or caused) the end

    # -- router side -------------------------------------------------------------------

    def put(self, out: RequestOutput, now: float) -> None:
        """Called by the engine loop for each output of this request."""
        if out.new_token_ids and self._metrics is not None:
            first = self._first_token_time is None
            latency = now - (self.arrival_time if first else self._last_token_time)
            self._metrics.observe_tokens(len(out.new_token_ids), first=first, num_prompt=self.num_prompt_tokens, latency=latency)
        if out.new_token_ids:
            self._first_token_time = self._first_token_time or now
            self._last_token_time = now
            self._num_output += len(out.new_token_ids)
        if out.finished:
            self.record_finish(out.finish_reason or "abort", now)
        self._queue.put_nowait((out, now))

    def fail(self, error: EngineError) -> None:
        """End the stream with an error (the worker died, or the request was refused)."""
        self._queue.put_nowait(error)

    def record_finish(self, reason: str, now: float) -> None:
        """Count the request's end once, whichever side saw it first."""
        if self._recorded_finish:
            return
        self._recorded_finish = True
        if self._metrics is not None:
            queue_time = None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time
            ttft = None if self._first_token_time is None else self._first_token_time - self.arrival_time
            self._metrics.observe_finished(
                reason, e2e=now - self.arrival_time, queue_time=queue_time, ttft=ttft, num_output=self._num_output
            )

    # -- consumer side -----------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        while not self.finished:
            items = [await self._queue.get()]
            # Coalesce what piled up while we were busy, except under stop strings: there a
            # match must cut at its own token, or usage and logprobs would depend on timing.
            while not self._stops.active and not self._queue.empty():
                items.append(self._queue.get_nowait())
            delta = self._consume(items)
            if delta is not None:
                return delta
        raise StopAsyncIteration

    def close(self) -> None:
        """The consumer is gone: abort the request unless it already ended."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    def _consume(self, items: list[tuple[RequestOutput, float] | EngineError]) -> StreamDelta | None:
        outs: list[RequestOutput] = []
        for item in items:
            if isinstance(item, EngineError):
                self.finished = True
                raise item
            outs.append(item[0])
            if item[0].finished:
                break
        token_ids = tuple(t for o in outs for t in o.new_token_ids)
        logprobs = tuple(lp for o in outs for lp in o.logprobs)
        last = outs[-1]
        text = self._stops.feed(self._detok.add(token_ids))
        finish_reason, stop_reason = last.finish_reason if last.finished else None, last.stop_token_id
        if last.finished:
            text += self._stops.feed(self._detok.finish())
            text += self._stops.flush()
        if self._stops.matched is not None:
            finish_reason, stop_reason = "stop", self._stops.matched
            self.record_finish("stop", self._last_token_time)  # before the abort records one
            if not last.finished:
                self._abort(self.request_id)  # the scheduler does not see stop strings
        finished = finish_reason is not None
        self.finished = finished
        if not text and not finished:
            self._carry(token_ids, logprobs)
            return None
        token_ids, logprobs = self._with_carried(token_ids, logprobs)
        return StreamDelta(
            request_id=self.request_id,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason if finished else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(self._detok.token_ids),
            num_cached_tokens=last.num_cached_tokens,
        )

    def _carry(self, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]) -> None:
        """Tokens whose text is still held back ride along with the next non-empty delta."""
        self._carried_ids += token_ids
        self._carried_lps += logprobs

    def _with_carried(
        self, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]
    ) -> tuple[tuple[int, ...], tuple[TokenLogprobs, ...]]:
        ids, lps = self._carried_ids + token_ids, self._carried_lps + logprobs
        self._carried_ids, self._carried_lps = (), ()
        return ids, lps
