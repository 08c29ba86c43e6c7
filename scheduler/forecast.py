"""Forecasts of waiting: when a request queued now would see its first token
(`first_token`), and when the first k waiting requests will have been admitted
(`admitted_within`). The slo policy's admission check and the server's 429 `Retry-After`
read them; the metrics compare the first-token forecast with what happened.

The model, from what the scheduler holds now and its step-cost model::

    work ahead  = prompt tokens still to compute of the running requests (under slo, of
                  those the queue ranks before it: the others' chunks wait for its own),
                  of the waiting requests the queue ranks before it, and its own; a
                  waiting request's (and its own) past the prefix the cache holds for it
    demoted     = under slo, a waiting request ranked before it whose deadline is still
                  meetable but lost before the work ranked before that request is done:
                  it will be demoted behind this one, so it is not work ahead
    one step    = the running decodes + the longest prefill chunk the step's time limit
                  allows (the whole token budget when nothing decodes or there is no limit);
                  under slo, of the decodes that may sit out a step held to a TPOT
                  objective, those the scheduler lets in while prefill waits
    prefill     = ceil(work ahead / chunk) steps of that step's predicted time; the last
                  step's chunk is filled up with the work ranked behind it, as the
                  scheduler fills it
    seats       = when the running batch (max_num_seqs) or the KV pool has no room for the
                  requests ahead and this one, they are admitted one after another, each
                  when the seats and blocks it needs are free: the running requests free
                  theirs when they finish (by predicted output length), and each request
                  admitted ahead frees its own once it has decoded its predicted outputs
                  (decode-only steps: nothing new prefills while there is no room); this
                  one prefills from its own admission
    yielding    = under the `slack` victim policy, the KV blocks of running requests (not
                  the oldest) with more slack, after their own recompute, than this
                  request has: when the pool runs short they are preempted first and
                  queue behind it, so it does not wait for them to finish
    in flight   = while requests run, the plans already made: the engine keeps two in
                  flight, so a request queued now enters the plan after the one already
                  queued (its whole predicted time), while the one executing is (on
                  average) half done
    forecast    = max(prefill, seats + its own prefill) + in flight

It assumes nobody more urgent arrives meanwhile, and a waiting request's prefix-cache hit
as it was when first forecast (a hit evicted, or grown, since is not foreseen): a forecast
of the queue as it stands.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.arith import cdiv
from scheduler.queues import SLOQueue, prefill_time_of
from scheduler.request import Request
from scheduler.slo import slack
from scheduler.step_cost import BatchShape, StepCostFn
from scheduler.step_time_budget import fitting_decodes, loose_cap, step_limit

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def _samples_left(req: Request) -> int:
    """Steps until it finishes: the outputs it is predicted to sample still (at least one)."""
    predicted = req.predicted_output_tokens or req.sampling_params.max_tokens
    return max(predicted - req.num_output_tokens - req.num_placeholders, 1)


def _prefill_left(req: Request) -> int:
    """Tokens to compute before its next sample, when that is a prefill (0 for a decode)."""
    n = req.num_tokens + req.num_placeholders - req.num_computed_tokens
    return n if n > 1 else 0


def _todo(sched: Scheduler, r: Request) -> int:
    """Tokens a waiting request has to compute: past what it computed, and past the prefix
    the cache held for it when a forecast first looked (looked up again after a preemption
    or once its tokens change: a lookup walks every cached block of the prompt, and a
    forecast reads every waiting request)."""
    key = (r.num_tokens, r.metrics.num_preemptions)
    if r.forecast_hit[:2] != key:
        r.forecast_hit = (*key, len(sched.kv.find_cached_prefix(r)) * sched.config.block_size)
    return max(r.num_tokens - max(r.num_computed_tokens, r.forecast_hit[2]), 0)


class _Steps:
    """Steps as they run now: the running decodes plus prefill chunks of up to `chunk`
    tokens, the longest the step's time limit allows (the token budget where there is no
    limit, or nothing decodes and the config does not hold prefill-only steps), and the
    time of the plans already in flight."""

    def __init__(self, sched: Scheduler, cost: StepCostFn) -> None:
        self.cost = cost
        self.decodes = BatchShape()
        tightest = sched.tightest_tpot()
        loose: list[Request] = []  # decodes that may sit out a step (the scheduler's rule)
        for r in sched.running:
            if _prefill_left(r):
                continue
            if tightest is not None and sched.sits_out(r, tightest):
                loose.append(r)
            else:
                self.decodes.add(1, r.num_computed_tokens)
        config = sched.config
        budget = max(config.max_num_batched_tokens - self.decodes.num_decode_tokens, 1)
        target = sched.step_target()
        limit = math.inf
        held = config.holds_prefill_only_steps
        if target is not None and (self.decodes.num_decode_tokens or held):
            firm = sched.step_objective() is not None
            decode_s = cost(self.decodes) if self.decodes.num_decode_tokens else 0.0
            limit = step_limit(target, decode_s, config.min_prefill_share, firm)
        if loose:  # those that join a step while prefill waits (the arrival's does)
            loose.sort(key=lambda r: r.last_step)
            contexts = [r.num_computed_tokens for r in loose]
            context = max((r.num_computed_tokens for r in sched.running if _prefill_left(r)),
                          default=0)
            cap = loose_cap(cost, self.decodes, limit, config.block_size, context)
            for ctx in contexts[:fitting_decodes(cost, self.decodes, contexts, cap)]:
                self.decodes.add(1, ctx)
            budget = max(config.max_num_batched_tokens - self.decodes.num_decode_tokens, 1)
        if self.time(budget) <= limit:
            self.chunk = budget
        else:
            lo, hi = min(config.block_size, budget), budget  # the step's one guaranteed chunk
            while lo < hi:  # the longest chunk within the limit
                mid = (lo + hi + 1) // 2
                if self.time(mid) <= limit:
                    lo = mid
                else:
                    hi = mid - 1
            self.chunk = lo
        # the plans ahead of any arrival's first chunk while requests run: the queued one
        # and half the executing one, as planned (a full chunk of the waiting work would
        # overprice them where the KV pool admits none of it)
        self.in_flight = 0.0
        if sched.running:
            executing, queued = sched.plans_in_flight()
            for shape, share in ((executing, 0.5), (queued, 1.0)):
                if shape.num_tokens:
                    self.in_flight += share * cost(shape)

    def time(self, chunk: int) -> float:
        """One step's predicted time with a prefill chunk of `chunk` tokens (0: none)."""
        shape = self.decodes.copy()
        if chunk:
            shape.add(chunk, 0, samples=False)
        return self.cost(shape)

    def prefill(self, tokens: int, fill: int = 0) -> float:
        """Seconds of steps until `tokens` of prefill are computed, where `fill` tokens
        more wait behind them to fill the last step's chunk."""
        full, rest = divmod(tokens, self.chunk)
        last = self.time(min(rest + fill, self.chunk)) if rest else 0.0
        return full * self.time(self.chunk) + last


def _yielding(sched: Scheduler, now: float, own_slack: float | None) -> frozenset[str]:
    """Ids of the running requests that the `slack` victim policy would preempt before a
    request with `own_slack` seconds to spare waits for their blocks (none under the
    other victim policies, or for a request without a TTFT objective)."""
    if own_slack is None or sched.config.effective_victim_policy != "slack":
        return frozenset()
    running = sched.running
    if len(running) < 2:
        return frozenset()
    oldest = min(running, key=lambda r: r.admit_seq)  # never the victim (PROTECT_OLDEST)
    prefill_time = prefill_time_of(sched.config)
    return frozenset(
        r.request_id for r in running
        if r is not oldest and slack(r, now, prefill_time, preempting=True) > own_slack
    )


def _serve_time(sched: Scheduler, ahead: Sequence[Request], own_tokens: int, own_blocks: int,
                cost: StepCostFn, steps: _Steps, yielding: frozenset[str] = frozenset(),
                behind: frozenset[str] = frozenset()) -> float:
    """Seconds until the prefills of the running requests (but those in `behind`),
    `ahead`, and `own_tokens` more are done, where the running requests in `yielding` give
    up their blocks when asked (see the module docstring)."""
    work = sum(_prefill_left(r) for r in sched.running if r.request_id not in behind)
    work += sum(_todo(sched, r) for r in ahead)
    later = sum(_prefill_left(r) for r in sched.running if r.request_id in behind)
    queued = {id(r) for r in ahead}
    later += sum(_todo(sched, r) for r in sched.waiting if id(r) not in queued)
    in_flight = steps.in_flight
    work += own_tokens
    prefill = steps.prefill(work, later)
    config = sched.config
    seats = len(sched.running) + len(sched.swapped) + len(ahead) + (1 if own_tokens else 0)
    seats -= config.max_num_seqs
    blocks = sum(cdiv(r.num_tokens, config.block_size) for r in ahead) + own_blocks
    blocks -= sched.num_free_blocks
    blocks -= sum(sched.kv.blocks_freed_by(r) for r in sched.running if r.request_id in yielding)
    if seats <= 0 and blocks <= 0:
        return prefill + in_flight
    wait = _room_time(sched, ahead, own_blocks, steps.time(0), yielding)
    return max(prefill, wait + steps.prefill(own_tokens, later)) + in_flight


def _room_time(sched: Scheduler, ahead: Sequence[Request], own_blocks: int, decode_s: float,
               yielding: frozenset[str]) -> float:
    """Seconds until a request needing `own_blocks` is admitted behind `ahead`, when seats
    or blocks are short: each request is admitted, in order, once a seat and its blocks are
    free; the running requests free theirs when they finish, and each one admitted frees
    its own once it has decoded its predicted outputs, in steps of `decode_s` (the running
    requests in `yielding` give up their blocks at once, their seats when they finish)."""
    config = sched.config
    free = sched.num_free_blocks
    seats = config.max_num_seqs - len(sched.running) - len(sched.swapped)
    frees: list[tuple[float, int, int]] = []  # (seconds from now, blocks, seats) freed then
    for r in sched.running:
        blocks = len(sched.kv.block_ids(r.request_id))
        if r.request_id in yielding:
            free, blocks = free + sched.kv.blocks_freed_by(r), 0
        frees.append((_samples_left(r) * decode_s, blocks, 1))
    heapq.heapify(frees)
    now = 0.0
    queue = [(cdiv(r.num_tokens, config.block_size), _samples_left(r)) for r in ahead]
    for need, outputs in [*queue, (own_blocks, 0)]:
        while (free < need or seats < 1) and frees:
            now, blocks, seat = heapq.heappop(frees)
            free, seats = free + blocks, seats + seat
        free, seats = free - need, seats - 1
        if outputs:
            heapq.heappush(frees, (now + outputs * decode_s, need, 1))
    return now


def _not_demoted(sched: Scheduler, queue: SLOQueue, ahead: Sequence[Request], mine: float,
                 now: float, steps: _Steps, behind: frozenset[str]) -> list[Request]:
    """Those of `ahead` (in queue order) that still rank before a request whose key is
    `mine` when their turn comes: one whose deadline is meetable now but lost before the
    work ranked before it is done is demoted (key + demotion_s), behind `mine` if that is
    later, and leaves the way free."""
    work = sum(_prefill_left(r) for r in sched.running if r.request_id not in behind)
    kept = []
    for r in sorted(ahead, key=lambda r: queue.rank(r, now)):
        start = queue.latest_start(r)
        if (start is not None and start >= now and start + queue.demotion_s > mine
                and now + steps.in_flight + steps.prefill(work) > start):
            continue
        kept.append(r)
        work += _todo(sched, r)
    return kept


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
    ttft = req.slo.ttft_s
    own_slack = None if ttft is None else ttft - prefill_time_of(sched.config)(req.num_tokens)
    yielding = _yielding(sched, now, own_slack)
    behind: frozenset[str] = frozenset()
    if sched.config.scheduling_policy == "slo":  # their next chunks wait for this one's
        behind = frozenset(r.request_id for r in sched.running
                           if _prefill_left(r) and queue.rank(r, now) > mine)
    steps = _Steps(sched, cost)
    if isinstance(queue, SLOQueue):
        ahead = _not_demoted(sched, queue, ahead, mine[0], now, steps, behind)
    return _serve_time(sched, ahead, _todo(sched, req), own_blocks, cost, steps, yielding, behind)


def admitted_within(sched: Scheduler, count: int, now: float) -> float | None:
    """Seconds until the prefills of the `count` waiting requests the queue ranks first are
    done, by when they have left the queue (None without a step-cost model)."""
    cost = sched.config.step_cost
    if cost is None:
        return None
    queue = sched.waiting
    ahead = sorted(queue, key=lambda r: queue.rank(r, now))[:count]
    return _serve_time(sched, ahead, 0, 0, cost, _Steps(sched, cost))
