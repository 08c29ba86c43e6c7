"""InstantRunner: the model-free runner keeps request state exactly like the real one."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.sampling import SamplingParams
from worker.config import WorkerConfig
from worker.execution.input_batch import PlanError
from worker.execution.instant_runner import (
    INSTANT_EOS_TOKEN_ID,
    INSTANT_KV_BYTES_PER_TOKEN,
    InstantRunner,
)

CONFIG = WorkerConfig(block_size=4, kv_cache_memory=64 * 4 * INSTANT_KV_BYTES_PER_TOKEN)
PROMPT = (7, 8, 9, 10, 11)


def step(
    step_id: int,
    new: tuple[NewRequestData, ...] = (),
    cached: tuple[CachedRequestData, ...] = (),
    scheduled: dict[str, int] | None = None,
    **sets: frozenset[str],
) -> SchedulerOutput:
    scheduled = scheduled or {}
    base = SchedulerOutput(step_id, new, cached, scheduled, sum(scheduled.values()),
                           frozenset(), frozenset(), frozenset())
    return dataclasses.replace(base, **sets)


def admit(runner: InstantRunner, params: SamplingParams | None = None) -> int:
    """Prefill request "a" in one step; return its first token."""
    new = NewRequestData("a", PROMPT, params or SamplingParams(), (0, 1), 0)
    return runner.execute(step(0, new=(new,), scheduled={"a": 5})).sampled_token_ids["a"]


def decode(runner: InstantRunner, step_id: int, computed: int, blocks: tuple[int, ...] = (),
           resumed: bool = False, n: int = 1) -> dict[str, int]:
    cached = CachedRequestData("a", blocks, computed, resumed)
    return runner.execute(step(step_id, cached=(cached,), scheduled={"a": n})).sampled_token_ids


def test_info_sizes_the_cache_from_the_config() -> None:
    info = InstantRunner(CONFIG).info
    assert info.num_gpu_blocks == 64 and info.block_size == 4
    assert info.eos_token_ids == (INSTANT_EOS_TOKEN_ID,)


def test_a_prefill_chunk_samples_only_when_it_reaches_the_end() -> None:
    runner = InstantRunner(CONFIG)
    new = NewRequestData("a", PROMPT, SamplingParams(), (0, 1), 0)
    assert runner.execute(step(0, new=(new,), scheduled={"a": 3})).sampled_token_ids == {}
    assert decode(runner, 1, computed=3, n=2) == {"a": (11 * 31 + 5) % 32000}


def test_decoding_is_deterministic_and_never_emits_eos() -> None:
    runner = InstantRunner(CONFIG)
    tokens = [admit(runner)]
    for i in range(200):
        blocks = (2 + (5 + i) // 4,) if (5 + i) % 4 == 0 else ()
        tokens.append(decode(runner, i + 1, computed=5 + i, blocks=blocks)["a"])
    assert INSTANT_EOS_TOKEN_ID not in tokens
    assert tokens[1] == (tokens[0] * 31 + 6) % 32000


def test_eos_after_makes_the_nth_output_eos() -> None:
    runner = InstantRunner(CONFIG, eos_after=2)
    admit(runner)
    assert decode(runner, 1, computed=5) == {"a": INSTANT_EOS_TOKEN_ID}


def test_a_preempted_request_keeps_its_tokens_and_recomputes_on_resume() -> None:
    reference, runner = InstantRunner(CONFIG), InstantRunner(CONFIG)
    admit(reference), admit(runner)
    expected = decode(reference, 1, computed=5)
    runner.execute(step(1, preempted_req_ids=frozenset({"a"})))
    with pytest.raises(PlanError, match="preempted"):
        decode(runner, 2, computed=5)
    # recompute: a new block table, KV from position 0, all 6 known tokens at once
    assert decode(runner, 3, computed=0, blocks=(9, 10), resumed=True, n=6) == expected


def test_finished_and_aborted_requests_are_dropped() -> None:
    for kind in ("finished_req_ids", "aborted_req_ids"):
        runner = InstantRunner(CONFIG)
        admit(runner)
        runner.execute(step(1, **{kind: frozenset({"a"})}))
        with pytest.raises(PlanError, match="'a', which the worker does not hold"):
            decode(runner, 2, computed=5)


@pytest.mark.parametrize(
    ("computed", "n", "blocks", "message"),
    [
        (5, 2, (), "up to position 7 but the worker has 6 tokens"),  # past the last known token
        (5, 1, (99,), r"block ids \[99\] outside"),
        (8, 1, (), "has 9 tokens and 2 blocks"),  # position 8 needs a third block
    ],
)
def test_impossible_plans_raise(computed: int, n: int, blocks: tuple[int, ...], message: str) -> None:
    runner = InstantRunner(CONFIG)
    admit(runner)
    if computed == 8:  # make 9 tokens known, so only the block table is short
        for i in range(3):
            decode(runner, i + 1, computed=5 + i)
    with pytest.raises(PlanError, match=message):
        decode(runner, 9, computed=computed, blocks=blocks, n=n)


def test_logprobs_are_returned_when_asked() -> None:
    runner = InstantRunner(CONFIG)
    token = admit(runner, SamplingParams(logprobs=3))
    out = runner.execute(step(1, cached=(CachedRequestData("a", (), 5, False),),
                              scheduled={"a": 1}))
    assert out.logprobs["a"].top[0][0] == out.sampled_token_ids["a"] != token
    assert len(out.logprobs["a"].top) == 3
