"""GET /get_load: a replica's load, in the shape SGLang serves it to its router.

SGLang's `/get_load` answers a list with one entry per data-parallel rank (``dp_rank``,
``num_reqs``: running and waiting, ``num_waiting_reqs``, ``num_tokens``: the tokens of the
requests in flight); SGLang's model gateway, in the releases that poll it, sums
``num_tokens`` over the entries as the worker's load. A stepserve replica is one rank. Each
entry also says what the sum hides: the running and swapped requests and the fraction of
KV-cache blocks in use.

Everything read here is what the engine loop publishes, on the same event loop: the
scheduler snapshot taken after each step (`AsyncEngine.stats`, which /metrics exports),
the requests submitted but not yet taken by the loop, and the output processor's running
sum of tokens. A poll walks no queue; it costs the same however busy the engine is.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from aiohttp import web

from service.engine.loop import AsyncEngine
from service.http.state import STATE

PATH = "/get_load"


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One entry of /get_load (the names are SGLang's where it has the field)."""

    dp_rank: int
    num_reqs: int  # every request not yet ended: running, waiting, swapped out
    num_waiting_reqs: int  # in the scheduler's queue, or submitted and not yet taken
    num_tokens: int  # prompt + output tokens so far of every request not yet ended
    num_running_reqs: int
    num_swapped_reqs: int
    kv_cache_usage: float  # fraction of KV-cache blocks in use (0-1)


def engine_load(engine: AsyncEngine) -> RankLoad:
    """The engine's load as of its last step (and the requests submitted since)."""
    stats = engine.stats
    waiting = stats.num_waiting + engine.num_pending
    return RankLoad(
        dp_rank=0,
        num_reqs=stats.num_running + waiting + stats.num_swapped,
        num_waiting_reqs=waiting,
        num_tokens=engine.output.num_tokens,
        num_running_reqs=stats.num_running,
        num_swapped_reqs=stats.num_swapped,
        kv_cache_usage=stats.kv_cache_usage,
    )


async def get_load(request: web.Request) -> web.Response:
    """GET /get_load: ``[{dp_rank, num_reqs, num_waiting_reqs, num_tokens, ...}]`` (503
    until the engine is ready)."""
    engine = request.app[STATE].require_ready().engine
    body = orjson.dumps([engine_load(engine)])  # orjson writes a dataclass as its fields
    return web.Response(body=body, content_type="application/json")
