"""Fair share between tenants: the Virtual Token Counter (VTC; Sheng et al., OSDI'24,
"Fairness in Serving Large Language Models").

**Service.** A tenant is the OpenAI `user` of its requests (`Request.tenant`;
`request.DEFAULT_TENANT` when none is given). Each prompt token counts once, at
`fair_prompt_weight`, when it is first computed or found in the prefix cache; each output
token counts once, at `fair_output_weight`, in the step that samples it (defaults 1 and 2,
the paper's prices; a sample still in flight when its request finishes is refunded).
Tokens recomputed after a preemption are not service: the tenant got nothing new from
them. `FairnessMeter` keeps these totals under every policy.

**Counters** (`FairQueue`, policy "fair"). Tenant t's counter is
``c_t = served_t / w_t + lift_t``, with `w_t` its share weight (`tenant_weights`, 1 unless
given). Admission takes the oldest waiting request of the *backlogged* tenant (one with
waiting requests) whose counter is lowest; ties go to the older head. When a request
arrives for a tenant with nothing waiting, the tenant is lifted:
``c_t = max(c_t, min of the backlogged tenants' counters)`` — or, when no tenant is
backlogged, the counter the last tenant to leave the backlog had when it left. So a tenant
cannot bank service while idle and spend it later.

**Bound.** Between two tenants that stay backlogged over an interval, the difference in
the weighted service they receive (each divided by its weight, weights >= 1) stays within
``2 * max(max price * token budget, the largest request's cost, output price * KV tokens)``
(`vtc_bound(..., kv_term=True)`): a tenant above the lowest counter gets no admissions,
but its requests already running keep being served, and those are bounded by what the KV
cache holds. Without the KV term (``2 * max(max price * token budget, the largest
request's cost)``, `vtc_bound(...)`) the bound is too tight: random small workloads exceed
it by up to ~1.4x when many requests run at once, so `stepserve simulate compare-policies`
reports both forms.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from scheduler.config import SchedulerConfig
from scheduler.request import Request


class FairnessMeter:
    """Weighted tokens served per tenant (not divided by share weights)."""

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.served: dict[str, float] = {}

    def charge(self, req: Request, end: int, samples: bool) -> float:
        """Count positions [req.num_charged_tokens, end) of the prompt, plus one output token
        if `samples`; returns the cost added."""
        prompt = req.num_prompt_tokens
        new_prompt = max(0, min(end, prompt) - min(req.num_charged_tokens, prompt))
        req.num_charged_tokens = max(req.num_charged_tokens, end)
        cost = new_prompt * self.prompt_weight + (self.output_weight if samples else 0.0)
        if cost:
            self.served[req.tenant] = self.served.get(req.tenant, 0.0) + cost
        return cost

    def refund_samples(self, req: Request, count: int) -> None:
        """`req` finished while `count` samples charged for it were still in flight (two plans
        in flight): they will be discarded, so they were no service."""
        if count and self.output_weight:
            self.served[req.tenant] = self.served.get(req.tenant, 0.0) - count * self.output_weight

    def request_cost(self, prompt_tokens: int, output_tokens: int) -> float:
        return prompt_tokens * self.prompt_weight + output_tokens * self.output_weight


def vtc_bound(config: SchedulerConfig, largest_request_cost: float, kv_term: bool = False) -> float:
    """2 * max(the most service one step can give, the largest request's cost[, the output
    service the KV cache can hold])."""
    price = max(config.fair_prompt_weight, config.fair_output_weight)
    terms = [config.max_num_batched_tokens * price, largest_request_cost]
    if kv_term:
        terms.append(config.num_gpu_blocks * config.block_size * config.fair_output_weight)
    return 2.0 * max(terms)


class FairQueue:
    """Waiting requests per tenant (FCFS within a tenant), admitted by lowest VTC counter."""

    def __init__(self, meter: FairnessMeter, weights: tuple[tuple[str, float], ...] = ()) -> None:
        self.meter = meter
        self.weights = dict(weights)
        self._lift: dict[str, float] = {}
        self._queues: dict[str, deque[Request]] = {}  # backlogged tenants only
        self._last_left = 0.0  # counter of the last tenant whose queue emptied
        self._seq = itertools.count()
        self._order: dict[int, int] = {}  # id(request) -> FCFS sequence within its tenant
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def counter(self, tenant: str) -> float:
        served = self.meter.served.get(tenant, 0.0)
        return served / self.weights.get(tenant, 1.0) + self._lift.get(tenant, 0.0)

    def backlogged(self) -> list[str]:
        return list(self._queues)

    def push(self, request: Request) -> None:
        """A new arrival: lift its tenant if it was not backlogged."""
        tenant = request.tenant
        if tenant not in self._queues:
            others = [self.counter(t) for t in self._queues]
            floor = min(others) if others else self._last_left
            current = self.counter(tenant)
            if floor > current:
                self._lift[tenant] = self._lift.get(tenant, 0.0) + floor - current
        self._add(request, front=False)

    def push_front(self, request: Request) -> None:
        """A preempted request goes back to the head of its tenant's queue, unlifted: its
        tenant did not return from idle."""
        self._add(request, front=True)

    def _add(self, request: Request, front: bool) -> None:
        q = self._queues.setdefault(request.tenant, deque())
        if front:
            q.appendleft(request)
            self._order[id(request)] = -next(self._seq)
        else:
            q.append(request)
            self._order[id(request)] = next(self._seq)
        self._len += 1

    def _key(self, tenant: str) -> tuple[float, float, int]:
        head = self._queues[tenant][0]
        return self.counter(tenant), head.arrival_time, self._order[id(head)]

    def peek(self, now: float) -> Request:
        if not self._queues:
            raise IndexError("peek from an empty queue")
        tenant = min(self._queues, key=self._key)
        return self._queues[tenant][0]

    def pop(self, now: float) -> Request:
        req = self.peek(now)
        self._queues[req.tenant].popleft()
        self._dropped(req)
        return req

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._dropped(request)

    def _dropped(self, request: Request) -> None:
        self._order.pop(id(request), None)
        self._len -= 1
        if not self._queues[request.tenant]:
            del self._queues[request.tenant]
            self._last_left = self.counter(request.tenant)

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        """Order among swapped requests: the lowest tenant counter first."""
        return self.counter(request.tenant), request.arrival_time


def tenant_report(scheduler: object) -> dict[str, dict[str, float]]:
    """Per tenant: weighted tokens served, and under the fair policy its VTC counter."""
    meter = getattr(scheduler, "fairness_meter", None)
    if not isinstance(meter, FairnessMeter):
        return {}
    queue = getattr(scheduler, "waiting", None)
    out: dict[str, dict[str, float]] = {}
    for tenant, served in meter.served.items():
        out[tenant] = {"served": served}
        if isinstance(queue, FairQueue):
            out[tenant]["counter"] = queue.counter(tenant)
    return out


def parse_tenant_weights(spec: str) -> tuple[tuple[str, float], ...]:
    """``alice=2,bob=0.5`` or a path to a JSON object ``{"alice": 2, "bob": 0.5}``."""
    path = Path(spec)
    if spec.strip().endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"tenant weights file {spec!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(
                f"tenant weights file {spec!r}: expected a JSON object of tenant: weight"
            )
        pairs = list(data.items())
    else:
        pairs = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, value = item.rpartition("=")
            if not sep or not name:
                raise ValueError(f"tenant weights: {item!r} is not TENANT=WEIGHT")
            pairs.append((name, value))
    out: list[tuple[str, float]] = []
    for name, value in pairs:
        try:
            out.append((str(name), float(value)))
        except (TypeError, ValueError):
            raise ValueError(
                f"tenant weights: weight of {name!r} is not a number: {value!r}"
            ) from None
    return tuple(out)

