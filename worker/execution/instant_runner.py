"""`InstantRunner`: a model-free stand-in for `ModelRunner` with the same interface.

It is a fake *model* behind the real plan consumer (`worker.execution.step_executor` over
`worker.execution.input_batch`): request state, block tables, preemption and every check of a plan
are the real runner's code; only the step itself is replaced, by a deterministic token:

    next token = (last token * 31 + position of the new token) % vocab, skipping EOS

so the front-door benchmark and the process and engine tests run without a model, and a
plan the real runner could not execute raises exactly as there.
"""

from __future__ import annotations

import torch

from scheduler.output import TokenLogprobs
from worker.config import WorkerConfig, WorkerInfo
from worker.execution.input_batch import InputBatch, RequestState, StepInputs, SwapPairs
from worker.execution.kv_cache import check_swap_pairs
from worker.execution.step_executor import PlanRunner, StepExecutor

INSTANT_VOCAB_SIZE = 32000
INSTANT_EOS_TOKEN_ID = 2
# What SmolLM2-135M keeps per token in float32 (2 x 30 layers x 3 KV heads x 64 dims x 4 B),
# so block counts look like the default model's.
INSTANT_KV_BYTES_PER_TOKEN = 46080
_DEFAULT_MAX_MODEL_LEN = 8192


class InstantRunner(PlanRunner):
    """A fake model behind the real plan consumer; `eos_after` makes the n-th output EOS."""

    def __init__(self, config: WorkerConfig, eos_after: int | None = None) -> None:
        if eos_after is not None and eos_after < 1:
            raise ValueError(f"eos_after must be >= 1, got {eos_after}")
        self.config = config
        self.eos_after = eos_after
        block_bytes = config.block_size * INSTANT_KV_BYTES_PER_TOKEN
        max_model_len = config.max_model_len or _DEFAULT_MAX_MODEL_LEN
        self.info = WorkerInfo(
            model_name="instant",
            model_path="instant",
            architecture="InstantRunner",
            device="cpu",
            dtype="none",
            attention_backend="none",
            vocab_size=INSTANT_VOCAB_SIZE,
            eos_token_ids=(INSTANT_EOS_TOKEN_ID,),
            max_model_len=max_model_len,
            block_size=config.block_size,
            num_gpu_blocks=config.kv_cache_memory // block_bytes,
            num_cpu_blocks=int(config.swap_space * (1 << 30)) // block_bytes,
            kv_bytes_per_token=INSTANT_KV_BYTES_PER_TOKEN,
            num_params=0,
        )
        self.batch = InputBatch(max_model_len, config.block_size, torch.device("cpu"),
                                num_blocks=self.info.num_gpu_blocks)
        self.executor = StepExecutor(self.batch, self)

    def swap(self, swap_out: SwapPairs, swap_in: SwapPairs) -> None:
        """No KV to move; the block ids are checked as the real cache checks them."""
        check_swap_pairs(swap_out, swap_in, self.info.num_gpu_blocks, self.info.num_cpu_blocks)

    def run(self, step: StepInputs) -> tuple[list[int], list[TokenLogprobs | None]]:
        for state, count in step.scheduled:
            for pos in state.prompt_positions(count):
                k = state.sampling_params.prompt_logprobs or 0
                fake = _fake_logprobs(state.prompt_token_ids[pos + 1], k)
                assert state.prompt_logprobs is not None
                state.prompt_logprobs[pos + 1] = TokenLogprobs(0.0, fake.top, rank=1)
        tokens = [self._next_token(state) for state in step.sampling_states]
        logprobs = [
            None
            if s.sampling_params.logprobs is None
            else _fake_logprobs(t, s.sampling_params.logprobs)
            for s, t in zip(step.sampling_states, tokens, strict=True)
        ]
        return tokens, logprobs

    def _next_token(self, state: RequestState) -> int:
        num_outputs = len(state.output_token_ids)
        if self.eos_after is not None and num_outputs + 1 == self.eos_after:
            return INSTANT_EOS_TOKEN_ID
        last = state.output_token_ids[-1] if num_outputs else state.prompt_token_ids[-1]
        token = (last * 31 + state.num_tokens) % INSTANT_VOCAB_SIZE
        while token in self.info.eos_token_ids:
            token = (token + 1) % INSTANT_VOCAB_SIZE
        return token


def _fake_logprobs(token: int, n: int) -> TokenLogprobs:
    """Well-formed logprobs: the sampled token first, then its neighbours, less likely."""
    top = tuple(((token + i) % INSTANT_VOCAB_SIZE, -float(i)) for i in range(n))
    return TokenLogprobs(logprob=0.0, top=top)
