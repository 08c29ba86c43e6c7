"""Step records: what one scheduler step did, as JSON-ready dicts. One format for the live
view (`service/step_records.py` streams them) and the simulator's timeline files
(`loadgen/sim/timeline.py` writes them); docs/step_records.md describes every field.

`StepRecorder` builds a record in two halves, as the engine learns them::

    on_plan(plan, now)                   composition: decodes, prefill chunks, admissions,
                                         preemptions (victim, reason), queues, KV counts,
                                         and now and then the block map
    on_output(plan, outputs, now, ...)   step and execute time, tokens emitted, first
                                         tokens, finishes  -> the finished record

Keys holding their empty value may be left out (`compact`); readers fill them back in.
A record holds request ids, counts and block ids: never prompt or output text or token
ids. Building one costs O(requests in the step); the block map (who holds each block,
O(held + free blocks)) is only taken when the plan changed a block table and no sooner
than `map_interval` seconds (or 200x its own build time) after the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from scheduler.output import RequestOutput, SchedulerOutput
from scheduler.scheduler import Scheduler

RECORD_VERSION = 1
MAP_COST_RATIO = 200  # a block map costs at most 1/200 of the wall time between maps
_MAX_PENDING = 8  # plans recorded but never answered (a simulator drops its last one)

Record = dict[str, Any]
# A plan's predicted duration in seconds (the step-cost model), or None when it has none.
Predictor = Callable[[SchedulerOutput], float | None]


def empty_record(step: int) -> Record:
    """Every key a step record has, with its empty value (docs/step_records.md)."""
    return {
        "type": "step", "step": step, "t": 0.0,
        "step_ms": None, "execute_ms": None, "predicted_ms": None,
        "decode": [], "prefill": [], "padding": [], "padded_tokens": 0,
        "new": [], "resumed": [], "swapped_in": [], "preempted": [], "aborted": [],
        "tokens": 0, "first": [], "finished": [],
        "swap_out": 0, "swap_in": 0,
        "running": 0, "waiting": 0, "swapped": 0,
        "kv": [0, 0, 0],
        "blocks": None,
    }


_EMPTY = empty_record(0)
_KEEP = frozenset(("type", "step", "t"))


def compact(rec: Record) -> Record:
    """`rec` without the keys that hold their empty value (readers fill them back in)."""
    return {k: v for k, v in rec.items() if k in _KEEP or v != _EMPTY[k]}


def hello(num_blocks: int, block_size: int, token_budget: int | None, **extra: Any) -> Record:
    """The first message of a stream or run: what every record that follows refers to."""
    return {"type": "hello", "version": RECORD_VERSION, "num_blocks": num_blocks, "block_size": block_size,
            "token_budget": token_budget, "time_target_ms": None, **extra}


def scheduler_hello(sched: Scheduler, **extra: Any) -> Record:
    """`hello` for a run of the real scheduler."""
    c = sched.config
    return hello(c.num_gpu_blocks, c.block_size, c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                 policy=c.policy, preemption_mode=c.preemption_mode,
                 prefix_caching=c.enable_prefix_caching, **extra)


def block_map_of(sched: Scheduler) -> dict[str, Any]:
    """The KV block map as a record carries it: tables, shared blocks, cached free blocks."""
    m = sched.kv.block_map()
    return {"tables": m.tables, "shared": [[b, rc] for b, rc in m.shared.items()], "cached": m.cached_free}


class StepRecorder:
    """Builds one record per plan of `sched` (see the module docstring)."""

    def __init__(self, sched: Scheduler, epoch: float = 0.0, map_interval: float = 0.0,
                 predictor: Predictor | None = None) -> None:
        self.sched = sched
        self.epoch = epoch  # times in records are seconds since this clock value
        self.map_interval = map_interval
        self.predictor = predictor
        self._pending: dict[int, Record] = {}
        self._prompt_len: dict[str, int] = {}  # of requests seen in plans, until they end
        self._map_dirty = True
        self._next_map = 0.0

    def state(self) -> Record:
        """Queues, KV counts and the block map right now (a viewer's starting point)."""
        rec = {"running": 0, "waiting": 0, "swapped": 0, "kv": [0, 0, 0], "blocks": block_map_of(self.sched)}
        self._counts(rec)
        return rec

    def reset(self) -> None:
        """Forget what was recorded (nobody listens any more: finishes would go unseen)."""
        self._pending.clear()
        self._prompt_len.clear()
        self.force_map()

    def force_map(self) -> None:
        """Take the block map with the next plan (a new viewer needs a full picture)."""
        self._map_dirty, self._next_map = True, 0.0

    def on_plan(self, plan: SchedulerOutput, now: float) -> None:
        """Record a plan's composition, just after `schedule()` returned it."""
        rec = empty_record(plan.step_id)
        changed = self._composition(plan, rec)
        rec["preempted"] = [list(p) for p in self.sched.last_preemptions]
        rec["aborted"] = sorted(plan.aborted_req_ids)
        for rid in plan.aborted_req_ids:
            self._prompt_len.pop(rid, None)
        rec["swap_out"], rec["swap_in"] = len(plan.swap_out), len(plan.swap_in)
        self._counts(rec)
        if self.predictor is not None:
            predicted = self.predictor(plan)
            rec["predicted_ms"] = None if predicted is None else round(predicted * 1e3, 4)
        self._map_dirty |= changed or bool(plan.preempted_req_ids or plan.finished_req_ids or plan.aborted_req_ids)
        if self._map_dirty and (now >= self._next_map or not self.sched.has_unfinished_requests()):
            self._take_map(rec, now)
        self._pending[plan.step_id] = rec
        if len(self._pending) > _MAX_PENDING:
            del self._pending[min(self._pending)]

    def on_output(self, plan: SchedulerOutput, outputs: Sequence[RequestOutput], now: float,
                  step_seconds: float | None, execute_seconds: float | None = None) -> Record | None:
        """Complete the plan's record with what its output did; None if it was not recorded."""
        rec = self._pending.pop(plan.step_id, None)
        if rec is None:
            return None
        rec["t"] = round(now - self.epoch, 6)
        rec["step_ms"] = None if step_seconds is None else round(step_seconds * 1e3, 4)
        rec["execute_ms"] = round(execute_seconds * 1e3, 4) if execute_seconds else None
        tokens, first, finished = 0, rec["first"], rec["finished"]
        for out in outputs:
            n = len(out.new_token_ids)
            if n:
                tokens += n
                if out.num_output_tokens == n:
                    first.append(out.req_id)
            if out.finished:
                finished.append([out.req_id, out.finish_reason])
                self._prompt_len.pop(out.req_id, None)
        rec["tokens"] = tokens
        if finished and not self.sched.has_unfinished_requests():
            self._counts(rec)  # the last request left: show the pool as it left it
            self._take_map(rec, now)
        return rec

    def _composition(self, plan: SchedulerOutput, rec: Record) -> bool:
        """Fill decode / prefill / new / resumed / swapped_in; True if a block table changed."""
        counts, prompt_len = plan.num_scheduled_tokens, self._prompt_len
        decode, prefill, changed = rec["decode"], rec["prefill"], bool(plan.scheduled_new_reqs)
        for d in plan.scheduled_cached_reqs:  # the hot loop: one decode per running request
            rid, n, ctx = d.req_id, counts[d.req_id], d.num_computed_tokens
            if d.new_block_ids:
                changed = True
                if d.resumed_from_preemption:
                    self._resumed(plan, d.req_id, d.new_block_ids[0], rec)
            elif d.resumed_from_preemption:
                rec["resumed"].append(rid)
            p = prompt_len.get(rid)
            if p is None:
                req = self.sched.requests.get(rid)
                p = prompt_len[rid] = len(req.prompt_token_ids) if req is not None else 0
            if n == 1 and ctx >= p:
                decode.append(rid)
            else:
                prefill.append([rid, n, ctx])
        for new in plan.scheduled_new_reqs:
            rid, num_prompt = new.req_id, len(new.prompt_token_ids)
            prompt_len[rid] = num_prompt
            prefill.append([rid, counts[rid], new.num_computed_tokens])
            req = self.sched.requests.get(rid)
            arrival = round(req.arrival_time - self.epoch, 6) if req is not None else None
            rec["new"].append([rid, arrival, num_prompt, new.num_computed_tokens])
        return changed

    @staticmethod
    def _resumed(plan: SchedulerOutput, rid: str, first_block: int, rec: Record) -> None:
        swapped = any(dev == first_block for _, dev in plan.swap_in)
        (rec["swapped_in"] if swapped else rec["resumed"]).append(rid)

    def _counts(self, rec: Record) -> None:
        s, pool = self.sched, self.sched.kv.pool
        rec["running"], rec["waiting"], rec["swapped"] = len(s.running), len(s.waiting), len(s.swapped)
        cached = pool.num_cached_free
        rec["kv"] = [pool.num_used, cached, pool.num_free - cached]

    def _take_map(self, rec: Record, now: float) -> None:
        start = time.perf_counter()
        rec["blocks"] = block_map_of(self.sched)
        cost = time.perf_counter() - start
        self._map_dirty = False
        self._next_map = now + max(self.map_interval, cost * MAP_COST_RATIO) if self.map_interval else now
