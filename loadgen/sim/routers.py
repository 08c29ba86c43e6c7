"""Router policies of the simulated cluster (`loadgen/sim/cluster.py`): which replica a new
request goes to. Each policy sees every replica's real `Scheduler` as it stands when the
request arrives, and the load signal below.

The load signal (`ReplicaState.load`) is what SGLang's model gateway (smg) calls
`worker.load()`: the requests the router has sent to a replica that have not finished,
which is the replica's running + waiting (+ swapped) requests, vLLM's
`num_requests_running + num_requests_waiting`. `load_signal="kv"` compares KV usage
instead (smg's `token_usage`, from vLLM's `kv_cache_usage_perc` gauge), as smg's
power_of_two does when every backend reports loads. The policies, after
lightseekorg/smg `model_gateway/src/policies/`:

- `round_robin`: replicas in turn.
- `least_load`: the lowest load; ties to the replica that has been sent fewest requests,
  then the lowest index (smg's min-load tie-break). smg's own `least_load.rs` scores
  token-work over throughput plus a KV barrier from polled loads; with no load reports it
  is this join-shortest-queue, which is what a fresh, exact signal reduces it to here.
- `power_of_two` (`power_of_two.rs`): two distinct replicas at random, the less loaded
  (the first on a tie).
- `cache_aware` (`cache_aware.rs`, its approximate token tree): when the replicas'
  request counts are imbalanced (max - min > `balance_abs_threshold` and max >
  `balance_rel_threshold` x min) the least loaded; else the replica owning the longest
  routed prefix when the match covers more than `cache_threshold` of the prompt, else the
  least loaded; the prompt is then inserted for the replica chosen. The tree matches whole
  16-token pages (smg's `PAGE_SIZE`) and, at the deepest matched page, names the replica
  that was sent it last. (The file's header says a miss goes to the smallest tree; its
  code sends it to the least loaded, which is followed here.) No tree eviction.
- `prefix_hash` (`prefix_hash.rs`): a consistent-hash ring (150 virtual nodes per
  replica, as smg's `hash_ring.rs`) keyed by a hash of the first `prefix_tokens` tokens;
  when the ring's replica is over `load_factor` x the mean load (counting the new
  request), the least loaded replica within that bound, or the ring's replica if none is.
- `predicted_ttft` (no router has it): the replica whose scheduler forecasts the earliest
  first token (`scheduler.forecast.first_token`: the queue ahead and the fitted step
  cost), with the prompt shortened by the prefix-cache hit that replica holds for it now;
  see `PredictedTTFT` for near ties. `forecast_cost` replaces the replicas' fitted step
  cost in the forecast (the simulator passes its own cost model: a perfect fit).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.forecast import first_token
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.step_cost import StepCostFn

ROUTERS = ("round_robin", "least_load", "power_of_two", "cache_aware", "prefix_hash",
           "predicted_ttft")
LOAD_SIGNALS = ("requests", "kv")
PAGE_SIZE = 16  # smg's token tree matches whole pages of this many tokens
VIRTUAL_NODES = 150  # per replica on the prefix_hash ring


class ReplicaState(Protocol):
    """What a router reads of a replica."""

    @property
    def sched(self) -> Scheduler: ...

    @property
    def processed(self) -> int:
        """Requests routed to it so far."""


class Router(Protocol):
    name: str

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        """The index of the replica `req` goes to (called once per request, in order)."""


def load_of(replica: ReplicaState, signal: str) -> float:
    if signal == "kv":
        return replica.sched.kv.usage
    return float(len(replica.sched.requests))


def min_load(replicas: Sequence[ReplicaState], signal: str,
             among: Sequence[int] | None = None) -> int:
    """The least loaded replica (ties: fewest routed, then lowest index)."""
    indices = range(len(replicas)) if among is None else among
    return min(indices, key=lambda i: (load_of(replicas[i], signal), replicas[i].processed, i))


@dataclass
class RoundRobin:
    name: str = "round_robin"
    next: int = 0

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        i = self.next % len(replicas)
        self.next += 1
        return i


@dataclass
class LeastLoad:
    signal: str = "requests"
    name: str = "least_load"

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        return min_load(replicas, self.signal)


@dataclass
class PowerOfTwo:
    signal: str = "requests"
    seed: int = 0
    name: str = "power_of_two"
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        n = len(replicas)
        if n == 1:
            return 0
        a = self.rng.randrange(n)
        b = (a + 1 + self.rng.randrange(n - 1)) % n  # a different replica
        return a if load_of(replicas[a], self.signal) <= load_of(replicas[b], self.signal) else b


def _pages(tokens: Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's whole pages: page i's names every token up to it."""
    out, parent = [], 0
    for lo in range(0, len(tokens) - PAGE_SIZE + 1, PAGE_SIZE):
        parent = hash((parent, tuple(tokens[lo:lo + PAGE_SIZE])))
        out.append(parent)
    return out


@dataclass
class CacheAware:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    name: str = "cache_aware"
    # page path hash -> {replica: when it was last routed a prompt through this page}
    tree: dict[int, dict[int, float]] = field(default_factory=dict)

    def imbalanced(self, replicas: Sequence[ReplicaState]) -> bool:
        loads = [len(r.sched.requests) for r in replicas]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def match(self, pages: list[int]) -> tuple[int, int | None]:
        """Tokens of the longest routed prefix, and the replica last sent it."""
        depth = 0
        while depth < len(pages) and pages[depth] in self.tree:
            depth += 1
        if not depth:
            return 0, None
        owners = self.tree[pages[depth - 1]]
        return depth * PAGE_SIZE, max(owners, key=lambda i: owners[i])

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        pages = _pages(req.prompt_token_ids)
        if self.imbalanced(replicas):
            chosen = min_load(replicas, "requests")
        else:
            matched, owner = self.match(pages)
            rate = matched / req.num_prompt_tokens
            chosen = owner if owner is not None and rate > self.cache_threshold else \
                min_load(replicas, "requests")
        for page in pages:
            self.tree.setdefault(page, {})[chosen] = now
        return chosen


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass
class PrefixHash:
    num_replicas: int
    prefix_tokens: int = 256
    load_factor: float = 1.25
    name: str = "prefix_hash"
    ring: list[tuple[int, int]] = field(init=False)  # (position, replica), sorted

    def __post_init__(self) -> None:
        self.ring = sorted((_hash64(f"replica-{i}#{v}".encode()), i)
                           for i in range(self.num_replicas) for v in range(VIRTUAL_NODES))

    def home(self, tokens: Sequence[int]) -> int:
        """The ring's replica for this prompt: the first virtual node clockwise of its key."""
        key = _hash64(repr(list(tokens[:self.prefix_tokens])).encode())
        at = bisect.bisect_left(self.ring, (key, -1)) % len(self.ring)
        return self.ring[at][1]

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        home = self.home(req.prompt_token_ids)
        loads = [len(r.sched.requests) for r in replicas]
        total = sum(loads)
        bound = (total + 1) / len(replicas) * self.load_factor

        def ok(i: int) -> bool:
            return total == 0 or loads[i] <= bound

        if ok(home):
            return home
        fine = [i for i in range(len(replicas)) if ok(i)]
        return min(fine, key=lambda i: (loads[i], i)) if fine else home


def cached_prefix_tokens(sched: Scheduler, req: Request) -> int:
    """Prompt tokens `sched`'s prefix cache holds for `req` now. Reads the block pool's
    hash map only (`find_cached_prefix` memoises the block hashes on `req`, which every
    replica computes alike); nothing in the scheduler changes."""
    return len(sched.kv.find_cached_prefix(req)) * sched.config.block_size


def forecast_ttft(sched: Scheduler, req: Request, now: float,
                  cost: StepCostFn | None = None) -> float:
    """Seconds until `req`'s first token on `sched`, queued now, past the replica's
    prefix-cache hit (the forecast prices every prompt past its cached prefix). It reads
    only the queue, the prefix cache and the step-cost model: the scheduler's own fit, or
    `cost` in its place."""
    if cost is not None:
        config = sched.config
        sched.config = dataclasses.replace(config, step_cost=cost)
        try:
            return forecast_ttft(sched, req, now)
        finally:
            sched.config = config
    probe = Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                    req.arrival_time, req.eos_token_ids, tenant=req.tenant, slo=req.slo,
                    block_hashes=req.block_hashes)  # hashed once for every replica
    # what `Scheduler.add_request` resolves before ranking a request (sjf and slo read it)
    probe.slo = sched.config.slo_classes.resolve(probe.slo, probe.tenant, probe.priority)
    probe.slo_resolved = True
    probe.predicted_output_tokens = sched.predictor.predict(req)
    seconds = first_token(sched, probe, now)
    if seconds is None:
        raise ValueError("predicted_ttft needs a scheduler with a step-cost model")
    return seconds


@dataclass
class PredictedTTFT:
    """Earliest forecast first token. Forecasts within `tolerance_s` of the best count as
    equal (a forecast is resolved to about a step: which plan a request joins), and among
    those the replica holding most of the prompt wins, then the earlier forecast: a session
    stays where its history is cached, which its later turns reuse.

    The tolerance is about one step of the modelled server under load: on the A100
    profile a step of 80 decodes takes 17 ms, and 29-53 ms with a 512-1,024-token prefill
    chunk, a turn's usual new prompt. At 10 ms sessions left their history for forecasts
    less than a step earlier: on the multi-turn trace at 0.9x capacity the same TTFT p99
    (180 against 176 ms) at a prefix-cache hit rate 0.8 points below cache_aware's, where
    40 ms holds it 0.25 points above."""

    tolerance_s: float = 0.04
    cost: StepCostFn | None = None  # None: each replica's own fit
    name: str = "predicted_ttft"

    def choose(self, req: Request, replicas: Sequence[ReplicaState], now: float) -> int:
        scored = [(forecast_ttft(r.sched, req, now, self.cost), cached_prefix_tokens(r.sched, req),
                   i)
                  for i, r in enumerate(replicas)]
        best = min(s[0] for s in scored)
        near = [s for s in scored if s[0] <= best + self.tolerance_s]
        return min(near, key=lambda s: (-s[1], s[0], s[2]))[2]


def make_router(name: str, num_replicas: int, seed: int = 0, load_signal: str = "requests",
                forecast_cost: StepCostFn | None = None) -> Router:
    if load_signal not in LOAD_SIGNALS:
        raise ValueError(f"load_signal must be one of {', '.join(LOAD_SIGNALS)}, got "
                         f"{load_signal!r}")
    routers: dict[str, Router] = {
        "round_robin": RoundRobin(), "least_load": LeastLoad(load_signal),
        "power_of_two": PowerOfTwo(load_signal, seed), "cache_aware": CacheAware(),
        "prefix_hash": PrefixHash(num_replicas),
        "predicted_ttft": PredictedTTFT(cost=forecast_cost),
    }
    if name not in routers:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return routers[name]
