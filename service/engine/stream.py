"""`RequestStream`: one request's bounded output buffer between the engine and its handler.

The engine's output processor (`service.engine.output_processor`) pushes *ready* deltas: text
already detokenized and cut at stop strings, logprobs, the finish reason, usage counts.
The handler iterates the stream and only formats and writes; it never decides when a
request ends.

The buffer is one pending delta. A push the reader has not taken yet merges into it (text,
token ids and logprobs concatenate; counts and the finish reason are the latest), so:

- a reader that takes each delta before the next step's output arrives sees one delta per
  step, and the time between its deltas is the per-token latency;
- a slower reader sees fewer, larger deltas (coalesced), and nothing is lost;
- the buffer never holds more than the tokens generated since the reader's last take.
  Past `max_buffered_tokens` of them while the reader is not waiting (it is blocked on a
  client that does not read), `push` reports an overflow and the engine aborts the
  request; a client that stalls for less is caught by the stall watch (`service.http.stall`).

Tokens whose text is still held back (half a character, a possible stop-string prefix) do
not wake the reader; they ride along with the next delta that has text or ends the stream.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.output import TokenLogprobs

DEFAULT_MAX_BUFFERED_TOKENS = 4096


class EngineError(Exception):
    """Base of the errors a stream or `submit` can raise."""


class EngineDeadError(EngineError):
    """The worker died or the engine stopped; the request cannot finish."""


class EngineOverloadedError(EngineError):
    """Too many waiting requests; retry in `retry_after` seconds (predicted when the
    scheduler has a step-cost model to forecast with). `reason` names the refusal in the
    429's error code and in the metrics."""

    reason = "queue_full"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def retry_after_s(self) -> int:
        """`retry_after` as the `Retry-After` header states it."""
        return whole_seconds(self.retry_after)


class SLOUnmeetableError(EngineOverloadedError):
    """The request's TTFT objective cannot be met as the queue stands (`--reject-unmeetable`);
    `retry_after` is the predicted wait until it could be."""

    reason = "slo_unmeetable"


def whole_seconds(seconds: float) -> int:
    """A wait as `Retry-After` states it: whole seconds, rounded up, at least 1 (1 for a
    wait that is not a finite number)."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


class RequestRejectedError(EngineError):
    """The scheduler refused the request (it can never fit)."""


class StepFailedError(EngineError):
    """A worker step raised: worker and scheduler may disagree, so the engine stops."""


class ReaderTooSlowError(EngineError):
    """The client fell so far behind that its buffer filled; the request was aborted."""


@dataclass(slots=True)
class StreamDelta:
    """What a request produced since the last delta its consumer saw (one per event, so
    slotted and not frozen: frozen ones are ~2x slower to build)."""

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
    # the prompt's logprobs (None for its first token), on the first delta when asked for
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


class RequestStream:
    """The pending delta of one request; iterate it for `StreamDelta`s, `close()` aborts."""

    __slots__ = (
        "request_id", "num_prompt_tokens", "max_buffered_tokens", "finished", "ended", "_abort",
        "_texts", "_ids", "_lps", "_finish_reason", "_stop_reason", "_num_output", "_num_cached",
        "_ready", "_error", "_waiter", "_prompt_lps",
    )

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        abort: Callable[[str], None],
        max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_buffered_tokens = max_buffered_tokens
        self.finished = False  # the consumer has seen (or caused) the end
        self.ended = False  # the engine pushed the last delta (or failed the stream)
        self._abort = abort
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._lps: list[TokenLogprobs] = []
        self._finish_reason: str | None = None
        self._stop_reason: str | int | None = None
        self._num_output = 0
        self._num_cached = 0
        self._ready = False  # the pending delta is worth waking the reader for
        self._error: EngineError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._prompt_lps: tuple[TokenLogprobs | None, ...] | None = None

    # -- engine side -------------------------------------------------------------------

    def push(
        self,
        text: str,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprobs, ...],
        num_output_tokens: int,
        num_cached_tokens: int,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        prompt_logprobs: tuple[TokenLogprobs | None, ...] = (),
    ) -> bool:
        """Merge one step's delta into the pending one; False if the buffer overflowed."""
        if self.ended:
            return True
        if prompt_logprobs:
            self._prompt_lps = prompt_logprobs
        if text:
            self._texts.append(text)
            self._ready = True
        if token_ids:
            self._ids.extend(token_ids)
        if logprobs:
            self._lps.extend(logprobs)
        self._num_output = num_output_tokens
        self._num_cached = num_cached_tokens
        if finish_reason is not None:
            self._finish_reason, self._stop_reason = finish_reason, stop_reason
            self.ended = self._ready = True
        elif len(self._ids) > self.max_buffered_tokens and self._waiter is None:
            return False
        if self._ready:
            self._wake()
        return True

    def fail(self, error: EngineError) -> None:
        """End the stream with an error (the worker died, the request was refused, ...)."""
        if self.ended and self._error is None and self._finish_reason is not None:
            return  # its last delta is already waiting for the reader
        self._error = error
        self.ended = True
        self._wake()

    @property
    def num_buffered_tokens(self) -> int:
        """Tokens pushed and not yet taken by the reader."""
        return len(self._ids)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumer side -----------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        while not self._ready and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            self.finished = True
            raise self._error
        return self._take()

    def close(self) -> None:
        """The consumer is gone: abort the request unless it already ended."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    def _take(self) -> StreamDelta:
        finished = self._finish_reason is not None
        delta = StreamDelta(
            self.request_id,
            "".join(self._texts),
            tuple(self._ids),
            tuple(self._lps),
            finished,
            self._finish_reason,
            self._stop_reason if finished else None,
            self.num_prompt_tokens,
            self._num_output,
            self._num_cached,
            self._prompt_lps,
        )
        self._prompt_lps = None
        self._texts.clear()
        self._ids.clear()
        self._lps.clear()
        self._ready = False
        self.finished = finished
        return delta
