"""`AsyncEngine` without HTTP: overlap (two plans in flight), abort frees KV within a step,
a failed worker step stops the engine, and the output path at the engine's pace (stop
strings end requests whatever the reader does, slow readers get coalesced deltas, a reader
a whole buffer behind is aborted). The worker is a real InstantRunner process, seen
through a thin recorder."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from service.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from service.engine.loop import AsyncEngine
from service.engine.stream import EngineDeadError, ReaderTooSlowError
from worker.config import WorkerConfig
from worker.process.client import WorkerClient

INSTANT = "worker.execution.instant_runner:InstantRunner"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class RecordingWorker:
    """Forwards to a WorkerClient; records pipeline depth and can fail one chosen step."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.max_in_flight = 0
        self.outputs = 0
        self.fail_step: int | None = None
        self.aborts_seen: dict[str, int] = {}  # req id -> outputs received when its abort was sent
        self.sampled: Counter[str] = Counter()  # req id -> tokens the worker sampled for it

    def submit(self, plan: SchedulerOutput) -> None:
        for rid in plan.aborted_req_ids:
            self.aborts_seen.setdefault(rid, self.outputs)
        self.client.submit(plan)
        self.max_in_flight = max(self.max_in_flight, self.client.num_in_flight)

    async def get_output(self) -> ModelRunnerOutput:
        out = await self.client.get_output()
        self.outputs += 1
        self.sampled.update(out.sampled_token_ids.keys())
        if out.step_id == self.fail_step:
            return ModelRunnerOutput(out.step_id, {}, error="injected failure")
        return out

    async def shutdown(self) -> None:
        await self.client.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive


async def _start_engine(tokenizer: Any, **kwargs: Any) -> AsyncEngine:
    client = WorkerClient(WorkerConfig(kv_cache_memory=64 << 20, max_model_len=1024), INSTANT)
    info = await client.start()
    config = SchedulerConfig(max_model_len=1024, num_gpu_blocks=info.num_gpu_blocks, block_size=info.block_size)
    eng = AsyncEngine(Scheduler(config), RecordingWorker(client), tokenizer, eos_token_ids=info.eos_token_ids, **kwargs)
    eng.start()
    return eng


@pytest_asyncio.fixture
async def engine(tokenizer: Any) -> AsyncIterator[AsyncEngine]:
    eng = await _start_engine(tokenizer)
    yield eng
    await eng.shutdown()


async def _settled(engine: AsyncEngine, request_id: str) -> None:
    """Until the request has ended in the engine and the scheduler and the worker are idle
    (its reader may not have read anything)."""
    while (request_id in engine.output or engine.scheduler.has_unfinished_requests()
           or engine.worker.client.num_in_flight):  # type: ignore[attr-defined]
        await asyncio.sleep(0.001)


async def _collect(engine: AsyncEngine, rid: str, params: SamplingParams = GREEDY) -> tuple[str, str | None]:
    text, reason = "", None
    async for delta in engine.generate([10, 20, 30, 40], params, rid):
        text += delta.text
        reason = delta.finish_reason
    return text, reason


async def test_two_plans_in_flight_and_identical_results(engine: AsyncEngine) -> None:
    alone = await _collect(engine, "solo")
    together = await asyncio.gather(*[_collect(engine, f"r{i}") for i in range(8)])
    assert all(t == alone for t in together)
    assert alone[1] == "length"
    assert engine.worker.max_in_flight == 2  # type: ignore[attr-defined]


async def test_abort_frees_blocks_within_one_step(engine: AsyncEngine) -> None:
    sched: Scheduler = engine.scheduler  # type: ignore[assignment]
    total = sched.config.num_gpu_blocks
    gen = engine.generate([1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True), "long")
    for _ in range(3):
        await gen.__anext__()
    assert sched.num_free_blocks < total
    worker: RecordingWorker = engine.worker  # type: ignore[assignment]
    before = worker.outputs
    await gen.aclose()  # the consumer leaves: abort
    while "long" not in worker.aborts_seen:
        await asyncio.sleep(0)
    # The plan that tells the worker is built right after the output then in flight.
    assert worker.aborts_seen["long"] - before <= 1
    assert sched.num_free_blocks == total
    sched.check_integrity()


async def test_failed_step_stops_the_engine(engine: AsyncEngine) -> None:
    """A step that raised may have half-applied its plan in the worker, with the next plan
    already in flight: the engine must not carry on as if the two still agreed."""
    engine.worker.fail_step = 3  # type: ignore[attr-defined]
    with pytest.raises(EngineDeadError, match="injected failure"):
        await _collect(engine, "victim")
    assert engine.dead.is_set()
    with pytest.raises(EngineDeadError):
        await _collect(engine, "after")


async def test_stop_string_ends_the_request_in_the_scheduler(engine: AsyncEngine) -> None:
    full, _ = await _collect(engine, "full")
    stop = full[8:11]
    text, reason = "", None
    async for delta in engine.generate([10, 20, 30, 40], GREEDY, "stopped", stop=[stop]):
        text += delta.text
        reason = delta.finish_reason
    assert (text, reason) == (full[: full.index(stop)], "stop")
    sched: Scheduler = engine.scheduler  # type: ignore[assignment]
    while sched.has_unfinished_requests():
        await asyncio.sleep(0)
    sched.check_integrity()


async def test_stop_string_usage_does_not_depend_on_reader_speed(engine: AsyncEngine) -> None:
    """Tokens past the one that completes a stop string are never counted, however many
    had piled up before the reader got to them."""
    full, _ = await _collect(engine, "ref")
    stop = full[8:11]
    counts = []
    for name, delay in (("fast", 0.0), ("slow", 0.3)):
        stream = engine.submit([10, 20, 30, 40], GREEDY, name, stop=[stop])
        await asyncio.sleep(delay)  # let the engine run ahead of the reader
        last = None
        async for delta in stream:
            last = delta
        assert last is not None and last.finish_reason == "stop"
        counts.append(last.num_output_tokens)
    assert counts[0] == counts[1] < GREEDY.max_tokens


def _stop_token_index(tokenizer: Any, token_ids: list[int], stop: str) -> int:
    """How many tokens the output has when the matcher first sees `stop` (1-based)."""
    detok, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher([stop])
    for i, token in enumerate(token_ids):
        matcher.feed(detok.add([token]))
        if matcher.matched is not None:
            return i + 1
    raise AssertionError(f"{stop!r} never appears")


async def test_stop_string_finishes_in_the_scheduler_whatever_the_reader_does(engine: AsyncEngine, tokenizer: Any) -> None:
    """A reader that reads nothing until the end: the request still ends in the scheduler
    at the step its stop string appears. The worker samples at most one token past it (for
    the plan already in flight), and that token is neither streamed nor counted."""
    ids: list[int] = []
    async for delta in engine.generate([10, 20, 30, 40], GREEDY, "ref"):
        ids.extend(delta.token_ids)
    full = tokenizer.decode(ids)
    stop = full[8:11]
    k = _stop_token_index(tokenizer, ids, stop)
    stream = engine.submit([10, 20, 30, 40], GREEDY, "unread", stop=[stop])
    await _settled(engine, "unread")
    worker: RecordingWorker = engine.worker  # type: ignore[assignment]
    assert k <= worker.sampled["unread"] <= k + 1 < GREEDY.max_tokens
    deltas = [d async for d in stream]
    assert len(deltas) == 1  # nothing was read while it ran: one coalesced delta
    (last,) = deltas
    assert (last.text, last.finish_reason, last.stop_reason) == (full[: full.index(stop)], "stop", stop)
    assert last.num_output_tokens == len(last.token_ids) == k
    engine.scheduler.check_integrity()


async def test_slow_reader_gets_coalesced_deltas_with_the_same_content(engine: AsyncEngine) -> None:
    fast = [d async for d in engine.generate([5, 6, 7], GREEDY, "fast")]
    assert len(fast) > 1
    stream = engine.submit([5, 6, 7], GREEDY, "slow")
    seen = []
    async for delta in stream:
        seen.append(delta)
        await asyncio.sleep(0.05)  # far slower than the stand-in generates
    assert len(seen) < len(fast)
    for deltas in (fast, seen):
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == GREEDY.max_tokens
    assert "".join(d.text for d in seen) == "".join(d.text for d in fast)
    assert [t for d in seen for t in d.token_ids] == [t for d in fast for t in d.token_ids]


async def test_reader_a_whole_buffer_behind_is_aborted(tokenizer: Any) -> None:
    """Nothing buffers without bound: with an 8-token buffer, a request nobody reads is
    aborted (and its KV freed) once 9 tokens wait, while a reader that keeps up finishes."""
    engine = await _start_engine(tokenizer, max_buffered_tokens=8)
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.submit([1, 2, 3], params, "stalled")
        await _settled(engine, "stalled")
        worker: RecordingWorker = engine.worker  # type: ignore[assignment]
        assert worker.sampled["stalled"] <= 10  # 9 buffered, at most one more in flight
        with pytest.raises(ReaderTooSlowError):
            await stream.__anext__()
        sched: Scheduler = engine.scheduler  # type: ignore[assignment]
        assert sched.num_free_blocks == sched.config.num_gpu_blocks
        read = [d async for d in engine.generate([1, 2, 3], params, "reader")]
        assert read[-1].finish_reason == "length" and read[-1].num_output_tokens == 200
    finally:
        await engine.shutdown()
