"""Worker settings, and a way to read a runner's logits, that the tests share."""

from __future__ import annotations

from typing import Any

import torch

from common.arith import cdiv
from scheduler.sampling import SamplingParams
from worker.execution.input_batch import RequestState

# Reference mode: float32 weights, no quantization, no compiler: exactly the numerics the
# parity tests compare with transformers (the fast defaults are checked by their own gates).
REFERENCE: dict[str, Any] = {"dtype": "float32", "quantization": "none", "enforce_eager": True}
REFERENCE_FLAGS: tuple[str, ...] = ("--dtype", "float32", "--quantization", "none", "--enforce-eager")


def chunk_logits(runner: Any, tokens: list[int], start: int, n: int, forward: Any = None) -> torch.Tensor:
    """Logits at positions [start, start + n) of `tokens`, the KV of [0, start) already in the
    cache from earlier calls on the same blocks (placeholder request "tf")."""
    batch = runner.batch
    state = batch.requests.get("tf")
    if state is None:
        state = RequestState("tf", list(tokens), SamplingParams(), None)
        batch.add(state)
        batch.set_blocks(state, list(range(cdiv(len(tokens), runner.config.block_size))))
    state.num_computed_tokens = start
    step = batch.prepare([(state, n)])
    to_device = batch.to_device
    with torch.inference_mode():
        hidden = (forward or runner.forward)(to_device(step.input_ids), to_device(step.positions),
                                             runner.attention.bind(batch.attention_metadata(step)))
        return runner.model.compute_logits(hidden).float()


def teacher_forced(runner: Any, tokens: list[int], decode_from: int | None) -> list[int]:
    """Top-1 prediction after each prefix of `tokens`: positions below `decode_from` in one
    chunk, the rest one token a step (None: all in one chunk)."""
    last = len(tokens) - 1
    cut = last if decode_from is None else decode_from
    try:
        preds = chunk_logits(runner, tokens, 0, cut).argmax(-1).tolist()
        for pos in range(cut, last):
            preds += chunk_logits(runner, tokens, pos, 1).argmax(-1).tolist()
    finally:
        runner.batch.remove("tf")
    return preds
