"""`WorkerConfig` (how to start a worker) and `WorkerInfo` (what it reports at start-up), and
`WorkerConfigError`, the error of a setting the worker refuses.

Both dataclasses cross the process boundary, so they are plain frozen dataclasses of builtins.
This module imports no torch: the server process validates its flags with it before the port
is bound. The checks that need torch (`check_device`) run in the worker.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.model_files import ModelLoadError

# the intra-op helpers' scheduling policies (worker.process.cpu_scheduling,
# --helper-cpu-scheduling)
HELPER_CPU_SCHEDULING = ("normal", "idle", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# int8: per (token, kv head) symmetric int8 rows with a float32 scale (worker.attention.kv_rows)
KV_CACHE_DTYPES = (*DTYPES, "int8")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
GGUF_ACTIVATIONS = ("auto", "int8", "float32")
GGUF_WIDE_STEPS = ("auto", "blocks")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash_attn")
LOG_LEVELS = ("debug", "info", "warning", "error")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

AttentionBackendName = Literal["auto", "torch", "cpu", "flash_attn"]


class WorkerConfigError(ValueError):
    """A setting the worker refuses; `field` names the `WorkerConfig` field (the flag of the
    same name, with dashes, on `stepserve serve`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# The worker's forward note while it runs eagerly and builds the compiled forward beside it
BUILDING_NOTE = "eager while the compiled forward is built"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker process needs to load a model and size its KV cache."""

    model: str | None = None  # GGUF file or HF directory; None: the default SmolLM2 GGUF
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on CPU what the start-up probe measures faster
    quantization: str = "auto"  # auto | none | gguf | int8 | int4 (see worker.model.weight_form)
    # gguf: auto | int8 | float32 activations in the low-bit products (auto: int8 where the CPU
    # has AVX512-VNNI or AVX2; see worker.model.linear.GGUFLinear)
    gguf_activations: str = "auto"
    # gguf: steps of many tokens on a bf16 copy of the weights where the start-up probe
    # measures it faster (auto), above N tokens ("N"), or on the blocks at every width
    # (blocks: less memory, the blocks' float32 accuracy; see worker.model.kernel_probe)
    gguf_wide_steps: str = "auto"
    enforce_eager: bool = False  # True: no compiled forward
    # True: build the compiled forward before reporting ready; False: where no build is
    # cached, run the eager forward at once and swap the compiled one in when it is built
    compile_wait: bool = False
    # True: every chunk attends through the C++ per-token kernel (never the chunk kernel, which
    # sums a long chunk in another order), so with the GGUF kernel a request's logits are
    # bitwise the same alone, batched, chunked or recomputed
    batch_invariant: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu; or cpu, cuda, cuda:N
    block_size: int = 16
    # auto: float16 where the C++ CPU attention reads a GGUF model's cache (half the bytes a
    # decode reads; see worker.execution.model_runner.resolve_kv_dtype), else the model's dtype
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    max_num_batched_tokens: int = 2048  # size of the profiling forward on CUDA
    kv_cache_memory: int = 1 << 30  # bytes of KV cache on CPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory on CUDA
    swap_space: float = 0.0  # GiB of host memory for swapped-out blocks
    attention_backend: AttentionBackendName = "auto"
    seed: int = 0
    num_threads: int | None = None  # None: all cores (docs/cpu.md, Threads)
    # the intra-op helpers' scheduling policy: normal | idle | auto (worker.process.cpu_scheduling)
    helper_cpu_scheduling: str = "normal"
    log_level: str = "info"  # the worker process's logging level: debug | info | warning | error

    def __post_init__(self) -> None:
        self._check_values()
        self._check_combinations()

    def _check_values(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        _one_of("gguf_activations", self.gguf_activations, GGUF_ACTIVATIONS)
        if not self.gguf_wide_steps.isdigit():
            _one_of("gguf_wide_steps", self.gguf_wide_steps, GGUF_WIDE_STEPS)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("helper_cpu_scheduling", self.helper_cpu_scheduling, HELPER_CPU_SCHEDULING)
        _one_of("log_level", self.log_level, LOG_LEVELS)
        if not _DEVICE.match(self.device):
            raise WorkerConfigError(
                "device", f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        _at_least("block_size", self.block_size, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("kv_cache_memory", self.kv_cache_memory, 1, "bytes")
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 1)
        if self.num_threads is not None:
            _at_least("num_threads", self.num_threads, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise WorkerConfigError(
                "gpu_memory_utilization",
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            )
        if self.swap_space < 0:
            raise WorkerConfigError(
                "swap_space", f"swap_space must be >= 0 GiB, got {self.swap_space}"
            )

    def _check_combinations(self) -> None:
        q, dtype = self.quantization, self.dtype
        if q in ("int8", "int4") and dtype in ("float32", "float16"):
            raise WorkerConfigError(
                "quantization",
                f"quantization={q} runs with bfloat16 activations (torch's low-bit CPU "
                f"kernels); dtype={dtype} needs quantization none or gguf",
            )
        if q == "gguf" and dtype in ("bfloat16", "float16"):
            raise WorkerConfigError(
                "quantization",
                f"quantization=gguf runs with float32 activations; dtype={dtype} needs "
                "quantization none, int8 or int4",
            )
        cuda = self.device.startswith("cuda")
        if cuda and q not in ("auto", "none"):
            raise WorkerConfigError(
                "quantization", f"quantization={q} runs on the CPU only, not device={self.device}"
            )
        if (cuda and self.attention_backend == "cpu") or (
            self.device == "cpu" and self.attention_backend == "flash_attn"
        ):
            raise WorkerConfigError(
                "attention_backend",
                f"attention_backend={self.attention_backend} cannot run on device={self.device}",
            )
        if self.batch_invariant and (
            q in ("none", "int8", "int4")
            or self.attention_backend in ("torch", "flash_attn")
            or dtype in ("bfloat16", "float16")
            or cuda
        ):
            raise WorkerConfigError(
                "batch_invariant",
                "batch_invariant needs the GGUF kernel and the C++ attention on the CPU in "
                f"float32; got quantization={q}, attention_backend={self.attention_backend}, "
                f"dtype={dtype}, device={self.device}",
            )
        if self.batch_invariant and self.gguf_wide_steps.isdigit():
            raise WorkerConfigError(
                "gguf_wide_steps",
                "batch_invariant runs every step on the GGUF blocks (a row's product on the "
                "bf16 copy depends on the step's width); got "
                f"gguf_wide_steps={self.gguf_wide_steps}",
            )

    def check_model_path(self, path: Path) -> None:
        """The checks that need the model's path (resolved, existing): a GGUF file or an HF
        directory with config.json; the GGUF kernel runs only a GGUF file's blocks."""
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise WorkerConfigError("model", f"{path}: an HF model directory needs config.json")
        elif path.suffix != ".gguf":
            raise WorkerConfigError(
                "model", f"{path}: expected a .gguf file or an HF model directory"
            )
        else:
            return
        if self.quantization == "gguf":
            raise WorkerConfigError(
                "quantization", f"quantization=gguf needs a GGUF model file, got {path}"
            )
        if self.batch_invariant:
            raise WorkerConfigError(
                "batch_invariant", f"batch_invariant needs a GGUF model file, got {path}"
            )


def check_device(device: str) -> None:
    """Refuse a `device` this process cannot use (it imports torch: the worker calls it)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else "no CUDA device found"
        raise WorkerConfigError(
            "device",
            f"device={device}, but CUDA is not available (torch {torch.__version__}: {build})",
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise WorkerConfigError(
            "device",
            f"device={device}, but this machine has {torch.cuda.device_count()} CUDA device(s)",
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerConfig) if f.name != "model")


def refused_field(exc: BaseException) -> str | None:
    """The `WorkerConfig` field a start-up error is about, when it refuses a setting (a model
    that cannot be loaded, a value this machine cannot run); None for any other failure.
    A plain ValueError counts when its message names a field (`quantization=gguf needs ...`)."""
    if isinstance(exc, WorkerConfigError):
        return exc.field
    if isinstance(exc, ModelLoadError):
        return "model"
    if type(exc) is not ValueError:
        return None
    text = str(exc)
    found = [
        (m.start(), name)
        for name in _FIELDS
        if (m := re.search(rf"\b{name}\b|\b{name.replace('_', '-')}\b", text))
    ]
    return min(found)[1] if found else None


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise WorkerConfigError(name, f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _at_least(name: str, value: int, low: int, unit: str = "") -> None:
    if value < low:
        raise WorkerConfigError(
            name, f"{name} must be >= {low}{' ' + unit if unit else ''}, got {value}"
        )


@dataclass(frozen=True)
class WorkerInfo:
    """The start-up handshake: what the engine and scheduler need to know about the worker."""

    model_name: str  # served model name (e.g. "SmolLM2-135M-Instruct")
    model_path: str
    architecture: str
    device: str
    dtype: str
    attention_backend: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    kv_bytes_per_token: int
    num_params: int
    quantization: str = "none"
    kv_cache_dtype: str = ""  # the KV cache's element type ("" from a worker that predates it)
    compiled: bool = False
    batch_invariant: bool = False
    num_threads: int = 1
    weight_bytes: int = 0  # bytes of weights one step reads
    extra: dict[str, str] = field(default_factory=dict)  # the start-up probe's measurements
    # bytes/s of one direction of a swap copy, measured at start-up (0: not measured)
    copy_bandwidth: float = 0.0
    structured_outputs: bool = False  # whether its sampler masks logits by a grammar
