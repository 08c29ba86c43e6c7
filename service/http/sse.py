"""Server-sent events on `web.StreamResponse`, and merging several request streams into one.

A failed write (the client went away) raises out of the writer; the caller's `finally`
closes the request streams, which aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from aiohttp import web

from service.engine.stream import RequestStream, StreamDelta

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    """Send the SSE response headers."""
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response


def event(body: dict[str, Any]) -> bytes:
    """One ``data: {...}`` event."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Yield (position in `streams`, delta) from all streams as they arrive.

    The first error from any stream is re-raised; leaving the iterator early (or an
    error) closes every stream, which aborts whatever is still running.
    """
    try:
        if len(streams) == 1:
            async for delta in streams[0]:
                yield 0, delta
            return
        async for item in _merge_many(streams):
            yield item
    finally:
        for stream in streams:
            stream.close()


async def _merge_many(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    queue: asyncio.Queue[tuple[int, StreamDelta] | BaseException | None] = asyncio.Queue()

    async def pump(position: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((position, delta))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
