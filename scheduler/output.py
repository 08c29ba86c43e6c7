"""The messages between scheduler and worker: plain frozen dataclasses of ids and ints.

`SchedulerOutput` is the step plan (a diff: token lists travel once per request);
`ModelRunnerOutput` is the worker's answer; `RequestOutput` is what `update_from_output`
hands to the engine for each request that produced something this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sampling import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker has not seen: its token list travels once, here."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]  # the whole block table
    num_computed_tokens: int  # KV already valid (prefix-cache hit), before this step


@dataclass(frozen=True)
class CachedRequestData:
    """A request the worker already holds; only what changed since the last plan.

    A preempted request (recompute or swap) keeps its state in the worker (tokens,
    sampler generator); when it resumes, `new_block_ids` is its whole new block table and
    `num_computed_tokens` says how much KV is valid (0 after recompute, unless prefix hits).
    """

    req_id: str
    new_block_ids: tuple[int, ...]  # appended to the block table (the whole table if resumed)
    num_computed_tokens: int  # before this step; the worker may check it against its own
    resumed_from_preemption: bool  # back after preemption: block table replaced by new_block_ids


@dataclass(frozen=True)
class SchedulerOutput:
    """One step plan. The worker applies it in order: frees, swaps, then the forward."""

    step_id: int
    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]  # req id -> tokens computed this step
    total_num_scheduled_tokens: int
    preempted_req_ids: frozenset[str]  # leave the active batch, keep the state (tokens, rng)
    finished_req_ids: frozenset[str]  # finished since the last plan: drop all state
    aborted_req_ids: frozenset[str]  # aborted since the last plan: drop all state
    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block), done first
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block), done second

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (it may still carry frees, preemptions or swaps)."""
        return self.total_num_scheduled_tokens == 0

    @property
    def is_noop(self) -> bool:
        """Nothing at all for the worker to do: such a plan need not be sent."""
        return self.is_empty and not (
            self.finished_req_ids
            or self.aborted_req_ids
            or self.preempted_req_ids
            or self.swap_out
            or self.swap_in
        )

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the top-n alternatives at that position."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int | None = None  # the token's rank by logprob (1: most likely), when computed


@dataclass(frozen=True)
class ModelRunnerOutput:
    """The worker's answer to one plan."""

    step_id: int
    # req id -> the token sampled this step; absent for a chunk that did not reach the end.
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # req id -> its prompt's logprobs (None for the first token), sent with its first token
    prompt_logprobs: dict[str, tuple[TokenLogprobs | None, ...]] = field(default_factory=dict)
    error: str | None = None  # the step failed; the traceback is in the worker's log
    # seconds the worker spent executing the plan (0: not measured); a timing, not part of
    # what the output says, so equality ignores it
    execute_time: float = field(default=0.0, compare=False)


@dataclass(slots=True)
class RequestOutput:
    """Per-request result of applying one `ModelRunnerOutput` (one per request per step, so
    a slotted, non-frozen dataclass: frozen ones are ~2x slower to build)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_token_id: int | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
