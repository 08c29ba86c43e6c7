"""The KV cache's element type (`--kv-cache-dtype`): what auto picks where, what is refused,
and that the flag reaches the worker and sizes its cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.cli.serve import worker_config
from service.cli.serve_args import build_parser
from worker.config import WorkerConfig
from worker.execution.model_runner import resolve_kv_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("dtype", "device", "quantization", "backend", "want"), [
    (torch.float32, CPU, "gguf", "cpu", torch.float16),  # the fast CPU default
    (torch.float32, CPU, "none", "cpu", torch.float32),  # the reference mode stays float32
    (torch.float32, CPU, "gguf", "torch", torch.float32),  # the portable backend: the model's dtype
    (torch.bfloat16, CPU, "int8", "cpu", torch.bfloat16),
    (torch.bfloat16, CUDA, "none", "flash_attn", torch.bfloat16),
])
def test_auto(dtype: torch.dtype, device: torch.device, quantization: str, backend: str, want: torch.dtype) -> None:
    assert resolve_kv_dtype("auto", dtype, device, quantization, backend) == want


def test_explicit_choices() -> None:
    assert resolve_kv_dtype("float32", torch.float32, CPU, "gguf", "cpu") == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, CPU, "none", "torch") == torch.bfloat16
    assert resolve_kv_dtype("int8", torch.float32, CPU, "gguf", "cpu") == torch.int8
    assert resolve_kv_dtype("int8", torch.bfloat16, CPU, "none", "torch") == torch.int8
    for name in ("float16", "int8"):
        with pytest.raises(ValueError, match="model's dtype"):
            resolve_kv_dtype(name, torch.bfloat16, CUDA, "none", "flash_attn")


def test_flag_reaches_the_worker_config_and_bad_values_are_refused() -> None:
    assert worker_config(build_parser().parse_args([])).kv_cache_dtype == "auto"
    assert worker_config(build_parser().parse_args(["--kv-cache-dtype", "float32"])).kv_cache_dtype == "float32"
    assert worker_config(build_parser().parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        WorkerConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize(("kv", "name", "row_bytes"), [
    ("auto", "float16", 64 * 2), ("float32", "float32", 64 * 4), ("int8", "int8", 64 + 4),
])
def test_runner_sizes_its_cache_by_the_element_type(kv: str, name: str, row_bytes: int) -> None:
    """The default GGUF model on the C++ attention: float16 by default (twice the blocks in the
    same memory), float32 when asked, int8 rows (64 values and a 4-byte scale) when asked; the
    runner reports it."""
    from worker.execution.model_runner import ModelRunner
    from worker.kernels.build import available

    if not available()[0]:
        pytest.skip(f"cpu kernels unavailable: {available()[1]}")
    runner: Any = ModelRunner(WorkerConfig(device="cpu", kv_cache_memory=32 << 20, max_model_len=256, num_threads=2,
                                           enforce_eager=True, kv_cache_dtype=kv))
    info = runner.info
    assert info.kv_cache_dtype == name
    assert info.kv_bytes_per_token == 2 * 30 * 3 * row_bytes
    assert runner.kv_cache.device_cache.dtype == getattr(torch, name)
    assert info.num_gpu_blocks == (32 << 20) // (info.kv_bytes_per_token * 16)


@pytest.mark.parametrize(("memory", "says"), [
    (1, "holds no KV block"),
    (1 << 62, "more than this machine's"),  # a plain number is GiB: 188743680 was 2e17 bytes
])
def test_a_kv_cache_size_this_machine_cannot_hold_is_refused_by_name(
    tmp_path: Any, memory: int, says: str
) -> None:
    from tiny_models import make_tiny_hf_model
    from worker_modes import REFERENCE

    from worker.config import WorkerConfigError
    from worker.execution.model_runner import ModelRunner

    make_tiny_hf_model().save_pretrained(tmp_path / "llama")
    with pytest.raises(WorkerConfigError, match=says) as refused:
        ModelRunner(WorkerConfig(model=str(tmp_path / "llama"), kv_cache_memory=memory, **REFERENCE))
    assert refused.value.field == "kv_cache_memory"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_an_int8_cache_keeps_the_default_model_on_its_predictions(backend: str, smol_runner: Any,
                                                                  smol_tokenizer: Any) -> None:
    """The default model with an int8 cache, on the C++ attention and on the portable one:
    teacher-forced top-1 agreement with the reference mode over a text read half as one chunk,
    half a token a step (the whole gate, ~2,800 positions, measured 98.4 %; bench/RESULTS.md),
    and the cache it wrote is int8 rows."""
    from worker_modes import teacher_forced

    from worker.execution.model_runner import ModelRunner
    from worker.kernels.build import available

    if not available()[0]:
        pytest.skip(f"cpu kernels unavailable: {available()[1]}")
    runner: Any = ModelRunner(WorkerConfig(device="cpu", kv_cache_memory=32 << 20, max_model_len=512, num_threads=2,
                                           enforce_eager=True, kv_cache_dtype="int8", attention_backend=backend))
    tokens = smol_tokenizer.encode(
        "Continuous batching re-plans the batch at every step: requests join as soon as there is room in the KV "
        "cache and leave when they finish, so a short request never waits for a long one. The scheduler decides "
        "which requests run, how many prompt tokens each may prefill, and which to preempt when memory runs out."
    )
    ref, got = (teacher_forced(r, tokens, len(tokens) // 2) for r in (smol_runner, runner))
    agree = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    assert agree >= 0.95, agree
    written = runner.kv_cache.device_cache[0, 0, : -(-(len(tokens) - 1) // 16)]
    assert written.dtype == torch.int8 and written.shape[-1] == 64 + 4
    assert written[..., :64].abs().amax() == 127  # each row's largest value is +-127 steps of its scale
