"""Prompt log-probabilities on the default model, driven by the real scheduler: the same
values whether the prompt is computed in one step, split into chunks, preempted and
recomputed mid-prompt, or partly cached (a prefix-cache hit would skip positions whose
logprobs are asked for, so such a request computes its whole prompt)."""

from __future__ import annotations

from typing import Any

import pytest
from sched_driver import drive

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."


class Recorder:
    """The runner, remembering every prompt-logprobs answer it gives."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.prompt: dict[str, tuple[TokenLogprobs | None, ...]] = {}

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute(plan)
        for req_id, lps in out.prompt_logprobs.items():
            assert req_id not in self.prompt, "prompt logprobs sent twice"
            self.prompt[req_id] = lps
        return out


def _run(runner: Any, *phases: dict[str, tuple[list[int], int | None]], **cfg: Any) -> tuple[Recorder, Scheduler]:
    """Each phase's requests, run to their end before the next phase's arrive."""
    base: dict[str, Any] = dict(max_num_batched_tokens=256, num_gpu_blocks=200, block_size=4, max_model_len=512)
    base.update(cfg)
    sched = Scheduler(SchedulerConfig(**base))
    recorder = Recorder(runner)
    for prompts in phases:
        for i, (req_id, (prompt, k)) in enumerate(prompts.items()):
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)
            sched.add_request(Request(req_id, prompt, params, arrival_time=float(i)))
        drive(sched, recorder, overlap=True)  # type: ignore[arg-type]
    return recorder, sched


def _same(a: tuple[TokenLogprobs | None, ...], b: tuple[TokenLogprobs | None, ...]) -> None:
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4) and x.rank == y.rank
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.fixture(scope="module")
def prompt(smol_tokenizer: Any) -> list[int]:
    return list(smol_tokenizer.encode(TEXT))


@pytest.fixture(scope="module")
def one_step(smol_runner_session: Any, prompt: list[int]) -> tuple[TokenLogprobs | None, ...]:
    recorder, _ = _run(smol_runner_session, {"a": (prompt, 3)})
    return recorder.prompt["a"]


def test_values_are_the_tokens_own(one_step: tuple[TokenLogprobs | None, ...], prompt: list[int]) -> None:
    assert len(one_step) == len(prompt) and one_step[0] is None
    for token, lp in zip(prompt[1:], one_step[1:], strict=True):
        assert lp is not None and lp.logprob <= 0.0 and lp.rank is not None and lp.rank >= 1 and len(lp.top) == 3
        assert lp.top[0][1] >= lp.logprob and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert (lp.rank == 1) == (lp.top[0][0] == token)
        if lp.rank <= 3:
            assert lp.top[lp.rank - 1] == (token, pytest.approx(lp.logprob))


@pytest.mark.parametrize("cfg", [
    {"max_num_batched_tokens": 7},  # chunks of 7 across the prompt
    {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 5},
])
def test_chunked_prompts_give_the_same_values(smol_runner: Any, prompt: list[int], one_step: Any, cfg: dict[str, Any]) -> None:
    recorder, _ = _run(smol_runner, {"a": (prompt, 3)}, **cfg)
    _same(recorder.prompt["a"], one_step)


def test_preempted_mid_prompt_gives_the_same_values(smol_runner: Any, prompt: list[int], one_step: Any) -> None:
    other = prompt[::-1]
    recorder, sched = _run(smol_runner, {"other": (other, None), "a": (prompt, 3)}, num_gpu_blocks=8, max_num_batched_tokens=8)
    assert sched.num_preemptions > 0
    _same(recorder.prompt["a"], one_step)
    assert "other" not in recorder.prompt


def test_a_prefix_cache_hit_does_not_skip_positions(smol_runner: Any, prompt: list[int], one_step: Any) -> None:
    """The same prompt computed first without prompt logprobs: its blocks are cached, and a
    later request asking for them computes its whole prompt anyway."""
    recorder, sched = _run(smol_runner, {"warm": (prompt, None)}, {"a": (prompt, 3)}, {"b": (prompt + [13], None)},
                           enable_prefix_caching=True)
    _same(recorder.prompt["a"], one_step)
    assert sched.stats().prefix_cache_hits >= len(prompt) - 4  # "b" did hit the cache
