"""`StepTimeBudget`: sizes prefill chunks so that a step's predicted time stays within the
step-time target while requests decode.

The scheduler schedules every decode of its running requests first (decodes are never
dropped or shortened for prefill; under slo, see the exception below), then asks here for
each chunk, in its usual order (running prefills, swapped requests coming back, waiting
requests)::

    step so far (decodes, earlier chunks) ──▶ chunk(ctx, n) ──▶ n, or the longest chunk
                                              ending on a block boundary that keeps
                                              cost(step + chunk) <= the step's limit

The step's limit is `max(target, decodes / (1 - prefill_share))`, where `decodes` is the
predicted time of the step's decodes alone: below the target's reach it is the target;
once the decodes alone take more than `1 - prefill_share` of the target (a large batch, a
slow machine), the limit grows with them, so prefill keeps that share of the step's time
instead of shrinking to one block a step. `prefill_share = 0`: the limit is the target.

A TPOT objective (the slo policy's target, `begin_step(objective)`) is firm: the share
does not stretch it while the decodes alone fit within it, because a step over it misses
the objective of every request decoding in it; prefill then gets what the decodes leave
(at least the guaranteed chunk below). Once the decodes alone are over the objective it
is lost for this step anyway, and the share's rule applies again.

- Nothing decodes in the step: the chunk keeps the whole token budget (throughput), but
  with `hold_prefill_only` (the slo policy) the target still holds: an urgent arrival
  must not wait behind a prefill-only step of seconds (2,048 tokens take ~5 s on a
  2-core CPU).
- The first prefill of a step always gets at least up to its next block boundary (a whole
  block when its computed part is block-aligned, as it is after any time-capped chunk or
  prefix hit), even when the decodes alone are over the target: long prompts always finish.
- A request entering the step with one token to compute, or swapping blocks back in,
  waits a step if the step holds a prefill chunk it would push over the target (`admit`).
- A step whose decodes alone are predicted over the target is counted
  (`num_decode_over_target`), not split: only fewer running requests (`--max-num-seqs`)
  make such steps shorter. Under slo, a step held to a TPOT objective is the exception:
  the decodes that may sit out (`Scheduler.sits_out`: no TPOT objective, or one at least
  twice the tightest) join after the others only while the step stays within its limit,
  less the step's guaranteed block of prefill while prefill waits (`loose_decodes`); the
  one that has waited longest always joins, so each keeps decoding.
- A preemption later in the step (its swap-out copies) can still push it over: victims
  are rare, and unscheduling one shortens the step too.

Chunk ends:  ctx=37, block 16 ─▶ candidates end at 48, 64, 80, ...: m = 11, 27, 43, ...
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.step import StepBuilder
from scheduler.step_cost import BatchShape, StepCostFn


def step_limit(target: float, decode_s: float, prefill_share: float, firm: bool) -> float:
    """A step's limit from its `target`, the predicted time of its decodes alone
    (`decode_s`, 0 without decodes) and the prefill share; `firm`: the target is a TPOT
    objective (see the module docstring)."""
    if not prefill_share or not decode_s or (firm and decode_s <= target):
        return target
    return max(target, decode_s / (1.0 - prefill_share))


def loose_cap(
    cost: StepCostFn, shape: BatchShape, limit: float, block: int, context: int | None
) -> float:
    """The time the decodes that may sit out a step fill it to: its `limit`, less what a
    `block` of prefill after `context` tokens (None: no prefill waits) adds to a step
    holding `shape`."""
    if context is None:
        return limit
    with_block = shape.copy()
    with_block.add(block, context, samples=False)
    return limit - (cost(with_block) - cost(shape))


def fitting_decodes(
    cost: StepCostFn, shape: BatchShape, contexts: Sequence[int], cap: float
) -> int:
    """How many decodes (after `contexts` tokens each, in order) join a step holding `shape`:
    the first always (every request keeps decoding), each next while the step's predicted
    time stays within `cap` seconds."""
    trial = shape.copy()
    for k, ctx in enumerate(contexts):
        trial.add(1, ctx)
        if k and cost(trial) > cap:
            return k
    return len(contexts)


class StepTimeBudget:
    """Per-scheduler state of the time budget; `begin_step` resets the per-step part."""

    def __init__(
        self, target: float, cost: StepCostFn, block_size: int, prefill_share: float = 0.0,
        hold_prefill_only: bool = False,
    ) -> None:
        self.target = target
        self.cost = cost
        self.block_size = block_size
        self.prefill_share = prefill_share
        self.hold_prefill_only = hold_prefill_only  # a step without decodes keeps the target
        self.last_limit = target  # the limit of the last step that sized a chunk
        self.num_capped = 0  # prefill chunks shortened by the time budget
        self.num_decode_over_target = 0  # steps whose decodes alone were predicted over it
        self._limit: float | None = None  # this step's limit, once known
        self._target = target  # this step's target
        self._firm = False  # this step's target is a TPOT objective

    def begin_step(self, objective: float | None = None) -> None:
        """A new step, held to the TPOT `objective` in seconds (firm), else (None) to the
        configured target."""
        self._limit = None
        self._firm = objective is not None
        self._target = self.target if objective is None else objective

    def limit(self, shape: BatchShape) -> float:
        """The step's limit, fixed at its first chunk, admission or loose decode, when
        `shape` holds the step's decodes and nothing else (the scheduler schedules every
        decode first; under slo, every decode that may not sit out)."""
        if self._limit is None:
            limit = self._target
            if self.prefill_share and shape.num_decode_tokens:
                decodes = shape.copy()
                decodes.swap_blocks = 0
                limit = step_limit(limit, self.cost(decodes), self.prefill_share, self._firm)
            self._limit = self.last_limit = limit
        return self._limit

    def chunk(self, step: StepBuilder, context: int, n: int, end: int, num_blocks: int = 0) -> int:
        """Tokens a prefill of `n` tokens after `context` may compute in this step (0: none);
        `end` is where the request's known tokens end (reaching it samples a token), and
        `num_blocks` what it swaps in first."""
        shape = step.shape if step.shape is not None else self._shape_of(step)
        shape.swap_blocks = len(step.swap_in) + len(step.swap_out) + num_blocks
        unbounded = not shape.num_decode_tokens and not self.hold_prefill_only
        if unbounded or self._fits(shape, context, n, end):
            return n
        bs = self.block_size
        first = bs - context % bs  # the chunk that ends on the next block boundary
        lo, hi = 0, ((n - 1 - first) // bs + 1) if first < n else 0  # candidates shorter than n
        while lo < hi:  # the largest k in [1, hi] whose chunk first + (k - 1) * bs fits
            mid = (lo + hi + 1) // 2
            if self._fits(shape, context, first + (mid - 1) * bs, end):
                lo = mid
            else:
                hi = mid - 1
        if lo:
            m = first + (lo - 1) * bs
        elif not shape.num_prefill_tokens:
            # the one guaranteed chunk of the step: read from what the step holds, so that a
            # chunk sized for a request that then could not fit (it preempted itself) does
            # not use it up
            m = min(n, first)
        else:
            return 0
        self.num_capped += 1
        return m

    def admit(self, step: StepBuilder, context: int, n: int, end: int, num_blocks: int = 0) -> int:
        """Tokens a request entering the step (from waiting, or swapped with `num_blocks` to
        copy back in) computes: a prefill chunk sized by `chunk`; a one-token computation or a
        swap-in waits (0) if the step holds a prefill chunk, sized without it, that it would
        push over the target."""
        if n > 1:
            return self.chunk(step, context, n, end, num_blocks)
        shape = step.shape if step.shape is not None else self._shape_of(step)
        if not shape.num_prefill_tokens:
            return n
        trial = shape.copy()
        trial.add(n, context, context + n == end)
        trial.swap_blocks = len(step.swap_in) + len(step.swap_out) + num_blocks
        return n if self.cost(trial) <= self.limit(shape) else 0

    def loose_decodes(
        self, step: StepBuilder, contexts: Sequence[int], prefill_context: int | None
    ) -> int:
        """How many of the decodes that may sit out this step (after `contexts` tokens
        each, in the order they would join) join it: see `fitting_decodes`; the cap is the
        step's limit, less the step's one guaranteed block of prefill after
        `prefill_context` tokens (None: no prefill waits)."""
        shape = step.shape if step.shape is not None else self._shape_of(step)
        cap = loose_cap(self.cost, shape, self.limit(shape), self.block_size, prefill_context)
        return fitting_decodes(self.cost, shape, contexts, cap)

    def count_decodes(self, num_decodes: int, kv_tokens: int) -> None:
        """After a step is planned: its `num_decodes` decodes read `kv_tokens` in all."""
        decodes = BatchShape(
            num_reqs=num_decodes, num_decode_tokens=num_decodes, num_sampled=num_decodes,
            attention_pairs=kv_tokens, kv_tokens_read=kv_tokens,
        )
        if self.cost(decodes) > self._target:
            self.num_decode_over_target += 1

    def _fits(self, shape: BatchShape, context: int, m: int, end: int) -> bool:
        limit = self.limit(shape)
        trial = shape.copy()
        trial.add(m, context, context + m == end)
        return self.cost(trial) <= limit

    @staticmethod
    def _shape_of(step: StepBuilder) -> BatchShape:
        """The shape of what the step holds so far; kept up to date by `step.add` after this."""
        shape = BatchShape()
        for req, n in step.scheduled.values():
            ctx = req.num_computed_tokens
            shape.add(n, ctx, ctx + n == req.num_tokens + req.num_placeholders)
        step.shape = shape
        return shape
