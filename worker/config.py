"""`WorkerConfig` (how to start a worker) and `WorkerInfo` (what it reports at start-up).

Both cross the process boundary, so they are plain frozen dataclasses of builtins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# the intra-op helpers' scheduling policies (worker.process.cpu_scheduling, --helper-cpu-scheduling)
HELPER_CPU_SCHEDULING = ("normal", "idle", "auto")

AttentionBackendName = Literal["auto", "torch", "cpu", "flash_attn"]


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker process needs to load a model and size its KV cache."""

    model: str | None = None  # GGUF file or HF directory; None: the default SmolLM2 GGUF
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on CPU what the start-up probe measures faster
    quantization: str = "auto"  # auto | none | gguf | int8 | int4 (see worker.model.weight_form)
    # gguf: auto | int8 | float32 activations in the low-bit products (auto: int8 where the CPU
    # has AVX512-VNNI; see worker.model.linear.GGUFLinear)
    gguf_activations: str = "auto"
    enforce_eager: bool = False  # True: no torch.compile
    # True: every attention goes through the C++ kernel (no SDPA for long chunks), so with the
    # GGUF kernel a request's logits are bitwise the same alone, batched, chunked or recomputed
    batch_invariant: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
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
    num_threads: int | None = None
    helper_cpu_scheduling: str = "normal"  # the intra-op helpers' scheduling policy: normal | idle | auto (worker.process.cpu_scheduling)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.attention_backend not in ("auto", "torch", "cpu", "flash_attn"):
            raise ValueError(
                f"attention_backend must be auto, torch, cpu or flash_attn, got {self.attention_backend!r}"
            )
        if self.gguf_activations not in ("auto", "int8", "float32"):
            raise ValueError(
                f"gguf_activations must be auto, int8 or float32, got {self.gguf_activations!r}"
            )
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.quantization not in ("auto", "none", "gguf", "int8", "int4"):
            raise ValueError(
                f"quantization must be auto, none, gguf, int8 or int4, got {self.quantization!r}"
            )
        if self.quantization in ("int8", "int4") and self.dtype in ("float32", "float16"):
            raise ValueError(
                f"quantization={self.quantization} runs with bfloat16 activations (torch's low-bit CPU kernels); "
                f"dtype={self.dtype} needs quantization=none or gguf"
            )
        if self.quantization == "gguf" and self.dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"quantization=gguf runs with float32 activations; dtype={self.dtype} needs quantization none, int8 or int4"
            )
        if self.batch_invariant and (
            self.quantization in ("none", "int8", "int4")
            or self.attention_backend in ("torch", "flash_attn")
        ):
            raise ValueError(
                "batch_invariant needs the GGUF kernel and the C++ CPU attention (quantization auto or gguf, attention "
                f"auto or cpu); got quantization={self.quantization}, attention_backend={self.attention_backend}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.helper_cpu_scheduling not in HELPER_CPU_SCHEDULING:
            raise ValueError(
                f"helper_cpu_scheduling must be one of {HELPER_CPU_SCHEDULING}, got {self.helper_cpu_scheduling!r}"
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
