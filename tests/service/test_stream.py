"""`RequestStream`: one pending delta that coalesces pushes, wakes its reader only for text
or the end, bounds what it buffers, and ends with an error or a final delta."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.output import TokenLogprobs
from service.engine.stream import EngineDeadError, RequestStream

LP = TokenLogprobs(0.0, ())


def _stream(aborted: list[str] | None = None, max_buffered_tokens: int = 100) -> RequestStream:
    return RequestStream("r", 3, (aborted if aborted is not None else []).append, max_buffered_tokens)


async def test_pushes_the_reader_has_not_taken_merge_into_one_delta() -> None:
    stream = _stream()
    stream.push("Hel", (1,), (LP,), 1, 0)
    stream.push("lo", (2,), (LP,), 2, 0)
    stream.push(" world", (3,), (LP,), 3, 16, "length")
    (delta,) = [d async for d in stream]
    assert (delta.text, delta.token_ids, len(delta.logprobs)) == ("Hello world", (1, 2, 3), 3)
    assert (delta.finished, delta.finish_reason, delta.num_output_tokens, delta.num_cached_tokens) == (True, "length", 3, 16)


async def test_a_waiting_reader_gets_each_push_and_tokens_without_text_ride_along() -> None:
    stream = _stream()
    reader = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    stream.push("", (1,), (), 1, 0)  # half a character: nothing to show yet
    await asyncio.sleep(0)
    assert not reader.done()
    stream.push("é", (2,), (), 2, 0)
    first = await reader
    assert (first.text, first.token_ids, first.finished) == ("é", (1, 2), False)
    stream.push("!", (3,), (), 3, 0, "stop", "!")
    second = await stream.__anext__()
    assert (second.text, second.finish_reason, second.stop_reason) == ("!", "stop", "!")
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_buffer_overflows_only_while_the_reader_is_not_waiting() -> None:
    stream = _stream(max_buffered_tokens=3)
    assert all(stream.push("", (i,), (), i + 1, 0) for i in range(3))
    assert not stream.push("", (3,), (), 4, 0)  # a fourth token and nobody reading
    waiting = _stream(max_buffered_tokens=3)
    reader = asyncio.ensure_future(waiting.__anext__())
    await asyncio.sleep(0)
    assert all(waiting.push("", (i,), (), i + 1, 0) for i in range(10))  # text-less, but it waits
    waiting.push("x", (), (), 10, 0, "length")
    assert (await reader).token_ids == tuple(range(10))


async def test_fail_ends_the_stream_with_the_error_unless_its_end_is_already_queued() -> None:
    stream = _stream()
    stream.push("partial", (1,), (), 1, 0)
    stream.fail(EngineDeadError("worker died"))
    with pytest.raises(EngineDeadError):
        await stream.__anext__()
    done = _stream()
    done.push("all", (1,), (), 1, 0, "length")
    done.fail(EngineDeadError("later"))
    assert (await done.__anext__()).finish_reason == "length"


async def test_close_aborts_once_and_only_while_unfinished() -> None:
    aborted: list[str] = []
    stream = _stream(aborted)
    stream.close()
    stream.close()
    assert aborted == ["r"]
    finished = _stream(aborted)
    finished.push("x", (1,), (), 1, 0, "length")
    await finished.__anext__()
    finished.close()
    assert aborted == ["r"]
