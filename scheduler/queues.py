"""Waiting queues, chosen by policy (`make_waiting_queue`): `FCFSQueue`, `PriorityQueue`
(with aging), `SJFQueue` (shortest predicted work, with aging), `SLOQueue` (least slack
first, deadlines lost demoted for a bounded time) and, in `scheduler/fairness.py`,
`FairQueue` (per-tenant Virtual Token Counter).

Each hands out the next request to admit with `peek(now)` / `pop(now)`; a request preempted
by recompute goes back with `push_front` and keeps its arrival time and priority.
`rank(request, now)` orders swapped requests the way the queue orders waiting ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator

from scheduler.config import SchedulerConfig
from scheduler.fairness import FairnessMeter, FairQueue
from scheduler.predictor import remaining_work
from scheduler.request import Request
from scheduler.slo import PrefillTime, due
from scheduler.step_cost import recompute_time


class FCFSQueue:
    """Arrival order; recompute-preempted requests return to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_front(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self, now: float) -> Request:
        return self._q[0]

    def pop(self, now: float) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        return 0, request.arrival_time


class PriorityQueue:
    """Most urgent first by effective priority = priority - floor(wait / aging_period), then
    arrival (lower value = more urgent, as in vLLM).

    Aging shifts every waiting request at the same rate, and within one priority level the
    oldest request always has the lowest effective priority. So one arrival-ordered heap per
    priority level is exact: the best request is the best of the levels' heads, and no key
    ever needs re-heapifying as time passes. Cost per peek: O(number of distinct priorities).
    """

    def __init__(self, aging_period: float) -> None:
        self.aging_period = aging_period
        self._levels: dict[int, list[tuple[float, int, Request]]] = {}
        self._seq = itertools.count()
        self._removed: set[int] = set()  # ids of lazily deleted entries
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for heap in self._levels.values():
            yield from (r for _, _, r in heap if id(r) not in self._removed)

    def push(self, request: Request) -> None:
        self._removed.discard(id(request))
        level = self._levels.setdefault(request.priority, [])
        heapq.heappush(level, (request.arrival_time, next(self._seq), request))
        self._len += 1

    push_front = push  # original arrival and priority decide; nothing else to do

    def effective_priority(self, request: Request, now: float) -> int:
        wait = max(0.0, now - request.arrival_time)
        return request.priority - math.floor(wait / self.aging_period)

    def _head(self, heap: list[tuple[float, int, Request]]) -> Request | None:
        while heap and id(heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(heap)[2]))
        return heap[0][2] if heap else None

    def peek(self, now: float) -> Request:
        best: tuple[int, float, int] | None = None
        best_req: Request | None = None
        for prio, heap in list(self._levels.items()):
            head = self._head(heap)
            if head is None:
                del self._levels[prio]
                continue
            key = (self.effective_priority(head, now), head.arrival_time, prio)
            if best is None or key < best:
                best, best_req = key, head
        if best_req is None:
            raise IndexError("peek from an empty queue")
        return best_req

    def pop(self, now: float) -> Request:
        req = self.peek(now)
        heapq.heappop(self._levels[req.priority])
        self._len -= 1
        return req

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))
        self._len -= 1

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        return self.effective_priority(request, now), request.arrival_time


class SJFQueue:
    """Shortest predicted remaining work first (`predictor.remaining_work`), aged: a request's
    rank is its work minus `aging_rate` tokens per second it has waited.

    Aging lowers every waiting rank at the same rate, so ordering by the constant
    ``work + aging_rate * arrival_time`` is exact and one heap serves for all time. It gives
    the starvation bound: a request x with predicted work W_x is admitted before every
    request that arrives more than ``W_x / aging_rate`` seconds after it, since such a
    request's key exceeds x's whatever its own work (>= 1 token).
    """

    def __init__(self, aging_rate: float) -> None:
        self.aging_rate = aging_rate
        self._heap: list[tuple[float, float, int, Request]] = []
        self._live: dict[int, int] = {}  # id(request) -> sequence of its live heap entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, _, seq, r in self._heap if self._live.get(id(r)) == seq)

    def key(self, request: Request) -> float:
        return remaining_work(request) + self.aging_rate * request.arrival_time

    def push(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[id(request)] = seq
        heapq.heappush(self._heap, (self.key(request), request.arrival_time, seq, request))

    push_front = push  # a preempted request is ranked by what it has left to do

    def peek(self, now: float) -> Request:
        heap = self._heap
        while heap and self._live.get(id(heap[0][3])) != heap[0][2]:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("peek from an empty queue")
        return heap[0][3]

    def pop(self, now: float) -> Request:
        req = self.peek(now)
        heapq.heappop(self._heap)
        del self._live[id(req)]
        return req

    def remove(self, request: Request) -> None:
        del self._live[id(request)]

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        wait = max(0.0, now - request.arrival_time)
        return remaining_work(request) - self.aging_rate * wait, request.arrival_time


class SLOQueue:
    """Least slack first (policy "slo"): a request's key is the latest time its work can
    start and still meet what it is due (`slo.due`): ``due - prefill_time(tokens to
    compute)``. Slack is ``key - now``, and `now` is common to all, so one heap ordered by
    the constant key is exact while keys lie ahead.

    **Lost deadlines.** A request whose key has passed (its objective can no longer be met)
    is demoted: its key becomes ``key + demotion_s``, so meetable work goes first for at
    most `demotion_s` seconds; then it ranks ahead of every request still meetable (their
    keys are >= now). A request with no objective counts as lost on arrival:
    ``arrival + demotion_s``. No request starves: its key is fixed once it is late, and
    every request arriving after that key (plus the longest prefill) ranks behind it.
    """

    def __init__(self, prefill_time: PrefillTime, demotion_s: float) -> None:
        self.prefill_time = prefill_time
        self.demotion_s = demotion_s
        self._meetable: list[tuple[float, int, Request]] = []
        self._late: list[tuple[float, int, Request]] = []
        self._live: dict[int, int] = {}  # id(request) -> sequence of its live heap entry
        self._seq = itertools.count()
        self.num_demoted = 0  # requests demoted when their deadline was lost (cumulative)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        for heap in (self._meetable, self._late):
            yield from (r for _, seq, r in heap if self._live.get(id(r)) == seq)

    def latest_start(self, request: Request) -> float | None:
        """When its work must start to meet what it is due; None: it has no objective left."""
        when = due(request)
        if when is None:
            return None
        todo = request.num_tokens - request.num_computed_tokens
        return when - (self.prefill_time(todo) if todo > 1 else 0.0)

    def key(self, request: Request, now: float) -> float:
        """Its place in the queue at `now` (smaller first)."""
        start = self.latest_start(request)
        if start is None:
            return request.arrival_time + self.demotion_s
        return start if start >= now else start + self.demotion_s

    def push(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[id(request)] = seq
        start = self.latest_start(request)
        if start is None:
            heapq.heappush(self._late, (request.arrival_time + self.demotion_s, seq, request))
        else:
            heapq.heappush(self._meetable, (start, seq, request))

    push_front = push  # a preempted request is ranked by what it is due next

    def _clean(self, heap: list[tuple[float, int, Request]]) -> None:
        while heap and self._live.get(id(heap[0][2])) != heap[0][1]:
            heapq.heappop(heap)

    def _demote(self, now: float) -> None:
        meetable = self._meetable
        while True:
            self._clean(meetable)
            if not meetable or meetable[0][0] >= now:
                return
            start, seq, req = heapq.heappop(meetable)
            heapq.heappush(self._late, (start + self.demotion_s, seq, req))
            self.num_demoted += 1

    def _best(self, now: float) -> list[tuple[float, int, Request]]:
        self._demote(now)
        self._clean(self._late)
        heaps = [h for h in (self._meetable, self._late) if h]
        if not heaps:
            raise IndexError("peek from an empty queue")
        return min(heaps, key=lambda h: h[0][:2])

    def peek(self, now: float) -> Request:
        return self._best(now)[0][2]

    def pop(self, now: float) -> Request:
        req = heapq.heappop(self._best(now))[2]
        del self._live[id(req)]
        return req

    def remove(self, request: Request) -> None:
        del self._live[id(request)]

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        return self.key(request, now), request.arrival_time


WaitingQueue = FCFSQueue | PriorityQueue | SJFQueue | FairQueue | SLOQueue


def prefill_time_of(config: SchedulerConfig) -> PrefillTime:
    """Seconds one request's prefill of n tokens adds to the steps it rides in, by the
    step-cost model (0 without one: deadlines alone then order the queue)."""
    cost = config.step_cost
    if cost is None:
        return lambda n: 0.0
    return lambda n: recompute_time(cost, n)


def make_waiting_queue(config: SchedulerConfig, meter: FairnessMeter) -> WaitingQueue:
    """The waiting queue of `config.scheduling_policy`; "fair" reads the service `meter`."""
    if config.scheduling_policy == "priority":
        return PriorityQueue(config.aging_period)
    if config.scheduling_policy == "sjf":
        return SJFQueue(config.sjf_aging_rate)
    if config.scheduling_policy == "fair":
        return FairQueue(meter, config.tenant_weights)
    if config.scheduling_policy == "slo":
        return SLOQueue(prefill_time_of(config), config.slo_demotion_s)
    return FCFSQueue()
