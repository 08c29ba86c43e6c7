"""Victim policies: which running request gives way when the scheduler preempts, and
whether swapping it out beats recomputing it. They keep no state; `Scheduler` applies them."""

from __future__ import annotations

from collections.abc import Callable

from scheduler import step_cost
from scheduler.config import SchedulerConfig, VictimPolicy
from scheduler.predictor import remaining_work
from scheduler.request import Request

# How willing we are to evict a request: the largest key loses. Every key ends with
# admit_seq, so ties go to the most recently admitted (vLLM's default victim).
VictimKey = Callable[[Request, Callable[[Request], int]], tuple[float, ...]]
VICTIM_KEYS: dict[str, VictimKey] = {
    # vLLM's default: the most recently admitted.
    "newest": lambda r, blocks: (r.admit_seq,),
    # The least urgent (largest priority value), then the youngest arrival.
    "priority": lambda r, blocks: (r.priority, r.arrival_time, r.admit_seq),
    # SGLang's retraction order: the fewest tokens generated so far.
    "fewest_output": lambda r, blocks: (-r.num_output_tokens, r.admit_seq),
    # The least predicted work left (prefill still to do + predicted outputs not sampled).
    "least_remaining": lambda r, blocks: (-remaining_work(r), r.admit_seq),
    # The one whose preemption frees the most blocks.
    "largest_kv": lambda r, blocks: (blocks(r), r.admit_seq),
}


# Policies whose order moves with progress: a request nearing its end has the least work
# left and, with recompute, the most after its preemption (least_remaining); one that grows
# comes to hold the most blocks (largest_kv); two requests can then evict each other for
# ever. Under these the oldest running request is never the victim unless it is alone, so
# it always runs to its end (liveness). newest and priority need no guard: the oldest (or
# the most urgent) already never gives way to the others.
PROTECT_OLDEST = frozenset({"fewest_output", "least_remaining", "largest_kv", "slack"})


def pick_victim(
    running: list[Request],
    policy: VictimPolicy,
    blocks_freed: Callable[[Request], int] | None = None,
    slack: Callable[[Request], float] | None = None,
) -> Request:
    """The running request (`running` in admission order) that gives way under `policy`.
    `blocks_freed(r)`: device blocks preempting r would free (needed by "largest_kv");
    `slack(r)`: seconds r has to spare, recompute included (needed by "slack": the most
    slack gives way; requests with no objective left have infinite slack, the newest first)."""
    candidates = running[1:] if policy in PROTECT_OLDEST and len(running) > 1 else running
    if policy == "slack":
        if slack is None:
            raise ValueError("the slack victim policy needs each request's slack")
        return max(candidates, key=lambda r: (slack(r), r.admit_seq))
    key = VICTIM_KEYS[policy]
    blocks = blocks_freed or (lambda r: 0)
    return max(candidates, key=lambda r: key(r, blocks))


def swap_is_cheaper(config: SchedulerConfig, num_tokens: int) -> bool:
    """Swap out now and back in later vs recompute `num_tokens` of KV (preemption "auto"):
    `step_cost.swap_is_cheaper` with the configured copy bandwidth and cost model."""
    return step_cost.swap_is_cheaper(num_tokens, config.kv_bytes_per_token, config.swap_bandwidth,
                                     config.recompute_cost)
