"""Waiting queues, chosen by policy: `FCFSQueue` and `PriorityQueue` (with aging).

Both hand out the next request to admit with `peek(now)` / `pop(now)`; a request preempted
by recompute goes back with `push_front` and keeps its arrival time and priority.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


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


WaitingQueue = FCFSQueue | PriorityQueue
