"""`ModelRunner` on the default SmolLM2 GGUF, driven by hand-built plans: greedy output equal
to transformers', batch invariance (alone, batched, chunked, preempted, swapped, overlap),
and no stale state after finish / preempt / abort."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scheduler.output import SchedulerOutput
from scheduler.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at a temperature of",
    "My favourite book is",
]
CHAT = [{"role": "user", "content": "Name three fruits."}]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(smol_tokenizer: Any) -> list[list[int]]:
    from common.tokenizer import apply_chat_template

    return [smol_tokenizer.encode(p) for p in PROMPTS] + [apply_chat_template(smol_tokenizer, CHAT)]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids: list[list[int]], smol_runner_session: Any) -> list[list[int]]:
    """transformers' greedy continuations from the same GGUF, one prompt at a time (after
    the runner fixture, so under its thread setting)."""
    from transformers import AutoModelForCausalLM

    from common.model_files import find_default_model

    path = find_default_model()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def batched_greedy(smol_runner_session: Any, prompt_ids: list[list[int]], plan_driver: Any) -> dict[str, list[int]]:
    """All prompts in one batch: one prefill step, then decode steps."""
    driver = plan_driver(smol_runner_session)
    for i, ids in enumerate(prompt_ids):
        driver.add(f"p{i}", ids)
    return driver.run(NEW_TOKENS)


def test_greedy_matches_transformers(batched_greedy: dict[str, list[int]], hf_greedy: list[list[int]]) -> None:
    for i, expected in enumerate(hf_greedy):
        assert batched_greedy[f"p{i}"] == expected, f"prompt {i}: {PROMPTS[i] if i < len(PROMPTS) else CHAT}"


def greedy(runner: Any, driver_cls: Any, prompts: dict[str, list[int]], tokens: int = 16,
           chunk: int | None = None, overlap: bool = False, **first_step: Any) -> dict[str, list[int]]:
    driver = driver_cls(runner, chunk=chunk, overlap=overlap)
    for req_id, ids in prompts.items():
        driver.add(req_id, ids)
    return driver.run(tokens, **first_step)


def test_alone_equals_batched(smol_runner: Any, plan_driver: Any, prompt_ids: list[list[int]],
                              batched_greedy: dict[str, list[int]]) -> None:
    for i in (0, 8):
        alone = greedy(smol_runner, plan_driver, {"x": prompt_ids[i]}, tokens=NEW_TOKENS)
        assert alone["x"] == batched_greedy[f"p{i}"]


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_equals_unchunked(smol_runner: Any, plan_driver: Any, prompt_ids: list[list[int]],
                                          batched_greedy: dict[str, list[int]], chunk: int) -> None:
    prompts = {f"p{i}": prompt_ids[i] for i in (2, 6, 8)}
    got = greedy(smol_runner, plan_driver, prompts, chunk=chunk)
    for req_id, tokens in got.items():
        assert tokens == batched_greedy[req_id][:16]


def test_overlap_extra_token_is_harmless(smol_runner: Any, plan_driver: Any, prompt_ids: list[list[int]],
                                         batched_greedy: dict[str, list[int]]) -> None:
    got = greedy(smol_runner, plan_driver, {"p1": prompt_ids[1], "p3": prompt_ids[3]}, overlap=True)
    assert got == {"p1": batched_greedy["p1"][:16], "p3": batched_greedy["p3"][:16]}


def drive_with_interruption(runner: Any, driver_cls: Any, prompts: dict[str, list[int]], victim: str,
                            kind: str, at_step: int) -> dict[str, list[int]]:
    """Greedy 16 tokens; at `at_step`, `victim` is preempted (recompute) or swapped out."""
    driver = driver_cls(runner)
    for req_id, ids in prompts.items():
        driver.add(req_id, ids)
    for _ in range(at_step):
        driver.step()
    driver.step(**{"preempt" if kind == "recompute" else "swap": (victim,)})
    state = runner.requests[victim]
    assert state.row < 0 and state.block_ids == [] and state.output_token_ids  # kept, out of the batch
    return driver.run(16)


@pytest.mark.parametrize("kind", ["recompute", "swap"])
def test_preempt_and_resume_keep_greedy_output(smol_runner: Any, plan_driver: Any, prompt_ids: list[list[int]],
                                               batched_greedy: dict[str, list[int]], kind: str) -> None:
    prompts = {f"p{i}": prompt_ids[i] for i in (0, 4, 8)}
    got = drive_with_interruption(smol_runner, plan_driver, prompts, "p4", kind, at_step=5)
    for req_id, tokens in got.items():
        assert tokens == batched_greedy[req_id][:16], req_id


def test_swap_moves_exact_kv_bytes(smol_runner: Any) -> None:
    """Block 3 gets a distinctive pattern and the target slots something else, so the test
    passes only if the bytes moved (not because every block was still zero)."""
    cache = smol_runner.kv_cache
    saved = [t.clone() for t in (cache.device_cache[:, :, 3], cache.host_cache[:, :, 7], cache.device_cache[:, :, 11])]
    try:
        pattern = torch.randn(cache.device_cache[:, :, 3].shape, generator=torch.Generator().manual_seed(0))
        cache.device_cache[:, :, 3] = pattern.to(cache.device_cache.dtype)
        cache.host_cache[:, :, 7] = -1.0
        cache.device_cache[:, :, 11] = -2.0
        before = cache.device_cache[:, :, 3].clone()
        assert before.abs().sum() > 0 and not torch.equal(cache.host_cache[:, :, 7], before)
        cache.swap_out(((3, 7),))
        assert torch.equal(cache.host_cache[:, :, 7], before)
        cache.swap_in(((7, 11),))
        assert torch.equal(cache.device_cache[:, :, 11], before)
    finally:  # the runner is shared by the module's tests
        cache.device_cache[:, :, 3], cache.host_cache[:, :, 7], cache.device_cache[:, :, 11] = saved


def test_finish_preempt_abort_leave_no_stale_state(smol_runner: Any, plan_driver: Any, prompt_ids: list[list[int]]) -> None:
    driver = plan_driver(smol_runner)
    for i in range(4):
        driver.add(f"s{i}", prompt_ids[i])
    driver.step()
    driver.step()
    assert set(smol_runner.requests) == {"s0", "s1", "s2", "s3"} and smol_runner.batch.num_active == 4
    driver.step(preempt=("s1",), abort=("s2",))
    assert "s2" not in smol_runner.requests
    assert smol_runner.requests["s1"].row < 0 and smol_runner.batch.num_active == 2
    for r in driver.reqs.values():
        if r.req_id in ("s0", "s3"):
            driver._release(r, "done")
            driver.to_finish.add(r.req_id)
    driver.step()  # finishes s0 and s3, resumes s1
    assert set(smol_runner.requests) == {"s1"} and smol_runner.batch.num_active == 1
    driver.close()
    assert smol_runner.requests == {} and sorted(smol_runner.batch.free_rows) == list(range(len(smol_runner.batch.token_ids)))


def test_plan_with_wrong_computed_count_is_rejected(smol_runner: Any, prompt_ids: list[list[int]]) -> None:
    from scheduler.output import CachedRequestData, NewRequestData

    params = SamplingParams(temperature=0.0)
    ids = prompt_ids[0]
    first = SchedulerOutput(0, (NewRequestData("w", tuple(ids), params, (0,), 0),), (), {"w": len(ids)},
                            len(ids), frozenset(), frozenset(), frozenset())
    smol_runner.execute(first)
    bad = SchedulerOutput(1, (), (CachedRequestData("w", (), len(ids) - 1, False),), {"w": 1}, 1,
                          frozenset(), frozenset(), frozenset())
    with pytest.raises(RuntimeError, match="plan says .* computed tokens, the worker has"):
        smol_runner.execute(bad)
    unknown = SchedulerOutput(2, (), (), {"ghost": 1}, 1, frozenset(), frozenset({"w"}), frozenset())
    with pytest.raises(RuntimeError, match="'ghost', which the worker does not hold"):
        smol_runner.execute(unknown)
    assert smol_runner.requests == {}


def test_seeded_sampling_is_reproducible_across_batches(smol_runner: Any, plan_driver: Any, prompt_ids: list[list[int]]) -> None:
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16)
    runs = []
    for others in ((), (1, 2)):
        driver = plan_driver(smol_runner)
        driver.add("seeded", prompt_ids[5], seeded)
        for i in others:
            driver.add(f"o{i}", prompt_ids[i], SamplingParams(temperature=1.0, max_tokens=16))
        runs.append(driver.run(8)["seeded"])
    assert runs[0] == runs[1]


def test_worker_info(smol_runner: Any) -> None:
    info = smol_runner.info
    assert info.model_name == "SmolLM2-135M-Instruct" and info.vocab_size == 49152
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 and info.num_params == 134515008
    assert info.num_gpu_blocks == (96 << 20) // (info.kv_bytes_per_token * 16) and info.num_cpu_blocks > 0


@pytest.mark.parametrize(("path", "name"), [
    ("m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("m/llama-3.1-8b-instruct.gguf", "llama-3.1-8b-instruct"),
    ("m/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct"),
    ("models/Qwen2-0.5B", "Qwen2-0.5B"),
])
def test_served_model_name(path: str, name: str) -> None:
    from pathlib import Path

    from worker.execution.model_runner import served_model_name

    assert served_model_name(Path(path)) == name
