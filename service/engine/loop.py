"""`AsyncEngine`: the asyncio loop that drives the scheduler and the worker with overlap.

Handlers call `submit()` (or `generate()`); the request only reaches the scheduler when
the loop next runs, and so do aborts: the scheduler is changed by one task only. Before
submitting, handlers may ask `check_capacity()` (the waiting limit) and `check_objectives()`
(`--reject-unmeetable`): those only read the scheduler, synchronously, on the loop's own
thread, and refuse with the predicted wait (`EngineOverloadedError.retry_after`).

One loop iteration::

    take new requests + aborts -> scheduler
    while fewer than 2 plans in flight and there is work:
        plan = schedule(); worker.submit(plan)        # plan N+1 leaves before output N
    output = await worker.get_output()                 # answers the oldest plan
    update_from_output(oldest plan, output)
    output processor: detokenize, stop strings -> deltas into bounded streams
    scheduler.abort(each request a stop string ended)  # KV free before the next plan
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import NoReturn, Protocol, runtime_checkable

from scheduler.config import SchedulerConfig
from scheduler.interface import SchedulerInterface
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request
from scheduler.sampling import SamplingParams
from scheduler.slo import NO_SLO, SLO
from scheduler.stats import SchedulerStats
from service.engine.detokenizer import DEFAULT_DETOKENIZE, DetokenizeOptions, Tokenizer, TokenTexts
from service.engine.grammars import ServiceGrammars
from service.engine.metrics import ServiceMetrics
from service.engine.output_processor import OutputProcessor
from service.engine.step_cost_feed import StepCostFeed
from service.engine.step_record_hub import StepRecordHub
from service.engine.stream import (
    DEFAULT_MAX_BUFFERED_TOKENS,
    EngineDeadError,
    EngineOverloadedError,
    RequestRejectedError,
    RequestStream,
    SLOUnmeetableError,
    StepFailedError,
    StreamDelta,
    whole_seconds,
)
from service.engine.worker_link import InFlightStep, WorkerClientLike

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2
_IDLE_POLL_S = 0.5  # how often an idle loop checks that the worker is still alive
_PROBE_ID = "admission-check"  # the id of the stand-in request an admission check forecasts


@runtime_checkable
class AdmissionControl(Protocol):
    """What admission control reads of a scheduler beside `SchedulerInterface`: its config
    (objectives, `reject_unmeetable`) and its forecasts (`scheduler.scheduler.Scheduler`
    has them; an engine over a scheduler without them refuses only by the waiting limit,
    with `Retry-After: 1`)."""

    config: SchedulerConfig

    def admission_check(self, request: Request, now: float | None = None) -> float | None: ...

    def admission_wait(self, count: int, now: float | None = None) -> float | None: ...


class AsyncEngine:
    """Owns the scheduler and the worker client once started; its output processor turns
    outputs into stream deltas."""

    def __init__(
        self,
        scheduler: SchedulerInterface,
        worker: WorkerClientLike,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        max_waiting_requests: int | None = None,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
        step_time: StepCostFeed | None = None,
        grammars: ServiceGrammars | None = None,
        forward: str = "eager",
    ) -> None:
        """`step_time` feeds every step's shape and measured time into the step-cost model
        the scheduler was given (and exports predicted against measured); `grammars`
        compiles structured-output grammars (None: the worker cannot mask by one);
        `forward` is the worker's account of the forward it runs (its start-up note)."""
        self.forward = forward
        if hasattr(worker, "on_forward_changed"):
            worker.on_forward_changed = self._forward_changed
        self.scheduler = scheduler
        self.worker = worker
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # logprobs' token strings, decoded once each
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.clock = clock
        self.step_time = step_time
        self.grammars = grammars
        self.dead = asyncio.Event()  # set when the worker died or a step failed
        self.error: str | None = None
        self.output = OutputProcessor(tokenizer, metrics, max_buffered_tokens)
        self._new: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stats: SchedulerStats = scheduler.stats()
        self._last_output_time = clock()
        self.step_records = StepRecordHub(scheduler, clock)  # the live view's per-step stream
        self.admission = scheduler if isinstance(scheduler, AdmissionControl) else None
        if metrics is not None and self.admission is not None:
            config = self.admission.config
            metrics.declare_slo_classes(config.slo_classes.names)
            metrics.set_cache_config(
                block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks
            )
        if grammars is not None:
            self.step_records.grammar_waiting = lambda: grammars.num_waiting
        if step_time is not None:
            self.step_records.set_predictor(step_time.predicted)
            self.step_records.time_target_ms = (
                step_time.target * 1e3 if step_time.target > 0 else None
            )

    # -- handler side ----------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        """Requests with a live stream (submitted and not yet ended)."""
        return len(self.output)

    @property
    def num_pending(self) -> int:
        """Requests submitted that the loop has not yet handed to the scheduler."""
        return len(self._new)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler snapshot taken after the last plan, output or inbox change (what
        admission control and GET /get_load read)."""
        return self._stats

    def check_capacity(self, count: int) -> None:
        """Raise `EngineOverloadedError` if `count` more requests would pass the waiting
        limit; its `retry_after` is the predicted time until enough waiting requests have
        left the queue for them to fit (1 s without a step-cost model to predict with).
        Requests submitted but not yet taken by the loop count as waiting; the forecast sees
        only the scheduler's queue, so it may fall short by their prefills."""
        if self.dead.is_set():
            raise EngineDeadError(self.error or "engine is not running")
        limit = self.max_waiting_requests
        waiting = self._stats.num_waiting + self.num_pending
        if limit is None or waiting + count <= limit:
            return
        wait = self.predicted_wait(waiting + count - limit)
        wait = 1.0 if wait is None else wait
        self._refuse(EngineOverloadedError(
            f"too many waiting requests ({waiting}, limit {limit}); retry in "
            f"{whole_seconds(wait)} s", wait,
        ))

    def predicted_wait(self, count: int) -> float | None:
        """Predicted seconds until the `count` most urgent waiting requests have left the
        queue (None: the scheduler has no step-cost model to forecast with)."""
        if self.admission is None:
            return None
        return self.admission.admission_wait(count, self.clock())

    def check_objectives(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        user: str | None = None,
        slo: SLO = NO_SLO,
    ) -> None:
        """With `--reject-unmeetable`: raise `SLOUnmeetableError` when the forecast says this
        request's first token would come later than its TTFT objective (its own, else its
        class's) allows; `retry_after` is the predicted wait until it could be met. The
        forecast is of a stand-in request queued now behind what the scheduler holds; it
        reads the scheduler and changes nothing."""
        control = self.admission
        if control is None or not control.config.reject_unmeetable:
            return
        if self.dead.is_set():
            raise EngineDeadError(self.error or "engine is not running")
        now = self.clock()
        probe = self._request(prompt_token_ids, sampling_params, _PROBE_ID, now, user, slo)
        wait = control.admission_check(probe, now)
        if wait is None:
            return
        ttft_ms = (probe.slo.ttft_s or 0.0) * 1e3
        predicted_ms = (probe.predicted_ttft or 0.0) * 1e3
        self._refuse(SLOUnmeetableError(
            f"the time-to-first-token objective ({ttft_ms:g} ms, class {probe.slo.cls!r}) "
            f"cannot be met: the first token is predicted in {predicted_ms:.0f} ms as the "
            f"queue stands; retry in {whole_seconds(wait)} s", wait,
        ))

    def _refuse(self, error: EngineOverloadedError) -> NoReturn:
        if self.metrics is not None:
            self.metrics.observe_rejected(error.reason)
        raise error

    def _request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float,
        user: str | None,
        slo: SLO,
    ) -> Request:
        req = Request(
            request_id, list(prompt_token_ids), sampling_params, arrival_time,
            eos_token_ids=self.eos_token_ids, slo=slo,
        )
        if user:  # the OpenAI `user`: the tenant for fair share and output-length prediction
            req.tenant = user
        return req

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        arrival_time: float | None = None,
        user: str | None = None,
        detokenize: DetokenizeOptions = DEFAULT_DETOKENIZE,
        slo: SLO = NO_SLO,
    ) -> RequestStream:
        """Queue a request for the loop and return its stream (iterate it; `close()` aborts).
        `slo`: the objectives the request gave (the server's classes fill in the rest when
        the scheduler takes it)."""
        if self.dead.is_set():
            raise EngineDeadError(self.error or "engine is not running")
        if request_id in self.output:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        now = self.clock() if arrival_time is None else arrival_time
        stream = RequestStream(
            request_id, len(prompt_token_ids), self.abort, self.output.max_buffered_tokens
        )
        req = self._request(prompt_token_ids, sampling_params, request_id, now, user, slo)
        self.output.add_request(
            stream, tuple(stop), include_stop_str_in_output, now, detokenize=detokenize
        )
        self._new.append(req)
        self._idle.clear()
        self._wakeup.set()
        return stream

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> AsyncIterator[StreamDelta]:
        """Submit and yield the request's deltas; leaving early aborts it."""
        stream = self.submit(
            prompt_token_ids, sampling_params, request_id, stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed by the loop's next iteration."""
        # Ends the stream for a consumer still reading (drain timeout); harmless otherwise.
        if not self.output.abort(request_id, self.clock()):
            return
        self._aborts.append(request_id)
        self._wakeup.set()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop task (on the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="stepserve-engine-loop")

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every request to end; abort the rest. True if all ended."""
        if not self.output:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wait_all_done()
        leftover = list(self.output.request_ids())
        for request_id in leftover:
            self.abort(request_id)
        return not leftover

    async def shutdown(self) -> None:
        """Stop the loop, fail any live stream, stop the worker."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(EngineDeadError("server is shutting down"))
        if self.grammars is not None:
            self.grammars.shutdown()
        await self.worker.shutdown()

    async def _wait_all_done(self) -> None:
        while self.output:
            self._idle.clear()
            await self._idle.wait()

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        in_flight: deque[InFlightStep] = deque()
        try:
            while True:
                self._apply_inbox()
                self._fill_pipeline(in_flight)
                if not in_flight:
                    await self._wait_for_work()
                    continue
                step = in_flight.popleft()
                output = await self.worker.get_output()
                self._apply_output(step, output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker died or a step failed: nothing can continue
            log.exception("engine loop stopped")
            self.error = f"{type(exc).__name__}: {exc}"
            self.dead.set()
            self._fail_all(EngineDeadError(f"the engine failed: {self.error}"))

    def _apply_inbox(self) -> None:
        changed = False
        while self._new:
            req = self._new.popleft()
            if req.request_id not in self.output:
                continue  # aborted before it reached the scheduler
            try:
                self.scheduler.add_request(req)
            except ValueError as exc:
                self.output.reject(req.request_id, RequestRejectedError(str(exc)))
            else:  # its objectives are resolved now: the output processor judges them at the end
                self.output.accepted(req)
            changed = True
        while self._aborts:
            self.scheduler.abort(self._aborts.popleft())
            changed = True
        if changed:
            self._stats = self.scheduler.stats()  # admission control reads num_waiting

    def _fill_pipeline(self, in_flight: deque[InFlightStep]) -> None:
        while len(in_flight) < MAX_IN_FLIGHT:
            if not self.scheduler.needs_plan():
                return
            plan = self.scheduler.schedule(self.clock())
            if plan.is_noop:
                return
            now = self.clock()
            self.worker.submit(plan)
            stats = self._stats = self.scheduler.stats()  # its step_* fields: this plan
            in_flight.append(
                InFlightStep(plan, now, stats.step_prefill_tokens, stats.step_decode_tokens)
            )
            if self.step_time is not None:
                self.step_time.on_plan(plan, stats)
            self.step_records.on_plan(plan, now)
            for new in plan.scheduled_new_reqs:
                self.output.mark_scheduled(new.req_id, now)
            if plan.is_empty:
                return  # only frees to deliver; no point planning past it

    def _apply_output(self, step: InFlightStep, output: ModelRunnerOutput) -> None:
        now = self.clock()
        if output.error is not None:
            # A step that raised may have applied part of its plan in the worker, and the
            # next plan is already in flight: worker and scheduler can no longer be trusted
            # to agree (tokens, computed counts, cached blocks). Fail loudly; the process
            # exits non-zero and its supervisor restarts it, as for a dead worker.
            raise StepFailedError(f"worker step {output.step_id} failed: {output.error}")
        outputs = self.scheduler.update_from_output(step.plan, output, now)
        # Stop strings (and readers a whole buffer behind) end requests here, before the
        # next plan is built: the plan already in flight samples one more token for them,
        # which the scheduler drops since they are gone.
        self.output.summarize = self.step_records.recording
        for req_id in self.output.process(outputs, now):
            self.scheduler.abort(req_id)
        self.step_records.on_output(step.plan, output, outputs, now, self.output.last_delivery)
        self._stats = self.scheduler.stats()
        if self.step_time is not None:
            self.step_time.on_output(step.plan, output, self._stats)
        if self.metrics is not None:
            self.metrics.observe_stats(self._stats)
            if not step.plan.is_empty:
                duration = now - max(step.submitted, self._last_output_time)
                self.metrics.observe_step(
                    step.plan.num_reqs, step.prefill_tokens, step.decode_tokens, duration,
                    output.execute_time,
                )
        self._last_output_time = now
        if not self.output:
            self._idle.set()

    def _forward_changed(self, note: str) -> None:
        self.forward = note
        log.info("worker forward: %s", note)
        if self.metrics is not None:
            self.metrics.set_compiled(note.startswith("compiled"))

    async def _wait_for_work(self) -> None:
        """Nothing in flight: sleep until a request or abort arrives, checking the worker."""
        self._stats = self.scheduler.stats()
        if self.metrics is not None:
            self.metrics.observe_stats(self._stats)
        if not self.output:
            self._idle.set()
            self._check_integrity()
        timeout = _IDLE_POLL_S if not self.scheduler.has_unfinished_requests() else 0.005
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
        # lands as the event fires, and the loop would never stop.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()
        self._wakeup.clear()
        if not self.worker.is_alive:
            raise EngineDeadError("the worker process died while the engine was idle")

    def _check_integrity(self) -> None:
        """When idle, let the scheduler verify its KV accounting (a bug is logged, not fatal)."""
        if self.scheduler.has_unfinished_requests():
            return
        try:
            self.scheduler.check_integrity()
        except AssertionError:
            log.exception("scheduler integrity check failed while idle")

    def _fail_all(self, error: EngineDeadError) -> None:
        self.output.fail_all(error)
        self._idle.set()

