"""`Scheduler`: continuous batching under a token budget and a paged-KV block budget.

Each `schedule()` call plans one step, in two phases:

1. Running requests, in admission order: a prefill chunk or one decode token each. When the
   block pool cannot serve one, preempt a victim chosen by the victim policy
   (`victims.VICTIM_KEYS`) and retry — possibly the request itself.
2. Only if nothing was preempted: swapped requests come back, then waiting requests are
   admitted head-of-line in the queue policy's order (`queues.make_waiting_queue`),
   counting prefix-cache hits as already computed.

With a step-time budget (`SchedulerConfig.max_step_ms`), phase 1 schedules every decode
before any prefill chunk, and `StepTimeBudget` sizes each chunk so that the step's predicted
time stays within the target while requests decode (scheduler/step_time_budget.py). Under
the slo policy a step's target is the tightest TPOT objective among the requests decoding
in it (`step_objective`, a firm target: the prefill share does not stretch it; shortened
by how far measured steps overrun the cost model at the tail), and `max_step_ms` where
none of them has one; the decodes of requests without a tight TPOT objective (`sits_out`)
join such a step only while it stays within that target, longest idle first, one always.

Every request's objectives are resolved on arrival (scheduler/slo.py); with a step-cost
model its first token is forecast then too (scheduler/forecast.py), and `admission_check`
says how long a request whose TTFT objective cannot be met would have to wait.

Plans are published before the previous plan's output is applied (two in flight): a request
that will sample counts a *placeholder* token until `update_from_output` delivers it.
"""

from __future__ import annotations

import itertools
import time

from common.arith import cdiv
from scheduler.config import SchedulerConfig
from scheduler.fairness import FairnessMeter
from scheduler.finishing import request_output, stop_status
from scheduler.forecast import admitted_within, first_token
from scheduler.kv_manager import KVCacheManager
from scheduler.output import ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.predictor import make_predictor
from scheduler.queues import PriorityQueue, WaitingQueue, make_waiting_queue, prefill_time_of
from scheduler.request import Request, RequestStatus
from scheduler.slo import slack
from scheduler.stats import SchedulerStats
from scheduler.step import Preemption, StepBuilder
from scheduler.step_cost import BatchShape, overrun_of
from scheduler.step_time_budget import StepTimeBudget
from scheduler.victims import pick_victim, swap_is_cheaper

# A request whose TPOT objective is at least this many times the tightest one decoding may
# sit out steps held to the tightest: a gap of two such steps still meets its own objective.
LOOSE_TPOT_FACTOR = 2.0


class Scheduler:
    """Implements `scheduler.interface.SchedulerInterface`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config)
        self.fairness_meter = FairnessMeter(config.fair_prompt_weight, config.fair_output_weight)
        self.predictor = make_predictor(config.output_len_predictor)
        self.waiting: WaitingQueue = make_waiting_queue(config, self.fairness_meter)
        self.running: list[Request] = []  # admission order: the newest is last
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request
        self._known_to_worker: set[str] = set()
        self._finished_ids: set[str] = set()  # since the last plan
        self._aborted_ids: set[str] = set()
        self._expect_sample: dict[int, list[str]] = {}  # step id -> ids that sample
        self._step_ids = itertools.count()
        self._admit_seq = itertools.count()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_tokens = 0  # computed tokens whose KV recompute preemptions dropped
        self._last_step = (0, 0, 0)  # requests, prefill tokens, decode tokens
        self.last_preemptions: tuple[Preemption, ...] = ()  # of the last plan, for the live view
        self._last_shape = BatchShape()  # the last plan's, for the step-cost model
        self._prev_shape = BatchShape()  # the plan's before it (the forecast's plans in flight)
        cost, limit = config.step_cost, config.step_time_limit_s  # a limit > 0 implies a cost
        self._time = (StepTimeBudget(limit, cost, config.block_size, config.min_prefill_share,
                                     hold_prefill_only=config.holds_prefill_only_steps)
                      if cost is not None and limit > 0 else None)
        self._prefill_time = prefill_time_of(config)
        self._plan_time = 0.0  # `now` of the plan being built (victims' slack)
        # Forecast every arrival's first token where deadlines matter (O(waiting) each)
        self._forecasts = config.scheduling_policy == "slo" or config.reject_unmeetable

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        total = request.max_total_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {total} exceeds max_model_len "
                f"({self.config.max_model_len})"
            )
        if cdiv(total, self.config.block_size) > self.config.num_gpu_blocks:
            raise ValueError(
                f"request {rid!r} needs {cdiv(total, self.config.block_size)} KV blocks, more than "
                f"the {self.config.num_gpu_blocks} the cache has"
            )
        request.status = RequestStatus.WAITING
        self._prepare(request)
        if request.predicted_ttft is None and self._forecasts:
            request.predicted_ttft = first_token(self, request, request.arrival_time)
        self.requests[rid] = request
        self.waiting.push(request)

    def _prepare(self, request: Request) -> None:
        """What a request needs before it can be ranked: its objectives and predicted length."""
        if not request.slo_resolved:
            classes = self.config.slo_classes
            request.slo = classes.resolve(request.slo, request.tenant, request.priority)
            request.slo_resolved = True
        if request.predicted_output_tokens is None:
            request.predicted_output_tokens = self.predictor.predict(request)

    def admission_check(self, request: Request, now: float | None = None) -> float | None:
        """With `reject_unmeetable`: seconds until `request`'s TTFT objective could be met,
        when the forecast says it cannot be met now (None: it can, it has no TTFT objective,
        or the check is off). Sets `request.predicted_ttft`; changes nothing else."""
        if not self.config.reject_unmeetable:
            return None
        now = self._now(now)
        self._prepare(request)
        forecast = first_token(self, request, now)
        request.predicted_ttft = forecast
        ttft = request.slo.ttft_s
        if forecast is None or ttft is None or forecast <= ttft:
            return None
        return forecast - ttft

    def admission_wait(self, count: int, now: float | None = None) -> float | None:
        """Predicted seconds until `count` waiting requests have left the queue (a full
        queue's 429 `Retry-After`); None without a step-cost model."""
        return admitted_within(self, count, self._now(now))

    def plans_in_flight(self) -> tuple[BatchShape, BatchShape]:
        """The shapes of the last two plans: the one before the last (executing, in the
        engine, which keeps two plans in flight) and the last (queued behind it)."""
        return self._prev_shape, self._last_shape

    def step_target(self) -> float | None:
        """The target the next step's time is held to (None: no time budget): the step's
        objective (`step_objective`) where it has one, else `max_step_ms`."""
        if self._time is None:
            return None
        objective = self.step_objective()
        return self._time.target if objective is None else objective

    def step_objective(self) -> float | None:
        """Under the slo policy, the tightest TPOT objective (seconds) among the running
        requests that decode, divided by the cost model's tail overrun (`overrun_of`: a
        step predicted at the objective would run over it about half the time): the next
        step's firm target (see StepTimeBudget); else None."""
        tightest = self.tightest_tpot()
        return None if tightest is None else tightest / overrun_of(self.config.step_cost)

    def tightest_tpot(self) -> float | None:
        """Under the slo policy with a time budget, the tightest TPOT objective (seconds)
        among the running requests that decode; else None."""
        if self._time is None or self.config.scheduling_policy != "slo":
            return None
        tpots = [r.slo.tpot_s for r in self.running
                 if r.slo.tpot_s is not None and r.num_output_tokens + r.num_placeholders > 0]
        return min(tpots) if tpots else None

    @staticmethod
    def sits_out(req: Request, tightest: float) -> bool:
        """Whether decoding `req` may sit out a step held to the `tightest` TPOT objective:
        it has no TPOT objective, or one that a gap of two such steps still meets."""
        tpot = req.slo.tpot_s
        return req.num_output_tokens + req.num_placeholders > 0 and (
            tpot is None or tpot >= LOOSE_TPOT_FACTOR * tightest)

    def abort(self, request_id: str, now: float | None = None) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, RequestStatus.FINISHED_ABORTED, self._now(now))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.swapped or len(self.waiting))

    def needs_plan(self) -> bool:
        """True while a plan has something to do: requests to run, or finished/aborted ids
        the worker has not been told about yet (so that it can drop their state)."""
        return self.has_unfinished_requests() or bool(self._finished_ids or self._aborted_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.pool.num_free

    # ---- planning -----------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = self._plan_time = self._now(now)
        step = StepBuilder(next(self._step_ids), self.config.max_num_batched_tokens)
        if self._time is not None:
            self._time.begin_step(self.step_objective())
        later = self._schedule_running(step, now)
        if not step.preempted:
            self._schedule_swapped(step, now)
            self._schedule_waiting(step, now)
        if later:
            # after admissions: they must not evict a request admitted in this step; when
            # none was, they preempt as any running prefill does (else two running prompts
            # that between them hold every block would wait on each other for ever)
            self._schedule_deferred(step, later, preempt=not step.admitted)
        plan = step.build(self.kv.blocks, self._finished_ids, self._aborted_ids)
        self.last_preemptions = tuple(step.preemptions)
        self.kv.end_step()
        self._finished_ids, self._aborted_ids = set(), set()
        self._apply(step, now)
        return plan

    def _chunk(self, n: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold and n > threshold:
            n = threshold
        if n > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return n

    def _tokens_for(self, req: Request, budget: int) -> int:
        """Tokens to compute for a request this step; 0 when it must not run now."""
        end = req.num_tokens + req.num_placeholders
        if end - req.num_prompt_tokens >= req.sampling_params.max_tokens:
            return 0  # every token it may produce is already sampled or in flight
        if end >= self.config.max_model_len:
            return 0
        n = end - req.num_computed_tokens
        return n if n == 1 else self._chunk(n, budget)

    def _schedule_running(self, step: StepBuilder, now: float) -> list[Request]:
        """Every running request's decode, then (under the time budget) their prefill
        chunks: under `slo` in the queue's order (least slack first: a chat's next chunk
        goes before a batch prompt's, whichever was admitted first), else in the running
        order. Returns the running prefills to size after the waiting requests: under
        `slo`, those the queue ranks behind its head (a chat's first chunk goes before a
        batch prompt's next one, as it would had both waited)."""
        deferred: list[Request] = []  # prefills under the time budget: sized after every decode
        loose: list[Request] = []  # decodes that may sit out this step (slo)
        tightest = self.tightest_tpot()
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            n = self._tokens_for(req, step.budget)
            if n > 1 and self._time is not None:
                deferred.append(req)
                n = 0
            elif n == 1 and tightest is not None and self.sits_out(req, tightest):
                loose.append(req)
                n = 0
            if n == 0:
                i += 1
                continue
            scheduled, shift = self._fit(req, n, step, i)
            i += int(scheduled) - shift
        if loose:
            # the guaranteed prefill block comes after the longest running context that
            # waits to prefill (an arrival's, from the start)
            waits = bool(len(self.waiting)) or bool(self.swapped)
            context = max((r.num_computed_tokens for r in deferred), default=0 if waits else None)
            self._schedule_loose(step, loose, context)
        later: list[Request] = []
        if deferred and self.config.scheduling_policy == "slo":
            deferred.sort(key=lambda r: self._urgency(r, now))
            if len(self.waiting):
                head = self._urgency(self.waiting.peek(now), now)
                now_or_later: tuple[list[Request], list[Request]] = ([], later)
                for r in deferred:
                    now_or_later[self._urgency(r, now) > head].append(r)
                deferred = now_or_later[0]
        if deferred:
            self._schedule_deferred(step, deferred)
        return later

    def _schedule_loose(
        self, step: StepBuilder, loose: list[Request], prefill_context: int | None
    ) -> None:
        """Under slo, the decodes that may sit out a step held to a TPOT objective join it
        longest-idle first while it stays within its limit (less one block of prefill after
        `prefill_context` tokens, when prefill waits), and at least one joins: each of them
        keeps decoding."""
        time_budget = self._time
        assert time_budget is not None  # loose decodes exist only under a time budget
        loose.sort(key=lambda r: r.last_step)
        contexts = [r.num_computed_tokens for r in loose]
        k = time_budget.loose_decodes(step, contexts, prefill_context)
        for req in loose[:k]:
            if req.status == RequestStatus.RUNNING and step.budget > 0:
                self._fit(req, 1, step, 0)

    def _schedule_deferred(
        self, step: StepBuilder, prefills: list[Request], preempt: bool = True
    ) -> None:
        """Running prefills under the time budget, once the step holds every decode;
        without `preempt`, a chunk whose blocks are not free waits for a later step."""
        time_budget = self._time
        assert time_budget is not None  # only the time budget defers prefills
        for req in prefills:
            if step.budget <= 0:
                return
            if req.status != RequestStatus.RUNNING:
                continue  # preempted by an earlier request of this step
            n = self._tokens_for(req, step.budget)
            end = req.num_tokens + req.num_placeholders
            n = time_budget.chunk(step, req.num_computed_tokens, n, end) if n else 0
            if n:
                self._fit(req, n, step, 0, preempt)

    def _fit(self, req: Request, n: int, step: StepBuilder, position: int,
             preempt: bool = True) -> tuple[bool, int]:
        """Schedule `n` tokens of running `req`, preempting victims until its blocks fit
        (without `preempt`, only if they are free). Returns whether it was scheduled (it may
        be the victim itself) and how many of the preempted requests stood before
        `position` in the running list."""
        shift = 0
        while True:
            new = self.kv.allocate_slots(req, n)
            if new is not None:
                step.add(req, n, new)
                return True, shift
            if not preempt:
                return False, shift
            victim = pick_victim(
                self.running, self.config.effective_victim_policy, self.kv.blocks_freed_by,
                self._victim_slack,
            )
            if self.running.index(victim) < position - shift:
                shift += 1
            self._preempt(victim, step, "kv", req.request_id)
            if victim is req:
                return False, shift

    def _schedule_swapped(self, step: StepBuilder, now: float) -> None:
        while self.swapped and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = min(self.swapped, key=lambda r: self._urgency(r, now))
            n = self._tokens_for(req, step.budget) if req.num_placeholders == 0 else 0
            if n and self._time is not None:
                n = self._time.admit(step, req.num_computed_tokens, n, req.num_tokens,
                                     len(self.kv.host_blocks[req.request_id]))
            res = self.kv.swap_in(req, n) if n else None
            if res is None:
                return
            pairs, table = res
            self.swapped.remove(req)
            step.swap_in.extend(pairs)
            step.resumed.add(req.request_id)
            self._admit(req, step)
            step.add(req, n, table)

    def _schedule_waiting(self, step: StepBuilder, now: float) -> None:
        while len(self.waiting) and step.budget > 0:
            req = self.waiting.peek(now)
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_for_priority(req, step, now):
                    continue
                return
            if req.num_placeholders or req.request_id in step.preempted:
                return  # tokens still in flight, or just preempted: strict head-of-line
            hits = self.kv.find_cached_prefix(req)
            n = self._chunk(req.num_tokens - len(hits) * self.config.block_size, step.budget)
            if n and self._time is not None:
                n = self._time.admit(step, len(hits) * self.config.block_size, n, req.num_tokens)
            new = self.kv.allocate_slots(req, n, hits) if n else None
            if new is None:
                if n and self._preempt_for_priority(req, step, now):
                    continue
                return
            self.waiting.pop(now)
            hit_tokens = len(hits) * self.config.block_size
            if self.kv.pool.enable_caching:
                self.kv.record_lookup(req.num_tokens, hit_tokens)
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_prompt_tokens = hit_tokens
            req.num_computed_tokens = hit_tokens
            rid = req.request_id
            (step.resumed if rid in self._known_to_worker else step.new_reqs).add(rid)
            self._admit(req, step)
            step.add(req, n, new)
            self.fairness_meter.charge(req, hit_tokens + n, samples=False)  # the next pick sees it
            # Cache now, so that a sibling admitted later in this step shares these blocks:
            # the worker writes every new KV entry of a layer before attending. Safe because
            # a request admitted here is never unscheduled in the same step.
            self.kv.cache_full_blocks(req, hit_tokens + n)

    def _admit(self, req: Request, step: StepBuilder) -> None:
        req.status = RequestStatus.RUNNING
        req.admit_seq = next(self._admit_seq)
        self.running.append(req)
        step.admitted.add(req.request_id)

    def _apply(self, step: StepBuilder, now: float) -> None:
        """Advance the requests by what the frozen plan computes."""
        sampling: list[str] = []
        prefill = decode = 0
        kv_read = pairs = decodes = decode_kv = 0  # the step's shape (decodes: one token, sampled)
        for rid, (req, n) in step.scheduled.items():
            ctx = req.num_computed_tokens
            if n == 1 and req.num_output_tokens + req.num_placeholders > 0:
                decode += 1
            else:
                prefill += n
            kv_read += ctx + n
            pairs += n * ctx + n * (n + 1) // 2
            samples = ctx + n == req.num_tokens + req.num_placeholders
            if samples:
                req.num_placeholders += 1
                sampling.append(rid)
                if n == 1:
                    decodes += 1
                    decode_kv += ctx + 1
            self.fairness_meter.charge(req, ctx + n, samples)
            req.num_computed_tokens = ctx + n
            req.last_step = step.step_id
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self._known_to_worker.add(rid)
            self.kv.cache_full_blocks(req)
        if sampling:  # an empty plan may be dropped unsent; it must leave nothing behind
            self._expect_sample[step.step_id] = sampling
        self._last_step = (len(step.scheduled), prefill, decode)
        self._prev_shape = self._last_shape
        self._last_shape = BatchShape(len(step.scheduled), prefill + decode - decodes, decodes,
                                      len(sampling), pairs, kv_read,
                                      len(step.swap_in) + len(step.swap_out))
        if self._time is not None and decodes:
            self._time.count_decodes(decodes, decode_kv)

    # ---- preemption ---------------------------------------------------------------------
    def _victim_slack(self, req: Request) -> float:
        return slack(req, self._plan_time, self._prefill_time, preempting=True)

    def _urgency(self, req: Request, now: float) -> tuple[float, float]:
        return self.waiting.rank(req, now)

    def _preempt_for_priority(self, req: Request, step: StepBuilder, now: float) -> bool:
        """Preempt the least urgent running request if `req` beats it by the threshold.
        Both sides are compared by *effective* (aged) priority: comparing an aged waiting
        request with a running one's base priority would let two requests evict each other
        forever."""
        threshold = self.config.priority_preemption_threshold
        if threshold is None or not isinstance(self.waiting, PriorityQueue):
            return False
        candidates = [r for r in self.running if r.request_id not in step.admitted]
        if not candidates:
            return False
        eff = self.waiting.effective_priority
        victim = max(candidates, key=lambda r: (eff(r, now), r.arrival_time, r.admit_seq))
        if eff(req, now) > eff(victim, now) - threshold:
            return False
        self._preempt(victim, step, "priority", req.request_id)
        return True

    def _preempt(self, victim: Request, step: StepBuilder, reason: str, by: str) -> None:
        step.unschedule(victim)
        self.running.remove(victim)
        mode = self.config.preemption_mode
        swap = mode == "swap" or (
            mode == "auto" and swap_is_cheaper(self.config, victim.num_computed_tokens)
        )
        if swap and self.kv.can_swap_out(victim):
            step.swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.num_swap_preemptions += 1
            how = "swap"
        else:
            how = "recompute"
            self.kv.free(victim)
            self.num_recompute_tokens += victim.num_computed_tokens
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self.waiting.push_front(victim)
        step.preempted.add(victim.request_id)
        step.preemptions.append(Preemption(victim.request_id, reason, how, by))
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1

    # ---- outputs ------------------------------------------------------------------------
    def update_from_output(
        self, plan: SchedulerOutput, output: ModelRunnerOutput, now: float | None = None
    ) -> list[RequestOutput]:
        if output.step_id != plan.step_id:
            raise ValueError(f"output of step {output.step_id} applied to plan {plan.step_id}")
        now = self._now(now)
        outs: list[RequestOutput] = []
        for rid in self._expect_sample.pop(plan.step_id, ()):
            req = self.requests.get(rid)
            if req is None:
                continue  # finished or aborted after this plan went out: discard
            req.num_placeholders -= 1
            token = output.sampled_token_ids.get(rid)
            if token is None or output.error is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED, now)
                outs.append(request_output(req, None, output))
                continue
            req.append_output(token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            status = stop_status(req, token, self.config.max_model_len)
            if status is not None:
                self._finish(req, status, now)
            elif req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)
            outs.append(request_output(req, token, output))
        return outs

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.predictor.observe(req)
        self.fairness_meter.refund_samples(req, req.num_placeholders)  # in flight, to be discarded
        req.status = status
        req.metrics.finished_time = now
        self.kv.free(req)
        rid = req.request_id
        del self.requests[rid]
        if rid in self._known_to_worker:
            self._known_to_worker.discard(rid)
            aborted = status == RequestStatus.FINISHED_ABORTED
            (self._aborted_ids if aborted else self._finished_ids).add(rid)

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        reqs, prefill, decode = self._last_step
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.pool.num_free,
            num_gpu_blocks=self.config.num_gpu_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_swap_preemptions=self.num_swap_preemptions,
            step_num_reqs=reqs,
            step_prefill_tokens=prefill,
            step_decode_tokens=decode,
            num_recompute_tokens=self.num_recompute_tokens,
            output_len_predictions_scored=self.predictor.error.count,
            output_len_prediction_abs_error=self.predictor.error.abs_sum,
            step_shape=self._last_shape,
            num_time_capped_chunks=self._time.num_capped if self._time else 0,
            num_decode_over_target=self._time.num_decode_over_target if self._time else 0,
            step_time_limit=self._time.last_limit if self._time else 0.0,
        )

    def check_integrity(self) -> None:
        """free + held == total, ref counts == holders, queues hold exactly the live requests."""
        live = set(self.requests)
        self.kv.check_integrity(live)
        queued = [*self.running, *self.swapped, *self.waiting]
        assert len(queued) == len(live) == len({r.request_id for r in queued}), "queues out of sync"
        for req in self.running:
            held = len(self.kv.block_ids(req.request_id))
            assert held >= cdiv(req.num_computed_tokens, self.config.block_size), (
                f"{req.request_id} short of blocks"
            )
            assert req.status == RequestStatus.RUNNING
        for req in self.waiting:
            assert req.request_id not in self.kv.blocks, f"waiting {req.request_id} holds blocks"

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now
