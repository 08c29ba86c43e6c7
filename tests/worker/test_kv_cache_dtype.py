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
    with pytest.raises(ValueError, match="model's dtype"):
        resolve_kv_dtype("float16", torch.bfloat16, CUDA, "none", "flash_attn")


def test_flag_reaches_the_worker_config_and_bad_values_are_refused() -> None:
    assert worker_config(build_parser().parse_args([])).kv_cache_dtype == "auto"
    assert worker_config(build_parser().parse_args(["--kv-cache-dtype", "float32"])).kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        WorkerConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize(("kv", "elem"), [("auto", 2), ("float32", 4)])
def test_runner_sizes_its_cache_by_the_element_type(kv: str, elem: int) -> None:
    """The default GGUF model on the C++ attention: float16 by default (twice the blocks in the
    same memory), float32 when asked; the runner reports it."""
    from worker.execution.model_runner import ModelRunner
    from worker.kernels.build import available

    if not available()[0]:
        pytest.skip(f"cpu kernels unavailable: {available()[1]}")
    runner: Any = ModelRunner(WorkerConfig(device="cpu", kv_cache_memory=32 << 20, max_model_len=256, num_threads=2,
                                           enforce_eager=True, kv_cache_dtype=kv))
    info = runner.info
    assert info.kv_cache_dtype == ("float16" if elem == 2 else "float32")
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * elem
    assert runner.kv_cache.device_cache.dtype == (torch.float16 if elem == 2 else torch.float32)
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
