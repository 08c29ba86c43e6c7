"""Shared helpers for the service tests: the default tokenizer (once per session), apps
backed by `InstantRunner` workers behind aiohttp's test server, and live `stepserve serve`
subprocesses on free ports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from live_servers import LiveServer, start_live_server
from worker_modes import REFERENCE_FLAGS

from scheduler.scheduler import Scheduler
from service.cli.serve_args import build_parser
from service.engine.loop import AsyncEngine
from service.engine.metrics import ServiceMetrics
from service.engine.stream import DEFAULT_MAX_BUFFERED_TOKENS
from service.http.app import create_app
from service.http.state import STATE, AppConfig, EngineFactory, LoadedEngine, ServiceState

INSTANT = "worker.execution.instant_runner:InstantRunner"
DEBUG_CONFIG = AppConfig(enable_debug_endpoints=True)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's tokenizer (cached as an HF dir after the first GGUF parse)."""
    from common.tokenizer import load_tokenizer

    return load_tokenizer()


@dataclass(frozen=True)
class InstantSetup:
    """How to build an InstantRunner-backed engine for an in-process app."""

    kv_cache_memory: int = 64 << 20  # 91 blocks of 16 tokens (46080 B per token)
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_waiting_requests: int | None = None
    enable_prefix_caching: bool = True
    runner: str = INSTANT  # "module:callable" the worker builds its runner with
    swap_space: float = 0.0  # GiB of host swap slots
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    priority_preemption_threshold: int | None = None
    max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS


def instant_flags(setup: InstantSetup) -> list[str]:
    """The `stepserve serve` flags that describe `setup`."""
    flags = ["--kv-cache-memory", f"{setup.kv_cache_memory}B", "--max-model-len", str(setup.max_model_len),
             "--swap-space", str(setup.swap_space), "--max-num-seqs", str(setup.max_num_seqs),
             "--preemption-mode", setup.preemption_mode, "--scheduling-policy", setup.scheduling_policy]
    if not setup.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if setup.priority_preemption_threshold is not None:
        flags += ["--priority-preemption-threshold", str(setup.priority_preemption_threshold)]
    return flags


def instant_factory(tokenizer: Any, setup: InstantSetup = InstantSetup()) -> EngineFactory:
    """An engine factory whose worker is a real process running `InstantRunner`, configured
    from `stepserve serve` flags the way the server is (without the step-time budget: the
    instant worker's steps take no time to fit a model to)."""
    from service.cli.serve import scheduler_config, worker_config
    from worker.process.client import WorkerClient

    args = build_parser().parse_args(instant_flags(setup))

    async def build() -> LoadedEngine:
        worker = WorkerClient(worker_config(args), setup.runner)
        info = await worker.start()
        config = scheduler_config(args, info)
        engine = AsyncEngine(
            Scheduler(config),
            worker,
            tokenizer,
            eos_token_ids=info.eos_token_ids,
            max_waiting_requests=setup.max_waiting_requests,
            metrics=ServiceMetrics(info.model_name),
            max_buffered_tokens=setup.max_buffered_tokens,
        )
        return LoadedEngine(engine, info.model_name, info.max_model_len, info.vocab_size, info.model_path)

    return build


@asynccontextmanager
async def instant_client(
    tokenizer: Any, setup: InstantSetup = InstantSetup(), config: AppConfig = DEBUG_CONFIG
) -> AsyncIterator[tuple[TestClient, ServiceState]]:
    """A started app on aiohttp's test server, waited until its engine is ready."""
    async with factory_client(instant_factory(tokenizer, setup), config) as pair:
        yield pair


@asynccontextmanager
async def factory_client(
    factory: EngineFactory, config: AppConfig = DEBUG_CONFIG
) -> AsyncIterator[tuple[TestClient, ServiceState]]:
    """A started app over the engine `factory` builds, on aiohttp's test server, waited
    until its engine is ready."""
    app = create_app(config, factory)
    client = TestClient(TestServer(app))
    await client.start_server()
    state = app[STATE]
    try:
        await _wait_ready(state)
        yield client, state
    finally:
        await client.close()


async def _wait_ready(state: ServiceState, timeout: float = 60.0) -> None:
    waiters = [asyncio.ensure_future(state.ready.wait()), asyncio.ensure_future(state.fatal.wait())]
    await asyncio.wait_for(asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED), timeout)
    for waiter in waiters:
        waiter.cancel()
    assert not state.fatal.is_set(), state.error


ClientContext = AbstractAsyncContextManager[tuple[TestClient, ServiceState]]


@pytest.fixture(scope="session")
def make_client(tokenizer: Any) -> Callable[..., ClientContext]:
    """`async with make_client(setup=InstantSetup(...), config=AppConfig(...)) as (client, state)`."""

    def make(setup: InstantSetup = InstantSetup(), config: AppConfig = DEBUG_CONFIG) -> ClientContext:
        return instant_client(tokenizer, setup, config)

    return make


@pytest.fixture(scope="session")
def make_factory_client() -> Callable[..., ClientContext]:
    """`async with make_factory_client(factory, config=AppConfig(...)) as (client, state)`:
    an app over any engine factory (an engine built in the test, over a fake worker)."""
    return factory_client


@pytest.fixture(scope="session")
def setup_cls() -> type[InstantSetup]:
    """`InstantSetup`, for tests that need other engine limits."""
    return InstantSetup


@pytest.fixture(scope="session")
def engine_factory(tokenizer: Any) -> Callable[..., EngineFactory]:
    """`engine_factory(setup)`: an InstantRunner engine factory for `create_app`."""

    def make(setup: InstantSetup = InstantSetup()) -> EngineFactory:
        return instant_factory(tokenizer, setup)

    return make


@pytest.fixture(scope="session")
def settled_kv() -> Callable[[TestClient], Any]:
    """`await settled_kv(client)`: /debug/kv once no stream is live and nothing is queued."""
    return kv_free


async def kv_free(client: TestClient) -> dict[str, Any]:
    """/debug/kv once the engine has settled (no live stream, nothing scheduled)."""
    for _ in range(200):
        body = await (await client.get("/debug/kv")).json()
        if body["num_unfinished_streams"] == 0 and body["num_running"] == 0 and body["num_waiting"] == 0:
            return body
        await asyncio.sleep(0.01)
    return body


# -- live servers -----------------------------------------------------------------------------


@pytest.fixture
def start_server() -> Iterator[Callable[..., LiveServer]]:
    """`start_server(tmp_path, *flags)`; any server still running at the end is killed."""
    started: list[LiveServer] = []

    def start(tmp: Path, *args: str, compiled: bool = False, env: dict[str, str] | None = None) -> LiveServer:
        server = start_live_server(tmp, *args, compiled=compiled, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The one default-model server of the session, in reference mode (its tests compare
    batched with solo outputs, which the fast defaults do not promise)."""
    server = start_live_server(tmp_path_factory.mktemp("live"), "--max-num-seqs", "64", *REFERENCE_FLAGS)
    yield server
    code = server.stop()
    assert code == 0, server.log()
