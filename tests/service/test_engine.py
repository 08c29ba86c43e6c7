"""`AsyncEngine` without HTTP: overlap (two plans in flight), abort frees KV within a step,
a failed worker step fails only its requests. The worker is a real InstantRunner process,
seen through a thin recorder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from service.engine import AsyncEngine
from service.stream import EngineDeadError
from worker.client import WorkerClient
from worker.config import WorkerConfig

INSTANT = "worker.instant_runner:InstantRunner"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class RecordingWorker:
    """Forwards to a WorkerClient; records pipeline depth and can fail one chosen step."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.max_in_flight = 0
        self.outputs = 0
        self.fail_step: int | None = None
        self.aborts_seen: dict[str, int] = {}  # req id -> outputs received when its abort was sent

    def submit(self, plan: SchedulerOutput) -> None:
        for rid in plan.aborted_req_ids:
            self.aborts_seen.setdefault(rid, self.outputs)
        self.client.submit(plan)
        self.max_in_flight = max(self.max_in_flight, self.client.num_in_flight)

    async def get_output(self) -> ModelRunnerOutput:
        out = await self.client.get_output()
        self.outputs += 1
        if out.step_id == self.fail_step:
            return ModelRunnerOutput(out.step_id, {}, error="injected failure")
        return out

    async def shutdown(self) -> None:
        await self.client.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive


@pytest_asyncio.fixture
async def engine(tokenizer: Any) -> AsyncIterator[AsyncEngine]:
    client = WorkerClient(WorkerConfig(kv_cache_memory=64 << 20, max_model_len=1024), INSTANT)
    info = await client.start()
    config = SchedulerConfig(max_model_len=1024, num_gpu_blocks=info.num_gpu_blocks, block_size=info.block_size)
    eng = AsyncEngine(Scheduler(config), RecordingWorker(client), tokenizer, eos_token_ids=info.eos_token_ids)
    eng.start()
    yield eng
    await eng.shutdown()


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
