"""The attention backends by name, what each needs of the device and dtype, and the one
`auto` picks here. Asking for an unavailable backend raises a clear error instead of
silently falling back."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from worker.attention.metadata import AttentionBackend

log = logging.getLogger("stepserve.worker")

HALF = (torch.float16, torch.bfloat16)


def _torch(
    device: torch.device, block_size: int, dtype: torch.dtype, batch_invariant: bool
) -> AttentionBackend:
    from worker.attention.torch_backend import TorchAttention

    return TorchAttention()


def _cpu(
    device: torch.device, block_size: int, dtype: torch.dtype, batch_invariant: bool
) -> AttentionBackend:
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"attention_backend=cpu needs the CPU and float32/bfloat16, got {device} {dtype}"
        )
    from worker.attention.cpu_backend import CpuPagedAttention

    return CpuPagedAttention(batch_invariant)


def _flash_attn(
    device: torch.device, block_size: int, dtype: torch.dtype, batch_invariant: bool
) -> AttentionBackend:
    from worker.attention.flash_attn_backend import FlashAttention, flash_attn_available

    if device.type != "cuda" or dtype not in HALF:
        raise ValueError(
            "attention_backend=flash_attn needs a CUDA device and float16/bfloat16, "
            f"got {device} {dtype}"
        )
    if not flash_attn_available():
        raise ValueError(
            "attention_backend=flash_attn, but the flash_attn package cannot be imported "
            "(pip install flash-attn)"
        )
    return FlashAttention(block_size)


BackendFactory = Callable[[torch.device, int, torch.dtype, bool], AttentionBackend]
BACKENDS: dict[str, BackendFactory] = {"torch": _torch, "cpu": _cpu, "flash_attn": _flash_attn}


def make_attention_backend(
    name: str, device: torch.device, block_size: int, dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The backend `name` (or `auto`: flash_attn on CUDA in fp16/bf16 when importable; on CPU
    the C++ `cpu` backend when it builds here, else torch). `batch_invariant`: the C++ kernel
    for every chunk (see `worker.attention.cpu_backend`)."""
    if name == "auto":
        name = _auto_backend(device, dtype in HALF)
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(
            f"unknown attention backend {name!r} (expected auto, {', '.join(BACKENDS)})"
        )
    return factory(device, block_size, dtype, batch_invariant)


def _auto_backend(device: torch.device, half: bool) -> str:
    if device.type == "cuda":
        from worker.attention.flash_attn_backend import flash_attn_available

        return "flash_attn" if half and flash_attn_available() else "torch"
    if device.type == "cpu":
        from worker.kernels.build import available

        ok, why = available()
        if ok:
            return "cpu"
        log.warning(
            "attention: the C++ cpu backend is unavailable (%s); using the torch backend", why
        )
    return "torch"
