"""The server's state, kept under one typed `web.AppKey` (no module globals).

`ServiceState.status` drives /health: 503 while starting, draining or after a failure.
`ServiceState.fatal` is set when the engine can no longer serve; the server then exits
non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from service.engine.loop import AsyncEngine
from service.http.errors import APIError
from service.http.stall import DEFAULT_STALL_TIMEOUT, StallWatch

DEFAULT_MAX_BODY_SIZE = 8 << 20  # bytes


class Status(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(frozen=True)
class AppConfig:
    """Front-door settings (the engine's come from its factory)."""

    api_key: str | None = None
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    enable_debug_endpoints: bool = False
    enable_dashboard: bool = True  # GET /dashboard and its record stream
    tokenizer_threads: int = 2
    tool_call_parser: str | None = None  # tool_choice auto parses calls with it (None: refused)
    stream_stall_timeout: float = (
        DEFAULT_STALL_TIMEOUT  # seconds a client may stop reading an SSE stream
    )


@dataclass
class LoadedEngine:
    """A started engine and what the API reports about its model."""

    engine: AsyncEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    model_path: str = ""


EngineFactory = Callable[[], Awaitable[LoadedEngine]]


@dataclass
class ServiceState:
    """Everything the handlers share."""

    config: AppConfig
    status: Status = Status.STARTING
    loaded: LoadedEngine | None = None
    error: str | None = None
    fatal: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))
    executor: ThreadPoolExecutor = field(init=False)  # tokenization and chat templates
    stall_watch: StallWatch = field(init=False)  # aborts SSE clients that stopped reading

    def __post_init__(self) -> None:
        self.executor = ThreadPoolExecutor(
            self.config.tokenizer_threads, thread_name_prefix="stepserve-tokenize"
        )
        self.stall_watch = StallWatch(self.config.stream_stall_timeout)

    def require_ready(self) -> LoadedEngine:
        """The engine, or a 503 saying why there is none to use."""
        if self.status is Status.READY and self.loaded is not None:
            return self.loaded
        reason = {
            Status.STARTING: "the server is starting; retry when /health returns 200",
            Status.DRAINING: "the server is shutting down",
            Status.FAILED: f"the server has failed: {self.error or 'unknown error'}",
        }.get(self.status, "the server is not ready")
        raise APIError(
            503, reason, headers={"Retry-After": "1"} if self.status is Status.STARTING else None
        )

    def fail(self, error: str) -> None:
        """Mark the server failed: /health turns 503 and the process will exit non-zero."""
        self.status = Status.FAILED
        self.error = error
        self.fatal.set()


STATE = web.AppKey("stepserve_state", ServiceState)
