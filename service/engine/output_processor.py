"""`OutputProcessor`: each step's outputs become ready stream deltas, in the engine's task.

vLLM v1's `OutputProcessor` is the model. The engine calls `process()` with the
`RequestOutput`s of one step as soon as `update_from_output` returns them. Per request it
runs an incremental detokenizer and a stop-string matcher, observes the token metrics at
the engine's clock, and pushes one delta into the request's bounded `RequestStream`. Its
cost per step is bounded by the step's tokens (a few Rust calls per token, stop matching
bounded by the stop strings' lengths), never by what the readers do.

Each request is detokenized under its own `DetokenizeOptions`; the token that stops it (EOS or
a stop token id) adds no text unless `include_stop_str_in_output` (vLLM's rule), so keeping
special tokens never shows the EOS text.

`process()` returns the requests the scheduler must finish now: a stop string matched (the
scheduler only sees token ids), or the reader fell a whole buffer behind. The engine
finishes them in the same loop iteration, so their KV blocks free within one step of the
match whatever the reader does. With two plans in flight the next plan already holds such
a request; the token it samples there is dropped by the scheduler (the request is gone)
and by this processor (its state is gone), so it is never streamed or counted in usage.

When a request ends, its objectives (resolved by the scheduler, which the engine reports
through `accepted`) are judged against the times measured here, at the engine's clock: the
TTFT from arrival to the step that delivered the first token, the TPOT from there to the
end over the tokens after the first (`scheduler.slo.ttft_and_tpot`). An aborted request
meets none of them but a TTFT objective its first token had already met; a request aborted
before the scheduler took it is not judged (it never had its objectives resolved).

`num_tokens` is the work in flight that a router weighs (GET /get_load): the prompt and
output tokens so far of every live request, waiting or running, kept as a running sum so
that reading it costs nothing however long the queue.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from scheduler.output import RequestOutput
from scheduler.request import Request
from service.engine.detokenizer import (
    DEFAULT_DETOKENIZE,
    DetokenizeOptions,
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
)
from service.engine.metrics import ServiceMetrics
from service.engine.stream import (
    DEFAULT_MAX_BUFFERED_TOKENS,
    EngineError,
    ReaderTooSlowError,
    RequestStream,
)


@dataclass(slots=True)
class StepDelivery:
    """What one step delivered to clients, for the live view: tokens, the requests that got
    their first token, and those that ended, with the reason their client saw."""

    tokens: int
    first: list[str]
    finished: list[tuple[str, str]]


@dataclass(slots=True)
class _RequestState:
    """What the processor keeps about one live request."""

    stream: RequestStream
    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None
    keep_stop_token_text: bool
    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_output: int = 0
    num_cached: int = 0
    request: Request | None = None  # the scheduler's, once it took it: objectives, forecast


class OutputProcessor:
    """The live requests' output state, keyed by request id."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        metrics: ServiceMetrics | None = None,
        max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_buffered_tokens = max_buffered_tokens
        self._reqs: dict[str, _RequestState] = {}
        self.num_tokens = 0  # prompt + output tokens of the live requests
        # With `summarize` set (a live view listens), `process` leaves its step's summary here.
        self.summarize = False
        self.last_delivery: StepDelivery | None = None

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def request_ids(self) -> Iterator[str]:
        return iter(list(self._reqs))

    def add_request(
        self,
        stream: RequestStream,
        stop: tuple[str, ...],
        include_stop_str_in_output: bool,
        arrival_time: float,
        detokenize: DetokenizeOptions = DEFAULT_DETOKENIZE,
    ) -> None:
        """Start tracking a request whose deltas go to `stream`."""
        stops = StopStringMatcher(stop, include_stop_str_in_output) if stop else None
        self.num_tokens += stream.num_prompt_tokens
        self._reqs[stream.request_id] = _RequestState(
            stream,
            IncrementalDetokenizer(self.tokenizer, detokenize),
            stops,
            include_stop_str_in_output,
            arrival_time,
            arrival_time,
        )

    def accepted(self, request: Request) -> None:
        """The scheduler took `request` (and resolved its objectives): judge them at its end."""
        state = self._reqs.get(request.request_id)
        if state is not None:
            state.request = request

    def mark_scheduled(self, request_id: str, now: float) -> None:
        """The request reached a plan for the first time (queue time ends here)."""
        state = self._reqs.get(request_id)
        if state is not None and state.first_scheduled_time is None:
            state.first_scheduled_time = now

    # -- one step's outputs -------------------------------------------------------------

    def process(self, outputs: list[RequestOutput], now: float) -> list[str]:
        """Route one step's outputs; return the ids the scheduler must finish now."""
        to_finish: list[str] = []
        reqs = self._reqs
        generated = 0
        ttfts: list[tuple[int, float]] = []  # (prompt tokens, TTFT) of first tokens
        itls: list[float] = []
        first: list[str] | None = [] if self.summarize else None
        ended: list[tuple[str, str]] = []
        for out in outputs:
            state = reqs.get(out.req_id)
            if state is None:
                continue  # aborted (or stopped) while this output was in flight: dropped
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                if state.first_token_time is None:
                    state.first_token_time = now
                    ttfts.append((state.stream.num_prompt_tokens, now - state.arrival_time))
                    if first is not None:
                        first.append(out.req_id)
                else:
                    itls.append(now - state.last_token_time)
                state.last_token_time = now
            reason = self._route(state, out)
            if reason is None:
                continue
            del reqs[out.req_id]
            self._forget(state)
            self._record_finish(state, reason, now)
            ended.append((out.req_id, reason))
            if not out.finished:  # a stop string or an overflow: the scheduler does not know
                to_finish.append(out.req_id)
        if generated and self.metrics is not None:
            self.metrics.observe_step_tokens(generated, ttfts, itls)
        self.last_delivery = StepDelivery(generated, first, ended) if first is not None else None
        return to_finish

    def _route(self, state: _RequestState, out: RequestOutput) -> str | None:
        """Push this output's delta; the finish reason when the request ends here."""
        ids = out.new_token_ids
        if out.finish_reason == "stop" and ids and not state.keep_stop_token_text:
            ids = ids[:-1]  # the stop token (EOS or a stop token id) adds no text
        text = state.detok.add(ids) if ids else ""
        stops = state.stops
        if stops is not None:
            text = stops.feed(text)
        if out.finished:
            text += self._final_text(state)
        self.num_tokens += out.num_output_tokens - state.num_output
        state.num_output = out.num_output_tokens
        state.num_cached = out.num_cached_tokens
        reason, stop_reason = (
            (out.finish_reason, out.stop_token_id) if out.finished else (None, None)
        )
        if stops is not None and stops.matched is not None:
            reason, stop_reason = "stop", stops.matched
        if state.stream.push(
            text,
            out.new_token_ids,
            out.logprobs,
            out.num_output_tokens,
            out.num_cached_tokens,
            reason,
            stop_reason,
            out.prompt_logprobs,
        ):
            return reason
        behind = state.stream.num_buffered_tokens
        state.stream.fail(
            ReaderTooSlowError(
                f"the client fell {behind} tokens behind the generation; request aborted"
            )
        )
        return "abort"

    @staticmethod
    def _final_text(state: _RequestState) -> str:
        """What the detokenizer and the stop matcher still hold once no token will follow."""
        tail = state.detok.finish()
        if state.stops is None:
            return tail
        return state.stops.feed(tail) + state.stops.flush()

    # -- ends ---------------------------------------------------------------------------

    def abort(self, request_id: str, now: float) -> bool:
        """The request is aborted (client gone, drain timeout, stall): end its stream with
        finish reason "abort" for a consumer still reading. False if it was not live."""
        state = self._reqs.pop(request_id, None)
        if state is None:
            return False
        self._forget(state)
        state.stream.push(
            self._final_text(state), (), (), state.num_output, state.num_cached, "abort"
        )
        self._record_finish(state, "abort", now)
        return True

    def reject(self, request_id: str, error: EngineError) -> None:
        """The scheduler refused the request: its stream ends with `error`."""
        state = self._reqs.pop(request_id, None)
        if state is not None:
            self._forget(state)
            state.stream.fail(error)

    def fail_all(self, error: EngineError) -> None:
        """The engine stopped: every live stream ends with `error`."""
        for state in self._reqs.values():
            state.stream.fail(error)
        self._reqs.clear()
        self.num_tokens = 0

    def _forget(self, state: _RequestState) -> None:
        """`state`'s request left `_reqs`: its tokens are no longer in flight."""
        self.num_tokens -= state.stream.num_prompt_tokens + state.num_output

    # -- metrics ------------------------------------------------------------------------

    def _record_finish(self, state: _RequestState, reason: str, now: float) -> None:
        if self.metrics is None:
            return
        queue_time = (
            None
            if state.first_scheduled_time is None
            else state.first_scheduled_time - state.arrival_time
        )
        first_token = state.first_token_time
        ttft = None if first_token is None else first_token - state.arrival_time
        prefill_time = (
            None
            if first_token is None or state.first_scheduled_time is None
            else first_token - state.first_scheduled_time
        )
        self.metrics.observe_finished(
            reason,
            e2e=now - state.arrival_time,
            queue_time=queue_time,
            ttft=ttft,
            num_output=state.num_output,
            num_prompt=state.stream.num_prompt_tokens,
            prefill_time=prefill_time,
        )
        req = state.request
        if req is not None:
            self.metrics.observe_objectives(
                req.slo,
                arrival=state.arrival_time,
                first_token=state.first_token_time,
                finished=now,
                num_output=state.num_output,
                aborted=reason == "abort",
                predicted_ttft=req.predicted_ttft,
            )

