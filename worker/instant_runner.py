"""`InstantRunner`: a model-free stand-in for `ModelRunner` with the same interface.

It keeps the per-request state the real runner keeps (token lists, block tables, computed
counts, preempted requests kept aside) and applies plans as the same diffs, checking them
as strictly, but "samples" a deterministic token instantly:

    next token = (last token * 31 + position of the new token) % vocab, skipping EOS

so the front-door benchmark and the process and engine tests run without a model. A plan
the real runner could not execute (unknown request, tokens past the known sequence or
past the block table) raises, as the real runner would.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.sampling import SamplingParams
from worker.config import WorkerConfig, WorkerInfo

INSTANT_VOCAB_SIZE = 32000
INSTANT_EOS_TOKEN_ID = 2
# What SmolLM2-135M keeps per token in float32 (2 x 30 layers x 3 KV heads x 64 dims x 4 B),
# so block counts look like the default model's.
INSTANT_KV_BYTES_PER_TOKEN = 46080
_DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class _RequestState:
    """What the worker remembers about one request between plans."""

    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    active: bool = True  # False while preempted


class InstantRunner:
    """Executes step plans with no model; `eos_after` makes the n-th output token EOS."""

    def __init__(self, config: WorkerConfig, eos_after: int | None = None) -> None:
        if eos_after is not None and eos_after < 1:
            raise ValueError(f"eos_after must be >= 1, got {eos_after}")
        self.config = config
        self.eos_after = eos_after
        block_bytes = config.block_size * INSTANT_KV_BYTES_PER_TOKEN
        self.info = WorkerInfo(
            model_name="instant",
            model_path="instant",
            architecture="InstantRunner",
            device="cpu",
            dtype="none",
            attention_backend="none",
            vocab_size=INSTANT_VOCAB_SIZE,
            eos_token_ids=(INSTANT_EOS_TOKEN_ID,),
            max_model_len=config.max_model_len or _DEFAULT_MAX_MODEL_LEN,
            block_size=config.block_size,
            num_gpu_blocks=config.kv_cache_memory // block_bytes,
            num_cpu_blocks=int(config.swap_space * (1 << 30)) // block_bytes,
            kv_bytes_per_token=INSTANT_KV_BYTES_PER_TOKEN,
            num_params=0,
        )
        self.requests: dict[str, _RequestState] = {}

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the plan's diffs (frees, swaps, new and cached requests), then "sample"."""
        for req_id in plan.finished_req_ids | plan.aborted_req_ids:
            self.requests.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            self._state(req_id).active = False
        self._check_swaps(plan.swap_out, plan.swap_in)
        for new in plan.scheduled_new_reqs:
            self._add_new(new)
        for cached in plan.scheduled_cached_reqs:
            self._update_cached(cached)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            token = self._advance(req_id, num_tokens)
            if token is None:
                continue
            sampled[req_id] = token
            n = self.requests[req_id].params.logprobs
            if n is not None:
                logprobs[req_id] = _fake_logprobs(token, n)
        return ModelRunnerOutput(step_id=plan.step_id, sampled_token_ids=sampled,
                                 logprobs=logprobs)

    def _state(self, req_id: str) -> _RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise ValueError(f"plan refers to unknown request {req_id!r}")
        return state

    def _add_new(self, new: NewRequestData) -> None:
        if new.req_id in self.requests:
            raise ValueError(f"new request {new.req_id!r} is already known to the worker")
        self._check_blocks(new.block_ids)
        self.requests[new.req_id] = _RequestState(
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            params=new.sampling_params,
        )

    def _update_cached(self, cached: CachedRequestData) -> None:
        state = self._state(cached.req_id)
        self._check_blocks(cached.new_block_ids)
        if cached.resumed_from_preemption:
            state.block_ids = list(cached.new_block_ids)
            state.active = True
        elif not state.active:
            raise ValueError(f"request {cached.req_id!r} is preempted but not marked resumed")
        else:
            state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens

    def _advance(self, req_id: str, num_tokens: int) -> int | None:
        """Compute `num_tokens` positions; return the new token when they reach the end."""
        state = self._state(req_id)
        if not state.active:
            raise ValueError(f"request {req_id!r} is scheduled while preempted")
        end = state.num_computed_tokens + num_tokens
        if num_tokens < 1 or end > len(state.token_ids):
            raise ValueError(
                f"request {req_id!r}: {num_tokens} tokens scheduled from position "
                f"{state.num_computed_tokens}, but the worker knows {len(state.token_ids)} tokens"
            )
        if end > len(state.block_ids) * self.config.block_size:
            raise ValueError(
                f"request {req_id!r}: {end} tokens do not fit in {len(state.block_ids)} blocks"
            )
        state.num_computed_tokens = end
        if end < len(state.token_ids):
            return None  # a prefill chunk that did not reach the end of the prompt
        token = self._next_token(state)
        state.token_ids.append(token)
        return token

    def _next_token(self, state: _RequestState) -> int:
        num_outputs = len(state.token_ids) - state.num_prompt_tokens
        if self.eos_after is not None and num_outputs + 1 == self.eos_after:
            return INSTANT_EOS_TOKEN_ID
        position = len(state.token_ids)
        token = (state.token_ids[-1] * 31 + position) % INSTANT_VOCAB_SIZE
        while token in self.info.eos_token_ids:
            token = (token + 1) % INSTANT_VOCAB_SIZE
        return token

    def _check_blocks(self, block_ids: tuple[int, ...]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.info.num_gpu_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside [0, {self.info.num_gpu_blocks})")

    def _check_swaps(
        self, swap_out: tuple[tuple[int, int], ...], swap_in: tuple[tuple[int, int], ...]
    ) -> None:
        device_blocks = [d for d, _ in swap_out] + [d for _, d in swap_in]
        host_blocks = [h for _, h in swap_out] + [h for h, _ in swap_in]
        self._check_blocks(tuple(device_blocks))
        bad = [h for h in host_blocks if not 0 <= h < self.info.num_cpu_blocks]
        if bad:
            raise ValueError(f"host block ids {bad} outside [0, {self.info.num_cpu_blocks})")


def _fake_logprobs(token: int, n: int) -> TokenLogprobs:
    """Well-formed logprobs: the sampled token first, then its neighbours, less likely."""
    top = tuple(((token + i) % INSTANT_VOCAB_SIZE, -float(i)) for i in range(n))
    return TokenLogprobs(logprob=0.0, top=top)
