"""The worker process and its asyncio client, driven with model-free runners."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.sampling import SamplingParams
from worker.config import WorkerConfig
from worker.execution.instant_runner import InstantRunner
from worker.process.client import WorkerClient, WorkerDiedError, WorkerStartupError
from worker.process.main import INSTANT_RUNNER_FACTORY

pytestmark = pytest.mark.timeout(120)

CONFIG = WorkerConfig(block_size=4, kv_cache_memory=1 << 24)
HERE = Path(__file__).parent


def plan(
    step_id: int,
    new: tuple[NewRequestData, ...] = (),
    cached: tuple[CachedRequestData, ...] = (),
    scheduled: dict[str, int] | None = None,
) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        preempted_req_ids=frozenset(),
        finished_req_ids=frozenset(),
        aborted_req_ids=frozenset(),
    )


def new_req(req_id: str, prompt: tuple[int, ...], blocks: tuple[int, ...]) -> NewRequestData:
    return NewRequestData(req_id, prompt, SamplingParams(), blocks, 0)


def cached_req(req_id: str, computed: int, blocks: tuple[int, ...] = ()) -> CachedRequestData:
    return CachedRequestData(req_id, blocks, computed, False)


def session_plans() -> list[SchedulerOutput]:
    """Chunked prefill of a 6-token prompt (4 + 2), then two decodes that cross a block."""
    return [
        plan(1, new=(new_req("a", (11, 12, 13, 14, 15, 16), (0,)),), scheduled={"a": 4}),
        plan(2, cached=(cached_req("a", 4, (1,)),), scheduled={"a": 2}),
        plan(3, cached=(cached_req("a", 6),), scheduled={"a": 1}),
        plan(4, cached=(cached_req("a", 7),), scheduled={"a": 1}),
    ]


def worker_is_gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie counts: an init that does not reap leaves one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def helper_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the spawned worker import tests/worker/worker_process_runners.py."""
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture
async def client() -> AsyncIterator[WorkerClient]:
    worker = WorkerClient(CONFIG, INSTANT_RUNNER_FACTORY)
    await worker.start(timeout=60)
    yield worker
    await worker.shutdown()


async def test_handshake_returns_the_runner_info(client: WorkerClient) -> None:
    assert client.info == InstantRunner(CONFIG).info
    assert client.info.block_size == 4
    assert client.is_alive


async def test_outputs_come_back_in_order_with_two_plans_in_flight(client: WorkerClient) -> None:
    plans = session_plans()
    local = InstantRunner(CONFIG)
    expected = [local.execute(p) for p in plans]
    client.submit(plans[0])
    outputs = []
    for next_plan in [*plans[1:], None]:
        if next_plan is not None:
            client.submit(next_plan)  # plan N+1 goes out before output N is read
            assert client.num_in_flight == 2
        outputs.append(await client.get_output())
    assert outputs == expected
    assert [o.step_id for o in outputs] == [1, 2, 3, 4]
    assert "a" not in outputs[0].sampled_token_ids  # the first chunk does not sample
    assert all("a" in o.sampled_token_ids for o in outputs[1:])


async def test_a_failing_step_is_an_error_output_and_the_worker_keeps_serving(
    client: WorkerClient,
) -> None:
    client.submit(plan(1, cached=(cached_req("ghost", 3),), scheduled={"ghost": 1}))
    client.submit(plan(2, new=(new_req("b", (1, 2), (0,)),), scheduled={"b": 2}))
    failed, ok = await client.get_output(), await client.get_output()
    assert failed.step_id == 1 and failed.sampled_token_ids == {}
    assert failed.error is not None and "ghost" in failed.error
    assert ok.step_id == 2 and ok.error is None and "b" in ok.sampled_token_ids


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("worker.no_such_module:Runner", "No module named 'worker.no_such_module'"),
        ("worker.execution.instant_runner", "must look like 'module:callable'"),
        ("worker_process_runners:FailingRunner", "model file not found: /nowhere/model.gguf"),
        ("worker_process_runners:exiting_runner", "exited during start-up.*exit code 3"),
    ],
)
async def test_startup_errors_surface_with_the_workers_message(
    helper_runners: None, factory: str, message: str
) -> None:
    worker = WorkerClient(WorkerConfig(model="/nowhere/model.gguf"), factory)
    with pytest.raises(WorkerStartupError, match=message):
        await worker.start(timeout=60)
    assert not worker.is_alive
    assert worker.pid is not None and worker_is_gone(worker.pid)


async def test_a_killed_worker_is_detected_by_get_output(helper_runners: None) -> None:
    worker = WorkerClient(CONFIG, "worker_process_runners:SlowRunner")
    await worker.start(timeout=60)
    worker.submit(session_plans()[0])  # the worker is now inside a one-minute step
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    # Detection, not completion: the step would take a minute.
    with pytest.raises(WorkerDiedError, match="exit code -9"):
        await asyncio.wait_for(worker.get_output(), timeout=5)
    assert not worker.is_alive
    with pytest.raises(WorkerDiedError):
        await worker.get_output()  # stays dead for every later reader
    with pytest.raises(WorkerDiedError):
        worker.submit(session_plans()[0])
    await worker.shutdown()


async def test_shutdown_stops_a_worker_stuck_in_a_step_and_is_idempotent(
    helper_runners: None,
) -> None:
    worker = WorkerClient(CONFIG, "worker_process_runners:SlowRunner")
    await worker.start(timeout=60)
    worker.submit(session_plans()[0])
    await worker.shutdown(timeout=0.2)  # the polite request waits behind the step
    await worker.shutdown()
    assert not worker.is_alive
    assert worker.exitcode == -signal.SIGTERM
    assert worker.pid is not None and worker_is_gone(worker.pid)
    assert all(p.pid != worker.pid for p in multiprocessing.active_children())


async def test_polite_shutdown_exits_cleanly(client: WorkerClient) -> None:
    pid = client.pid
    await client.shutdown()
    assert client.exitcode == 0
    assert pid is not None and worker_is_gone(pid)
    assert all(p.pid != pid for p in multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="not running"):
        client.submit(session_plans()[0])


PARENT_SCRIPT = f"""
import asyncio
from worker.process.client import WorkerClient
from worker.config import WorkerConfig

async def main() -> None:
    worker = WorkerClient(WorkerConfig(), {INSTANT_RUNNER_FACTORY!r})
    await worker.start(timeout=60)
    print(worker.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_the_worker_exits_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        worker_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while not worker_is_gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_is_gone(worker_pid)
