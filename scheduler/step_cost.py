"""What a step costs, as the scheduler sees it: the step's shape, the features a step-time
model is linear in, and the one rule that decides swap against recompute.

A step is described by a few aggregates over the requests it computes (`BatchShape`). Two
models read them: the simulator's roofline (`loadgen/sim/cost_model.py`, the virtual clock)
and the online fit the engine and the simulator hand the scheduler
(`scheduler/step_cost_fit.py`). Both price the overheads with the same `overhead_terms`; the fit
adds the per-token, per-sampled-position and per-attention-pair terms of `step_features`.

A cost function is any `StepCostFn`: a plain callable from a shape to predicted seconds.
The scheduler only calls it; who fits it (engine, simulator, a test's fake) is not its
business. It must not decrease when tokens are added to a step. A model fitted from measured
steps may also say how far they run over its predictions at the tail (`TracksOverrun`):
the slo policy shortens a TPOT objective by that much before holding steps to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass
class BatchShape:
    """Aggregates of one step over the requests it computes; build with `add`."""

    num_reqs: int = 0
    num_prefill_tokens: int = 0  # tokens of chunks that do not end in a single decode
    num_decode_tokens: int = 0
    num_sampled: int = 0  # positions that go through the LM head
    attention_pairs: int = 0  # (query, key) pairs over all requests, causal
    kv_tokens_read: int = 0  # context each request's attention reads, new tokens included
    swap_blocks: int = 0  # blocks copied over the host link (out + in)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def add(self, num_tokens: int, context: int, samples: bool = True, count: int = 1) -> None:
        """Add `count` requests computing `num_tokens` after `context` tokens of valid KV."""
        if num_tokens < 1:
            return
        self.num_reqs += count
        if num_tokens == 1 and samples:
            self.num_decode_tokens += count
        else:
            self.num_prefill_tokens += num_tokens * count
        self.num_sampled += count if samples else 0
        # query i (0-based) attends to context + i + 1 keys
        self.attention_pairs += count * (num_tokens * context + num_tokens * (num_tokens + 1) // 2)
        self.kv_tokens_read += count * (context + num_tokens)

    def copy(self) -> BatchShape:
        return BatchShape(
            self.num_reqs, self.num_prefill_tokens, self.num_decode_tokens, self.num_sampled,
            self.attention_pairs, self.kv_tokens_read, self.swap_blocks,
        )


StepCostFn = Callable[[BatchShape], float]


def overhead_terms(batch: BatchShape) -> tuple[float, ...]:
    """What each of the overheads is paid per: the step, its requests, the KV tokens they
    read, and whether it computes more than one token (CPU BLAS runs a one-token step as
    matrix-vector products). The simulator's `HardwareProfile.overheads` multiply these."""
    return (1.0, float(batch.num_reqs), float(batch.kv_tokens_read), float(batch.num_tokens > 1))


# The online fit's terms, in `step_features` order: the overheads, then what the roofline's
# FLOPs count (dense matmuls per computed token, the LM head per sampled position, attention
# per (query, key) pair), here each with its own coefficient.
FEATURES = ("step", "request", "kv_token_read", "multi_token", "token", "sampled", "attention_pair")


def step_features(batch: BatchShape) -> tuple[float, ...]:
    """The terms a step's time is linear in (swap copies aside), named by `FEATURES`."""
    return (*overhead_terms(batch), float(batch.num_tokens), float(batch.num_sampled),
            float(batch.attention_pairs))


# ---- swap against recompute (preemption_mode="auto") -------------------------------------

def swap_time(num_tokens: int, kv_bytes_per_token: int, bandwidth: float) -> float:
    """Seconds to copy a request's KV out to the host and later back in (both directions)."""
    return 2 * num_tokens * kv_bytes_per_token / bandwidth


def recompute_time(cost: StepCostFn, num_tokens: int) -> float:
    """Seconds that recomputing `num_tokens` of KV adds to the steps it rides in: one request
    prefilling them from scratch, less what an empty step costs anyway. (Chunking does not
    change the attention pairs: chunks of a prompt sum to the same causal triangle.)"""
    full = BatchShape()
    full.add(num_tokens, 0)
    return max(0.0, cost(full) - cost(BatchShape()))


def swap_is_cheaper(
    num_tokens: int, kv_bytes_per_token: int, bandwidth: float, cost: StepCostFn
) -> bool:
    """The one swap-vs-recompute rule of the server and the simulator."""
    return swap_time(num_tokens, kv_bytes_per_token, bandwidth) < recompute_time(cost, num_tokens)


def flop_rate_cost(flops_per_token: float, compute_rate: float) -> StepCostFn:
    """A cost of dense FLOPs only, for a scheduler given no measured model: what
    `preemption_mode="auto"` assumed before it had one (A100 / Llama-8B constants)."""

    def cost(batch: BatchShape) -> float:
        return batch.num_tokens * flops_per_token / compute_rate

    return cost


@runtime_checkable
class TracksOverrun(Protocol):
    """A cost model that compares its predictions with measured steps."""

    def overrun(self) -> float:
        """measured / predicted step time at a high quantile of recent steps (>= 1)."""
        ...


def overrun_of(cost: StepCostFn | None) -> float:
    """`cost`'s tail overrun, 1.0 for a model that does not track one (a fixed model, a
    test's fake, the simulator's roofline: their predictions are what happens)."""
    return cost.overrun() if isinstance(cost, TracksOverrun) else 1.0
