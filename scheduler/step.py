"""`StepBuilder`: the working state of one `schedule()` call, turned into a frozen plan.

Requests are only *recorded* here while the step is planned, so that a request chosen as a
preemption victim after it was scheduled can be taken back out (`unschedule`). The
scheduler applies the recorded counts to the requests once the plan is final.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request
from scheduler.step_cost import BatchShape


class Preemption(NamedTuple):
    """Why a request left the running set in a step (for the live view; the plan itself
    only lists preempted ids)."""

    victim: str
    reason: str  # "kv": a running request needed blocks; "priority": a more urgent one waits
    mode: str  # "recompute" (KV dropped) or "swap" (KV copied to host memory)
    by: str  # the request that needed the room


@dataclass
class StepBuilder:
    step_id: int
    budget: int
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)  # id -> (req, n)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: set[str] = field(default_factory=set)  # first time the worker sees them
    resumed: set[str] = field(default_factory=set)  # block table replaced (after preemption)
    admitted: set[str] = field(default_factory=set)  # entered the running set this step
    preempted: set[str] = field(default_factory=set)
    preemptions: list[Preemption] = field(default_factory=list)  # in order, with their causes
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # What is scheduled so far, kept only once the time budget has asked (None: not tracked)
    shape: BatchShape | None = None

    def add(self, req: Request, n: int, new_blocks: list[int]) -> None:
        self.scheduled[req.request_id] = (req, n)
        self.new_block_ids.setdefault(req.request_id, []).extend(new_blocks)
        self.budget -= n
        if self.shape is not None:
            ctx = req.num_computed_tokens
            self.shape.add(n, ctx, ctx + n == req.num_tokens + req.num_placeholders)

    def unschedule(self, req: Request) -> None:
        """Take a request back out of this step (it is being preempted)."""
        rid = req.request_id
        entry = self.scheduled.pop(rid, None)
        if entry is not None:
            self.budget += entry[1]
        self.new_block_ids.pop(rid, None)
        self.resumed.discard(rid)
        self.shape = None  # rebuilt from `scheduled` when next needed

    def build(
        self, block_table: dict[str, list[int]], finished: set[str], aborted: set[str]
    ) -> SchedulerOutput:
        """Freeze the plan. Call before the requests' counters are advanced."""
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        for rid, (req, _) in self.scheduled.items():
            if rid in self.new_reqs:
                new.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=tuple(req.prompt_token_ids),
                        sampling_params=req.sampling_params,
                        block_ids=tuple(block_table[rid]),
                        num_computed_tokens=req.num_computed_tokens,
                    )
                )
                continue
            is_resumed = rid in self.resumed
            blocks = block_table[rid] if is_resumed else self.new_block_ids.get(rid, [])
            cached.append(
                CachedRequestData(rid, tuple(blocks), req.num_computed_tokens, is_resumed)
            )
        counts = {rid: n for rid, (_, n) in self.scheduled.items()}
        return SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=tuple(new),
            scheduled_cached_reqs=tuple(cached),
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=sum(counts.values()),
            preempted_req_ids=frozenset(self.preempted),
            finished_req_ids=frozenset(finished),
            aborted_req_ids=frozenset(aborted),
            swap_out=tuple(self.swap_out),
            swap_in=tuple(self.swap_in),
        )
