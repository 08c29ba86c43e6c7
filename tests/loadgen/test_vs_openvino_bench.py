"""`bench.vs_openvino`'s accuracy side: the agreement arithmetic, the gate's inputs, and
stepserve's teacher-forced predictions read off its prompt logprobs (OpenVINO itself is the
benchmark's to run, not the test's: it lives in an environment of its own)."""

from __future__ import annotations

from typing import Any

import pytest
from worker_modes import REFERENCE_FLAGS

from bench import vs_openvino
from common.model_files import find_default_model


def test_agreement_counts_positions_and_the_greedy_prefix_before_the_first_difference() -> None:
    reference = {"accuracy": {"teacher_forced": [[5, 6, 7], [8, 9]],
                              "greedy": [[1] * 32, [2] * 32]}}
    measured: dict[str, Any] = {"accuracy": {"teacher_forced": [[5, 0, 7], [8, 9]],
                                             "greedy": [[1] * 32, [2] * 3 + [0] * 29]}}
    got = vs_openvino.agreement(measured, reference)
    assert got == {"teacher_forced_top1": 0.8, "positions": 5, "greedy_identical": "1/2",
                   "greedy_tokens_before_first_difference": [32, 3]}
    assert "accuracy" not in measured  # the predictions give way to their summary


def test_the_reference_is_the_parity_tests_reference_mode() -> None:
    assert tuple(vs_openvino.REFERENCE_FLAGS) == REFERENCE_FLAGS


def test_the_gates_texts_are_cut_to_enough_positions() -> None:
    inputs = vs_openvino.accuracy_inputs(str(find_default_model()))
    assert len(inputs["texts"]) == 7 and len(inputs["prompts"]) == 9
    assert all(len(t) == vs_openvino.ACCURACY_TOKENS for t in inputs["texts"][1:-1])
    assert sum(len(t) - 1 for t in inputs["texts"]) >= 2000


@pytest.mark.slow
def test_stepserve_teacher_forced_is_the_greedy_token_after_each_prefix() -> None:
    """The prediction read off the prompt logprobs at position i is the token greedy
    decoding gives after the prefix [0, i): no position is shifted by one."""
    text = vs_openvino.accuracy_inputs(str(find_default_model()))["texts"][0][:40]
    engine = vs_openvino._Stepserve(str(find_default_model()), list(REFERENCE_FLAGS))
    try:
        predicted = engine.teacher_forced([text])[0]
        cuts = [1, 7, 20, 39]
        greedy = engine.greedy([text[:i] for i in cuts], 1)
    finally:
        engine.close()
    assert len(predicted) == len(text) - 1
    assert [predicted[i - 1] for i in cuts] == [g[0] for g in greedy]
