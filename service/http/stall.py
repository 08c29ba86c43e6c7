"""Stalled SSE clients: a client that stops reading while keeping its socket open.

aiohttp's `StreamResponse.write` returns at once while the transport's write buffer is
under its high-water mark and otherwise waits (in `drain`) until the client has read it
down. So a write that has not returned for `timeout` seconds means the buffer has stayed
above its high-water mark that long: the client has stalled. `StallWatch` checks the open
writers a few times per timeout; a stalled one has its request streams closed (the engine
aborts them and frees their KV) and its connection aborted (`transport.abort()` drops the
buffered bytes), so the server's memory for it is released too.

The handler's cost per write is two attribute stores: no timer per write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from aiohttp import web

from service.engine.stream import RequestStream

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT = 60.0
_MAX_CHECK_INTERVAL = 1.0


class GuardedWriter:
    """Writes one SSE response and records when a write started but has not returned."""

    __slots__ = ("response", "transport", "streams", "since", "stalled")

    def __init__(self, response: web.StreamResponse, transport: asyncio.BaseTransport | None,
                 streams: Sequence[RequestStream]) -> None:
        self.response = response
        self.transport = transport
        self.streams = streams
        self.since: float | None = None  # monotonic start of the write in progress
        self.stalled = False

    async def write(self, data: bytes) -> None:
        self.since = time.monotonic()
        try:
            await self.response.write(data)
        finally:
            self.since = None

    def abort(self) -> None:
        """Close the request streams (aborting them) and drop the connection."""
        self.stalled = True
        for stream in self.streams:
            stream.close()
        if self.transport is not None:
            self.transport.abort()


class StallWatch:
    """The open SSE writers of one app, and the task that aborts stalled ones."""

    def __init__(
        self, timeout: float = DEFAULT_STALL_TIMEOUT, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"stream stall timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.clock = clock
        self.interval = min(_MAX_CHECK_INTERVAL, timeout / 4)
        self._writers: set[GuardedWriter] = set()
        self.num_stalled = 0

    @contextlib.contextmanager
    def watch(self, request: web.Request, response: web.StreamResponse,
              streams: Sequence[RequestStream]) -> Iterator[GuardedWriter]:
        """`with watch(...) as writer:` write the response through `writer.write`."""
        writer = GuardedWriter(response, request.transport, streams)
        self._writers.add(writer)
        try:
            yield writer
        finally:
            self._writers.discard(writer)

    def check(self) -> int:
        """Abort every writer whose write has been blocked past the timeout; how many."""
        now = self.clock()
        stalled = [w for w in self._writers if w.since is not None and now - w.since > self.timeout]
        for writer in stalled:
            self._writers.discard(writer)
            ids = ", ".join(s.request_id for s in writer.streams)
            log.warning("client stopped reading for over %g s; aborting %s", self.timeout, ids)
            writer.abort()
        self.num_stalled += len(stalled)
        return len(stalled)

    async def run(self) -> None:
        """Check until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()
