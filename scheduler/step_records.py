"""Step records: what one scheduler step did, as JSON-ready dicts. One format for the live
view (`service/engine/step_record_hub.py` streams them) and the simulator's timeline files
(`loadgen/sim/timeline.py` writes them); docs/step_records.md describes every field.

`StepRecorder` builds a record in two halves, as the engine learns them::

    on_plan(plan, now)                   composition: decodes, prefill chunks, admissions,
                                         preemptions (victim, reason), queues, KV counts,
                                         and now and then the block map
    on_output(plan, outputs, now, ...)   step and execute time, tokens emitted, first
                                         tokens, finishes  -> the finished record

Requests with objectives (`scheduler/slo.py`) are watched from their arrival (or a
viewer's first plan) until they end: their `new` entry (and the `requests` table of
`state()`) carries the objectives once; a record lists the deadlines lost since the last
one (`lost`: a request that had no first token by arrival + ttft, or fell behind its TPOT
schedule, first + tpot * outputs) and the slack of the requests in its step when it moved
by an eighth of the objective (`slack`). A request's deadline is judged when it is in a step,
and, between its steps (waiting for admission, preempted), by a heap of due times: the cost
stays O(requests in the step), plus O(log n) per arrival and per preemption.

Keys holding their empty value may be left out (`compact`); readers fill them back in.
A record holds request ids, counts and block ids: never prompt or output text or token
ids. With `short_ids` (the live stream) a request is named by a short key the recorder
assigns when it first sees it ("0", "1", ... "a", base 36); its `new` entry, and the
`requests` table of `state()`, pair the key with the request's id. Server ids are ~40
characters and a decode step names every running request, so keys cut a live record to a
fraction of its size (and of its cost to encode, send and read). Building one costs
O(requests in the step); the block map (who holds each block,
O(held + free blocks)) is only taken when the plan changed a block table and no sooner
than `map_interval` seconds (or 200x its own build time) after the last one.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, Protocol

from scheduler.output import RequestOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.slo import SLO, slack

RECORD_VERSION = 1
MAP_COST_RATIO = 200  # a block map costs at most 1/200 of the wall time between maps
_MAX_PENDING = 8  # plans recorded but never answered (a simulator drops its last one)
_SLACK_KEYS = 256  # keys of departed requests tolerated before a sweep
SLACK_STEPS = 8  # a request's slack is listed again when it moved by 1/8 of its objective
_TTFT, _TPOT = 1, 2  # the objectives a deadline is lost on (bits of `_Watch.lost`)
_OBJECTIVE = {_TTFT: "ttft", _TPOT: "tpot"}
_NEW_BLOCKS = attrgetter("new_block_ids")
_REQ_ID = attrgetter("req_id")

Record = dict[str, Any]


class Delivered(Protocol):
    """A step's output as its clients saw it (`service.engine.output_processor.StepDelivery`)."""

    tokens: int
    first: list[str]
    finished: list[tuple[str, str]]

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
        "running": 0, "waiting": 0, "swapped": 0, "waiting_for_grammar": 0,
        "kv": [0, 0, 0],
        "blocks": None,
        "slack": [], "lost": [],
    }


_EMPTY = empty_record(0)
_KEEP = frozenset(("type", "step", "t"))


def compact(rec: Record) -> Record:
    """`rec` without the keys that hold their empty value (readers fill them back in)."""
    return {k: v for k, v in rec.items() if k in _KEEP or v != _EMPTY[k]}


def hello(num_blocks: int, block_size: int, token_budget: int | None, **extra: Any) -> Record:
    """The first message of a stream or run: what every record that follows refers to."""
    return {
        "type": "hello",
        "version": RECORD_VERSION,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "token_budget": token_budget,
        "time_target_ms": None,
        **extra,
    }


def scheduler_hello(sched: Scheduler, **extra: Any) -> Record:
    """`hello` for a run of the real scheduler."""
    c = sched.config
    return hello(
        c.num_gpu_blocks, c.block_size, c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
        policy=c.scheduling_policy, preemption_mode=c.preemption_mode,
        prefix_caching=c.enable_prefix_caching, **extra,
    )


def block_map_of(sched: Scheduler, name: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The KV block map as a record carries it: tables, shared blocks, cached free blocks
    (tables keyed by `name(request id)` when given)."""
    m = sched.kv.block_map()
    tables = m.tables if name is None else {name(rid): t for rid, t in m.tables.items()}
    return {
        "tables": tables,
        "shared": [[b, rc] for b, rc in m.shared.items()],
        "cached": m.cached_free,
    }


def objectives(slo: SLO) -> dict[str, Any] | None:
    """A request's objectives as records carry them, ``{"ttft_ms", "tpot_ms", "class"}``
    without the objectives it has not (None: it has none)."""
    if slo.empty:
        return None
    out: dict[str, Any] = {k: v for k, v in slo.as_ms().items() if v is not None}
    out["class"] = slo.cls
    return out


class _Watch:
    """What the recorder knows of a request with objectives (see the module docstring)."""

    __slots__ = ("req", "tpot", "first", "outputs", "lost", "slack", "phase")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.tpot = req.slo.tpot_s
        # its first token's time once seen (one that came before the recorder watched is
        # not judged), and its output tokens when last looked at
        self.first = req.metrics.first_token_time
        self.outputs = req.num_output_tokens
        self.lost = 0  # _TTFT | _TPOT: deadlines already lost (each is listed once)
        self.slack: float | None = None  # seconds, as last listed
        self.phase = 0  # the objective of that slack: _TTFT or _TPOT


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def short_key(n: int) -> str:
    """`n` in base 36: the live stream's name for the n-th request it saw."""
    out = _DIGITS[n % 36]
    while n >= 36:
        n //= 36
        out = _DIGITS[n % 36] + out
    return out


class StepRecorder:
    """Builds one record per plan of `sched` (see the module docstring)."""

    def __init__(self, sched: Scheduler, epoch: float = 0.0, map_interval: float = 0.0,
                 predictor: Predictor | None = None, short_ids: bool = False) -> None:
        self.sched = sched
        self.epoch = epoch  # times in records are seconds since this clock value
        self.map_interval = map_interval
        self.predictor = predictor
        self.short_ids = short_ids
        self._pending: dict[int, Record] = {}
        # Of each request seen, from its first plan until it ends: its name in records, its
        # prompt length, and whether it decodes (its last plan computed one token past its
        # prompt, and it was not preempted since: it computes one token whenever scheduled)
        self._keys: dict[str, str] = {}
        self._prompt: dict[str, int] = {}
        self._decoding: set[str] = set()
        self._next_key = 0  # never reset: a key names one request for the stream's whole life
        # Deadlines: every live request seen arrive, those with objectives, and the due times
        # of those not in a step ((due, id, _TTFT or _TPOT), judged when `now` passes them)
        self._arrived: set[str] = set()
        self._watch: dict[str, _Watch] = {}
        self._due: list[tuple[float, str, int]] = []
        self._map_dirty = True
        self._next_map = 0.0

    def state(self) -> Record:
        """Queues, KV counts and the block map right now (a viewer's starting point); with
        short ids, `requests` pairs every request the scheduler holds with its key."""
        rec: Record = {"running": 0, "waiting": 0, "swapped": 0, "kv": [0, 0, 0]}
        if self.short_ids:
            rec["requests"] = [self._request_entry(rid, req)
                               for rid, req in self.sched.requests.items()]
        rec["blocks"] = self._block_map()
        self._counts(rec)
        return rec

    def reset(self) -> None:
        """Forget what was recorded (nobody listens any more: finishes would go unseen)."""
        self._pending.clear()
        self._keys.clear()
        self._prompt.clear()
        self._decoding.clear()
        self._arrived.clear()
        self._watch.clear()
        self._due.clear()
        self.force_map()

    def name(self, rid: str) -> str:
        """What records call request `rid`: its key once seen (short ids), else the id."""
        return self._keys.get(rid, rid)

    def _learn(self, rid: str) -> str:
        """The key of `rid`, assigned (with its prompt length noted) the first time."""
        key = self._keys.get(rid)
        if key is None:
            req = self.sched.requests.get(rid)
            key = rid
            if self.short_ids:
                key, self._next_key = short_key(self._next_key), self._next_key + 1
            self._keys[rid] = key
            self._prompt[rid] = len(req.prompt_token_ids) if req is not None else 0
        return key

    def _request_entry(self, rid: str, req: Request) -> list[Any]:
        entry: list[Any] = [self._learn(rid), rid]
        slo = objectives(req.slo)
        if slo is not None:
            entry.append(slo)
        return entry

    def _forget(self, rid: str) -> None:
        self._keys.pop(rid, None)
        self._prompt.pop(rid, None)
        self._decoding.discard(rid)
        self._arrived.discard(rid)
        self._watch.pop(rid, None)

    def _block_map(self) -> dict[str, Any]:
        return block_map_of(self.sched, self.name if self.short_ids else None)

    def force_map(self) -> None:
        """Take the block map with the next plan (a new viewer needs a full picture)."""
        self._map_dirty, self._next_map = True, 0.0

    def on_plan(self, plan: SchedulerOutput, now: float) -> None:
        """Record a plan's composition, just after `schedule()` returned it."""
        rec = empty_record(plan.step_id)
        self._arrivals()
        preemptions = self.sched.last_preemptions
        if preemptions:  # before the composition: a victim no longer decodes
            name = self.name
            rec["preempted"] = [
                [name(v), reason, mode, name(by)] for v, reason, mode, by in preemptions
            ]
            self._decoding.difference_update(p[0] for p in preemptions)
            if self._watch:
                self._out_of_steps(p[0] for p in preemptions)
        changed = self._composition(plan, rec)
        if plan.aborted_req_ids:
            rec["aborted"] = sorted(self.name(rid) for rid in plan.aborted_req_ids)
            for rid in plan.aborted_req_ids:
                self._forget(rid)
        rec["swap_out"], rec["swap_in"] = len(plan.swap_out), len(plan.swap_in)
        self._counts(rec)
        if self.predictor is not None:
            predicted = self.predictor(plan)
            rec["predicted_ms"] = None if predicted is None else round(predicted * 1e3, 4)
        self._map_dirty |= changed or bool(
            plan.preempted_req_ids or plan.finished_req_ids or plan.aborted_req_ids
        )
        if self._map_dirty and (now >= self._next_map or not self.sched.has_unfinished_requests()):
            self._take_map(rec, now)
        self._pending[plan.step_id] = rec
        if len(self._pending) > _MAX_PENDING:
            del self._pending[min(self._pending)]
        if len(self._keys) > 2 * len(self.sched.requests) + _SLACK_KEYS:
            # Requests a hello named that left without a plan naming their end (aborted while
            # waiting): forget them. Every other end was recorded by now (outputs are applied,
            # and aborts named, before the next plan).
            live = self.sched.requests
            for rid in [r for r in self._keys if r not in live]:
                self._forget(rid)
        if len(self._arrived) > 2 * len(self.sched.requests) + _SLACK_KEYS:
            live = self.sched.requests  # the same, for requests no record named
            for rid in [r for r in self._arrived if r not in live]:
                self._forget(rid)

    def on_output(self, plan: SchedulerOutput, outputs: Sequence[RequestOutput], now: float,
                  step_seconds: float | None, execute_seconds: float | None = None,
                  delivered: Delivered | None = None) -> Record | None:
        """Complete the plan's record with what its output did; None if it was not recorded.

        `delivered` (the server's output processor has it): the step's tokens, first tokens
        and ends as its clients saw them (a stop string ends a request with "stop" here, where
        the scheduler only learns of it as an abort). It spares a pass over `outputs`."""
        rec = self._pending.pop(plan.step_id, None)
        if rec is None:
            return None
        rec["t"] = round(now - self.epoch, 6)
        rec["step_ms"] = None if step_seconds is None else round(step_seconds * 1e3, 4)
        rec["execute_ms"] = round(execute_seconds * 1e3, 4) if execute_seconds else None
        name = self.name
        ended: list[tuple[str, str | None]] = []  # (request id, finish reason)
        if delivered is not None:
            tokens = delivered.tokens
            rec["first"] = [name(rid) for rid in delivered.first]
            ended.extend(delivered.finished)
        else:
            tokens, first = 0, rec["first"]
            for out in outputs:
                n = len(out.new_token_ids)
                if n:
                    tokens += n
                    if out.num_output_tokens == n:
                        first.append(name(out.req_id))
                if out.finished:
                    ended.append((out.req_id, out.finish_reason))
        finished = rec["finished"] = [[name(rid), reason] for rid, reason in ended]
        if self._watch:  # before the ends are forgotten: a last token may be late
            self._deadlines(plan, rec, now)
        for rid, _ in ended:
            self._forget(rid)
        rec["tokens"] = tokens
        if finished and not self.sched.has_unfinished_requests():
            self._counts(rec)  # the last request left: show the pool as it left it
            self._take_map(rec, now)
        return rec

    def _composition(self, plan: SchedulerOutput, rec: Record) -> bool:
        """Fill decode / prefill / new / resumed / swapped_in; True if a block table changed."""
        counts, keys = plan.num_scheduled_tokens, self._keys
        decoding, prompt = self._decoding, self._prompt
        cached, new_reqs = plan.scheduled_cached_reqs, plan.scheduled_new_reqs
        changed = bool(new_reqs) or any(map(_NEW_BLOCKS, cached))
        others = counts.keys() - decoding
        if new_reqs:
            others.difference_update(new.req_id for new in new_reqs)
        new_tokens = sum(counts[new.req_id] for new in new_reqs) if new_reqs else 0
        if not others and plan.total_num_scheduled_tokens - new_tokens == len(cached):
            # The steady state: every running request decodes (each was recorded decoding, is
            # not preempted since, and computes one token), so C loops build the list.
            if cached:
                rec["decode"] = list(map(keys.__getitem__, map(_REQ_ID, cached)))
        else:
            decode, prefill = rec["decode"], rec["prefill"]
            for d in cached:
                rid = d.req_id
                if rid not in others and counts[rid] == 1:
                    decode.append(keys[rid])
                    continue
                decoding.discard(rid)  # more than one token: a recompute chunk after all
                key = self._learn(rid)
                if d.resumed_from_preemption:
                    if d.new_block_ids:
                        self._resumed(plan, key, d.new_block_ids[0], rec)
                    else:
                        rec["resumed"].append(key)
                n, ctx = counts[rid], d.num_computed_tokens
                if n == 1 and ctx >= prompt[rid]:
                    decode.append(key)
                    decoding.add(rid)
                else:
                    prefill.append([key, n, ctx])
        for new in new_reqs:
            rid, num_prompt, n = new.req_id, len(new.prompt_token_ids), counts[new.req_id]
            key = self._learn(rid)  # known already if a viewer's hello named it
            prompt[rid] = num_prompt
            rec["prefill"].append([key, n, new.num_computed_tokens])
            if new.num_computed_tokens + n >= num_prompt:
                # its prompt is done: it samples now, and decodes from the next plan
                decoding.add(rid)
            req = self.sched.requests.get(rid)
            arrival = round(req.arrival_time - self.epoch, 6) if req is not None else None
            entry: list[Any] = [key, arrival, num_prompt, new.num_computed_tokens]
            if self.short_ids:
                entry.append(rid)
            if req is not None and not req.slo.empty:
                entry.append(objectives(req.slo))
            rec["new"].append(entry)
        return changed

    # -- deadlines ------------------------------------------------------------------------------

    def _arrivals(self) -> None:
        """Watch the requests that arrived since the last plan: the scheduler's table keeps
        arrival order, so the newest come first from its end, up to one seen before."""
        reqs, seen = self.sched.requests, self._arrived
        fresh = []
        for rid in reversed(reqs):
            if rid in seen:
                break
            fresh.append(rid)
        for rid in reversed(fresh):
            seen.add(rid)
            req = reqs[rid]
            if not req.slo.empty:
                self._watch[rid] = _Watch(req)
                if req.metrics.first_token_time is None and req.slo.ttft_s is not None:
                    heapq.heappush(self._due, (req.arrival_time + req.slo.ttft_s, rid, _TTFT))

    def _out_of_steps(self, rids: Any) -> None:
        """Requests that leave the steps for a while (preempted): their TPOT deadline is
        judged when it falls due (a TTFT deadline is on the heap since their arrival)."""
        for rid in rids:
            w = self._watch.get(rid)
            if w is None or w.lost & _TPOT:
                continue
            req = w.req
            first, tpot = req.metrics.first_token_time, req.slo.tpot_s
            if first is not None and tpot is not None:
                heapq.heappush(self._due, (first + tpot * req.num_output_tokens, rid, _TPOT))

    def _deadlines(self, plan: SchedulerOutput, rec: Record, now: float) -> None:
        """Judge the watched requests of the plan, and the due times `now` passed: fill
        `lost` and `slack`."""
        watch, running, name = self._watch, RequestStatus.RUNNING, self.name
        for rid in plan.num_scheduled_tokens:
            w = watch.get(rid)
            if w is None:
                continue
            req, first, tpot = w.req, w.first, w.tpot
            if (first is None or tpot is None or req.status is not running
                    or req.num_tokens - req.num_computed_tokens > 1):
                self._judge(w, rid, now, rec)
                continue
            # The steady state, inline (`_judge` and `_slack` for a running request past its
            # first token, with a TPOT objective and no prefill to do)
            when = first + tpot * w.outputs
            if now > when and not w.lost & _TPOT:
                self._lose(w, rid, _TPOT, when, rec)
            w.outputs = n = len(req.output_token_ids)
            value = first + tpot * n - now
            value = tpot if value > tpot else -tpot if value < -tpot else value
            last = w.slack
            if (last is None or w.phase != _TPOT or (value < 0) != (last < 0)
                    or abs(value - last) >= tpot / SLACK_STEPS):
                w.slack, w.phase = value, _TPOT
                rec["slack"].append([name(rid), round(value * 1e3)])
        due_heap = self._due
        while due_heap and due_heap[0][0] < now:
            when, rid, kind = heapq.heappop(due_heap)
            w = watch.get(rid)
            if w is None or w.lost & kind:
                continue
            req = w.req
            first = req.metrics.first_token_time
            if kind == _TTFT:
                if first is not None:
                    continue  # it came: judged with the step that brought it
            else:
                assert first is not None and req.slo.tpot_s is not None
                when = first + req.slo.tpot_s * req.num_output_tokens
                if when >= now:
                    continue  # back on schedule (it ran again since it left)
            self._lose(w, rid, kind, when, rec)

    def _judge(self, w: _Watch, rid: str, now: float, rec: Record) -> None:
        """A watched request in the step whose output came `now`: a deadline lost (its
        first token after arrival + ttft; a token after first + tpot * the outputs it had
        when last looked at, or none by then), and its slack when it moved."""
        req = w.req
        slo, first = req.slo, req.metrics.first_token_time
        if w.first is None:
            ttft = slo.ttft_s
            if ttft is not None and not w.lost & _TTFT:
                when = req.arrival_time + ttft
                if (now if first is None else first) > when:
                    self._lose(w, rid, _TTFT, when, rec)
            if first is None:
                self._slack(w, rid, now, _TTFT, ttft, rec)
                return
            w.first, w.outputs = first, req.num_output_tokens
        tpot = slo.tpot_s
        if tpot is None or first is None:
            self._watch.pop(rid, None)  # no objective left to watch
            return
        if not w.lost & _TPOT:
            when = first + tpot * w.outputs
            if now > when:
                self._lose(w, rid, _TPOT, when, rec)
        w.outputs = req.num_output_tokens
        if not req.is_finished:
            self._slack(w, rid, now, _TPOT, tpot, rec)

    def _slack(self, w: _Watch, rid: str, now: float, phase: int, objective: float | None,
               rec: Record) -> None:
        """List the request's slack (capped at +- its objective) when it moved by an eighth
        of the objective, changed sign, or is measured against another objective now."""
        if objective is None:
            return
        value = slack(w.req, now, self.sched._prefill_time)
        value = min(max(value, -objective), objective)
        last = w.slack
        if (last is not None and w.phase == phase and (value < 0) == (last < 0)
                and abs(value - last) < objective / SLACK_STEPS):
            return
        w.slack, w.phase = value, phase
        rec["slack"].append([self.name(rid), round(value * 1e3)])

    def _lose(self, w: _Watch, rid: str, kind: int, when: float, rec: Record) -> None:
        """List a lost deadline: `[key, objective, due_t]`, and live the request's id too
        when this names it first (it may still wait for admission)."""
        w.lost |= kind
        named = rid in self._keys
        entry: list[Any] = [self._learn(rid), _OBJECTIVE[kind], round(when - self.epoch, 6)]
        if self.short_ids and not named:
            entry.append(rid)
        rec["lost"].append(entry)

    @staticmethod
    def _resumed(plan: SchedulerOutput, key: str, first_block: int, rec: Record) -> None:
        swapped = any(dev == first_block for _, dev in plan.swap_in)
        (rec["swapped_in"] if swapped else rec["resumed"]).append(key)

    def _counts(self, rec: Record) -> None:
        s, pool = self.sched, self.sched.kv.pool
        rec["running"], rec["waiting"] = len(s.running), len(s.waiting)
        rec["swapped"] = len(s.swapped)
        cached = pool.num_cached_free
        rec["kv"] = [pool.num_used, cached, pool.num_free - cached]

    def _take_map(self, rec: Record, now: float) -> None:
        start = time.perf_counter()
        rec["blocks"] = self._block_map()
        cost = time.perf_counter() - start
        self._map_dirty = False
        self._next_map = (
            now + max(self.map_interval, cost * MAP_COST_RATIO) if self.map_interval else now
        )
