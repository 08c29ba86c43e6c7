"""The start-up calibration of the step-cost model: a handful of real step plans whose
measured times seed `OnlineStepCost` before the server reports healthy.

The plans follow the plan protocol exactly (new requests once, then cached diffs, then a
plan that finishes them all), so any worker executes them; their requests use blocks of
the still-empty KV pool, and their ids start with "__calibration" (the scheduler has not
seen a request yet, so nothing can collide). Step ids are negative: they never meet the
scheduler's own. The simulator seeds its model with the same shapes priced by its cost model.

The shapes, smallest cost first (so a time cap keeps the most telling ones)::

    warm-up   1 request prefilling 16 tokens          (first step of a process: not used)
    1         4 requests prefilling 16 tokens each    several requests, several tokens
    2         those 4 decoding                        a decode batch
    3         1 of them decoding                      a one-token step (no multi-token cost)
    4         1 request prefilling 64 of 128 tokens   a chunk that does not sample
    5         its second 64 (context 64)              a chunk after context
    6         all 5 decoding                          a larger decode batch, longer context
    7         the long one decoding alone             one token at context 129
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.arith import cdiv
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.sampling import SamplingParams
from scheduler.step_cost import BatchShape

PREFIX = "__calibration"
# per step: request -> tokens to compute; request names map to prompt lengths below
_STEPS: tuple[dict[str, int], ...] = (
    {"w": 16},
    {"a0": 16, "a1": 16, "a2": 16, "a3": 16},
    {"a0": 1, "a1": 1, "a2": 1, "a3": 1},
    {"a0": 1},
    {"b": 64},
    {"b": 64},
    {"a0": 1, "a1": 1, "a2": 1, "a3": 1, "b": 1},
    {"b": 1},
)
_PROMPTS = {"w": 16, "a0": 16, "a1": 16, "a2": 16, "a3": 16, "b": 128}
_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class CalibrationStep:
    plan: SchedulerOutput
    shape: BatchShape
    measured: bool  # False for the warm-up step


@dataclass
class _Req:
    prompt: list[int]
    computed: int = 0
    sampled: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def known(self) -> int:
        return len(self.prompt) + self.sampled


def calibration_steps(
    block_size: int, num_blocks: int, max_model_len: int, vocab_size: int
) -> list[CalibrationStep]:
    """The calibration plans for a worker with this KV pool; [] when it is too small for them."""
    need = sum(cdiv(p + 8, block_size) for p in _PROMPTS.values())
    if need > num_blocks or max(_PROMPTS.values()) + 8 > max_model_len:
        return []
    reqs: dict[str, _Req] = {}
    next_block = 0
    out: list[CalibrationStep] = []
    for k, step in enumerate(_STEPS):
        new, cached, shape = [], [], BatchShape()
        for name, n in step.items():
            rid = f"{PREFIX}-{name}"
            req = reqs.get(name)
            is_new = req is None
            if req is None:
                prompt = [(7 * i + 3 + len(reqs)) % vocab_size for i in range(_PROMPTS[name])]
                req = reqs[name] = _Req(prompt)
            grow = cdiv(req.computed + n, block_size) - len(req.blocks)
            added = list(range(next_block, next_block + grow))
            next_block += grow
            req.blocks += added
            samples = req.computed + n == req.known
            shape.add(n, req.computed, samples)
            if is_new:
                new.append(NewRequestData(rid, tuple(req.prompt), _PARAMS, tuple(req.blocks), 0))
            else:
                cached.append(CachedRequestData(rid, tuple(added), req.computed, False))
            req.computed += n
            req.sampled += samples
        plan = SchedulerOutput(-1 - k, tuple(new), tuple(cached),
                               {f"{PREFIX}-{name}": n for name, n in step.items()},
                               sum(step.values()), frozenset(), frozenset(), frozenset())
        out.append(CalibrationStep(plan, shape, measured=k > 0))
    return out


def finish_plan(steps: list[CalibrationStep]) -> SchedulerOutput:
    """The plan that drops every calibration request from the worker."""
    ids = frozenset(rid for s in steps for rid in s.plan.num_scheduled_tokens)
    return SchedulerOutput(-1 - len(steps), (), (), {}, 0, frozenset(), ids, frozenset())
