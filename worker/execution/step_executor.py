"""`StepExecutor`: the worker's one consumer of step plans. It applies each plan as diffs
to the persistent input batch and runs the step on whatever model is behind it.

    plan ──▶ InputBatch.apply (frees, preemptions, swaps, new and cached requests)
         ──▶ InputBatch.prepare (flattened step)  ──▶ model.run(step) (forward + sampling)
         ──▶ InputBatch.advance (computed counts, sampled tokens)  ──▶ ModelRunnerOutput

Every runner is a `StepModel` behind this one executor: the torch model (`ModelRunner`), the
instant stand-in (`InstantRunner`), the scheduler tests' KV mirror. So the plan logic the
service tests run on the stand-in is the plan logic the real worker runs. What each request
holds and how a step's inputs are built from it is `InputBatch`'s
(`worker.execution.input_batch`).
"""

from __future__ import annotations

from typing import Protocol

from scheduler.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from worker.execution.input_batch import InputBatch, RequestState, StepInputs, SwapPairs


class StepModel(Protocol):
    """The model side of a runner."""

    def swap(self, swap_out: SwapPairs, swap_in: SwapPairs) -> None:
        """Copy (device, host) blocks out, then (host, device) blocks in."""

    def run(self, step: StepInputs) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Compute the step; one token (and its logprobs, when asked) per sampling request,
        aligned with `step.sampling_states`."""


class StepExecutor:
    """Applies plans to `batch` and runs `model` on them."""

    def __init__(self, batch: InputBatch, model: StepModel) -> None:
        self.batch = batch
        self.model = model

    @property
    def requests(self) -> dict[str, RequestState]:
        """Every request the worker holds state for (active or preempted)."""
        return self.batch.requests

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Apply `plan` and run its step; returns the sampled token of each request."""
        scheduled = self.batch.apply(plan, self.model.swap)
        if plan.is_empty:
            return ModelRunnerOutput(step_id=plan.step_id, sampled_token_ids={})
        step = self.batch.prepare(scheduled)
        tokens, logprobs = self.model.run(step)
        self.batch.advance(step, tokens)
        states = step.sampling_states
        return ModelRunnerOutput(
            step_id=plan.step_id,
            sampled_token_ids={s.req_id: t for s, t in zip(states, tokens, strict=True)},
            logprobs={
                s.req_id: lp for s, lp in zip(states, logprobs, strict=True) if lp is not None
            },
            prompt_logprobs=_finished_prompts(states),
        )


def _finished_prompts(states: list[RequestState]) -> dict[str, tuple[TokenLogprobs | None, ...]]:
    """The prompt logprobs of the requests that sampled their first token this step; they
    travel once, with it."""
    out = {}
    for state in states:
        if state.prompt_logprobs is not None and len(state.output_token_ids) == 1:
            out[state.req_id] = tuple(state.prompt_logprobs)
            state.prompt_logprobs = None
    return out


class PlanRunner:
    """The plan side every runner shares: plans go through `self.executor`, which the
    runner builds over its batch and its model side."""

    executor: StepExecutor

    @property
    def requests(self) -> dict[str, RequestState]:
        """Every request the worker holds state for (active or preempted)."""
        return self.executor.requests

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Apply `plan` and run its step; returns the sampled token of each request."""
        return self.executor.execute(plan)
