"""Shared drivers for tests that run the real scheduler: request factory and a mirror of the worker.

`MirrorWorker` applies plans with the real worker's plan consumer (token lists kept per
request, preempted requests keep their state, finished/aborted ones are dropped, every plan
checked against what the worker holds), so scheduler tests also test the plan protocol.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerOutput
from scheduler.output import TokenLogprobs
from worker.execution.input_batch import InputBatch, RequestState, StepInputs
from worker.execution.step_executor import PlanRunner, StepExecutor

EOS = 2


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    arrival: float = 0.0,
    priority: int = 0,
    prompt: list[int] | None = None,
    tenant: str | None = None,
    **params: object,
) -> Request:
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(max_tokens=max_tokens, priority=priority, **params)  # type: ignore[arg-type]
    tokens = prompt if prompt is not None else [100 + (hash((rid, i)) % 1000) for i in range(prompt_len)]
    req = Request(rid, tokens, sp, arrival_time=arrival, eos_token_ids=(EOS,))
    if tenant is not None:
        req.tenant = tenant
    return req


class MirrorWorker(PlanRunner):
    """A model-free worker: the real plan consumer (`worker.execution.step_executor` over the real
    `InputBatch`) with a model whose tokens come from `next_token(req_id, position)` and
    whose "KV cache" records which token prefix wrote each slot.

    Attention at position p is right only if every slot it reads holds that request's own
    prefix, so this checks prefix sharing, swaps and recompute end to end."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        next_token: Callable[[str, int], int] | None = None,
        verify_kv: bool = True,
        max_model_len: int = 8192,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.next_token = next_token or (lambda rid, pos: 1000 + (hash((rid, pos)) % 5000))
        self.verify_kv = verify_kv
        self.device: dict[int, int] = {}  # slot -> identity of the prefix whose last token wrote it
        self.host: dict[int, int] = {}
        self._prefix_hashes: dict[str, list[int]] = {}  # [i]: identity of tokens[: i + 1]
        self.batch = InputBatch(max_model_len, block_size, torch.device("cpu"), num_blocks=num_blocks)
        self.executor = StepExecutor(self.batch, self)

    # -- the StepModel side --

    def swap(self, swap_out: tuple[tuple[int, int], ...], swap_in: tuple[tuple[int, int], ...]) -> None:
        self._copy_blocks(swap_out, self.device, self.host)
        self._copy_blocks(swap_in, self.host, self.device)

    def run(self, step: StepInputs) -> tuple[list[int], list[TokenLogprobs | None]]:
        slots = step.slots.tolist()
        assert len(set(slots)) == len(slots), "two tokens write one KV slot in a step"
        offset = 0
        for state, n in step.scheduled:  # write all new KV first, as a layer does
            for i, pos in enumerate(range(state.num_computed_tokens, state.num_computed_tokens + n)):
                self.device[slots[offset + i]] = self._prefix_hash(state, pos)
            offset += n
        if self.verify_kv:
            for state, n in step.scheduled:
                for pos in range(state.num_computed_tokens + n):
                    slot = state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size
                    assert self.device.get(slot) == self._prefix_hash(state, pos), (
                        f"{state.req_id}: stale KV at position {pos}"
                    )
        tokens = [self.next_token(s.req_id, s.num_tokens) for s in step.sampling_states]
        return tokens, [None] * len(tokens)

    def _prefix_hash(self, state: RequestState, pos: int) -> int:
        hashes = self._prefix_hashes.setdefault(state.req_id, [])
        tokens = state.prompt_token_ids
        while len(hashes) <= pos:
            i = len(hashes)
            token = tokens[i] if i < len(tokens) else state.output_token_ids[i - len(tokens)]
            hashes.append(hash((hashes[-1] if i else 0, token)))
        return hashes[pos]

    def _copy_blocks(self, pairs: tuple[tuple[int, int], ...], src: dict[int, int], dst: dict[int, int]) -> None:
        for a, b in pairs:
            for off in range(self.block_size):
                if a * self.block_size + off in src:
                    dst[b * self.block_size + off] = src[a * self.block_size + off]
                else:
                    dst.pop(b * self.block_size + off, None)


def drive(
    sched: Scheduler,
    worker: MirrorWorker,
    max_steps: int = 100_000,
    check: bool = True,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    overlap: bool = False,
) -> int:
    """Run plan/execute/update until nothing is left; returns the number of steps.

    With `overlap`, plan N+1 is made and executed before output N is applied, as the
    engine loop does (two plans in flight)."""
    steps = 0
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    while sched.needs_plan() or pending:
        assert steps < max_steps, "did not finish (livelock?)"
        if sched.needs_plan():
            plan = sched.schedule(now=float(steps))
            if on_step:
                on_step(steps, plan)
            pending.append((plan, worker.execute(plan)))
        if not overlap or len(pending) == 2 or not sched.has_unfinished_requests():
            done_plan, out = pending.pop(0)
            sched.update_from_output(done_plan, out, now=float(steps))
        if check:
            sched.check_integrity()
        steps += 1
    return steps

