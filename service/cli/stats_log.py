"""The server's periodic stats line, as vLLM logs it: every few seconds while there is
traffic, prompt and generation throughput (tokens/s over the interval), running / waiting /
swapped requests, KV-cache usage and the prefix-cache hit rate. `--disable-log-stats` turns
it off; `--log-stats-interval` sets the period.

The token counts are the engine's Prometheus counters (`stepserve:prompt_tokens`,
`stepserve:generation_tokens`, so the line and /metrics agree); the rest is the scheduler's
latest `SchedulerStats` snapshot. The hit rate is over the interval's prompt-token lookups
(over the server's life when the interval had none).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from scheduler.stats import SchedulerStats
from service.engine.loop import AsyncEngine
from service.http.state import ServiceState

log = logging.getLogger("stepserve.stats")
DEFAULT_INTERVAL_S = 5.0  # vLLM's


@dataclass(frozen=True)
class Totals:
    """Cumulative counts at one moment; two of them make an interval."""

    time: float  # monotonic seconds
    prompt_tokens: float
    generation_tokens: float
    prefix_queries: int
    prefix_hits: int


def read_totals(engine: AsyncEngine, now: float) -> Totals:
    """The engine's cumulative counts at `now`."""
    stats = engine.stats
    prompt = generation = 0.0
    if engine.metrics is not None:
        registry, labels = engine.metrics.registry, {"model_name": engine.metrics.model_name}
        prompt = registry.get_sample_value("stepserve:prompt_tokens_total", labels) or 0.0
        generation = registry.get_sample_value("stepserve:generation_tokens_total", labels) or 0.0
    return Totals(now, prompt, generation, stats.prefix_cache_queries, stats.prefix_cache_hits)


def stats_line(before: Totals, after: Totals, stats: SchedulerStats) -> str | None:
    """The line for the interval from `before` to `after`, with the queues and KV usage of
    `stats`; None when no token was processed and no request is running or waiting."""
    prompt = after.prompt_tokens - before.prompt_tokens
    generated = after.generation_tokens - before.generation_tokens
    live = stats.num_running + stats.num_waiting + stats.num_swapped
    if not (prompt or generated or live):
        return None
    seconds = max(after.time - before.time, 1e-9)
    queries = after.prefix_queries - before.prefix_queries
    hits = after.prefix_hits - before.prefix_hits
    if queries <= 0:
        queries, hits = after.prefix_queries, after.prefix_hits
    hit_rate = hits / queries if queries > 0 else 0.0
    return (
        f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
        f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
        f"Swapped: {stats.num_swapped} reqs, KV cache usage: {stats.kv_cache_usage:.1%}, "
        f"Prefix cache hit rate: {hit_rate:.1%}"
    )


async def log_stats(state: ServiceState, interval: float = DEFAULT_INTERVAL_S) -> None:
    """Log a stats line every `interval` seconds while there is traffic; runs until cancelled
    (from the moment the engine is ready)."""
    await state.ready.wait()
    assert state.loaded is not None  # set before ready
    engine = state.loaded.engine
    before = read_totals(engine, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        after = read_totals(engine, time.monotonic())
        line = stats_line(before, after, engine.stats)
        if line is not None:
            log.info("%s", line)
        before = after
