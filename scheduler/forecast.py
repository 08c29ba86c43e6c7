"""Forecasts of waiting: when a request queued now would see its first token
(`first_token`), and when the first k waiting requests will have been admitted
(`admitted_within`). The slo policy's admission check and the server's 429 `Retry-After`
read them; the metrics compare the first-token forecast with what happened.

The model, from what the scheduler holds now and its step-cost model::

    work ahead  = prompt tokens still to compute of the running requests, of the waiting
                  requests the queue ranks before it, and its own
    one step    = the running decodes + the longest prefill chunk the step's time limit
                  allows (the whole token budget when nothing decodes or there is no limit)
    prefill     = ceil(work ahead / chunk) steps of that step's predicted time
    seats       = when the running batch (max_num_seqs) or the KV pool has no room for the
                  requests ahead and this one, the running requests that would finish first
                  (by predicted output length) decode until they make room, then prefill
    forecast    = max(prefill, seats + its own prefill) + half a step (the step in flight)

It assumes nobody more urgent arrives meanwhile and no prefix-cache hits: a forecast of
the queue as it stands.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.arith import cdiv
from scheduler.predictor import remaining_work
from scheduler.request import Request
from scheduler.step_cost import BatchShape, StepCostFn

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def _prefill_left(req: Request) -> int:
    """Tokens to compute before its next sample, when that is a prefill (0 for a decode)."""
    n = req.num_tokens + req.num_placeholders - req.num_computed_tokens
    return n if n > 1 else 0


def _step(sched: Scheduler, cost: StepCostFn) -> tuple[int, float]:
    """(prefill tokens one step computes beside the running decodes, that step's time)."""
    decodes = BatchShape()
    for r in sched.running:
        if not _prefill_left(r):
            decodes.add(1, r.num_computed_tokens)
    config = sched.config
    budget = max(config.max_num_batched_tokens - decodes.num_decode_tokens, 1)

    def with_chunk(m: int) -> float:
        shape = decodes.copy()
        shape.add(m, 0, samples=False)
        return cost(shape)

    target = sched.step_target()
    limit = math.inf
    if target is not None and decodes.num_decode_tokens:
        share = config.min_prefill_share
        limit = max(target, cost(decodes) / (1.0 - share)) if share else target
    if with_chunk(budget) <= limit:
        return budget, with_chunk(budget)
    lo, hi = min(config.block_size, budget), budget  # the step's one guaranteed chunk
    while lo < hi:  # the longest chunk within the limit
        mid = (lo + hi + 1) // 2
        if with_chunk(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo, with_chunk(lo)


def _serve_time(sched: Scheduler, ahead: Sequence[Request], own_tokens: int, own_blocks: int,
                cost: StepCostFn) -> float:
    """Seconds until the prefills of the running requests, `ahead`, and `own_tokens` more
    are done (see the module docstring)."""
    chunk, step_s = _step(sched, cost)
    work = sum(_prefill_left(r) for r in sched.running)
    work += sum(max(r.num_tokens - r.num_computed_tokens, 0) for r in ahead) + own_tokens
    prefill = math.ceil(work / chunk) * step_s
    config = sched.config
    seats = len(sched.running) + len(sched.swapped) + len(ahead) + (1 if own_tokens else 0)
    seats -= config.max_num_seqs
    blocks = sum(cdiv(r.num_tokens, config.block_size) for r in ahead) + own_blocks
    blocks -= sched.num_free_blocks
    if seats <= 0 and blocks <= 0:
        return prefill + step_s / 2
    wait = 0.0
    finishing = sorted(sched.running, key=remaining_work)
    for r in finishing:
        seats -= 1
        blocks -= len(sched.kv.block_ids(r.request_id))
        wait = remaining_work(r) * step_s
        if seats <= 0 and blocks <= 0:
            break
    own = math.ceil(own_tokens / chunk) * step_s if own_tokens else step_s
    return max(prefill, wait + own) + step_s / 2


def first_token(sched: Scheduler, req: Request, now: float) -> float | None:
    """Seconds from `now` until `req`'s first token, were it queued now (None without a
    step-cost model)."""
    cost = sched.config.step_cost
    if cost is None:
        return None
    queue = sched.waiting
    mine = queue.rank(req, now)
    ahead = [r for r in queue if queue.rank(r, now) <= mine]
    own_blocks = cdiv(req.num_tokens, sched.config.block_size)
    return _serve_time(sched, ahead, req.num_tokens, own_blocks, cost)


def admitted_within(sched: Scheduler, count: int, now: float) -> float | None:
    """Seconds until the prefills of the `count` waiting requests the queue ranks first are
    done, by when they have left the queue (None without a step-cost model)."""
    cost = sched.config.step_cost
    if cost is None:
        return None
    queue = sched.waiting
    ahead = sorted(queue, key=lambda r: queue.rank(r, now))[:count]
    return _serve_time(sched, ahead, 0, 0, cost)
