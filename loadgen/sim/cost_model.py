"""The simulator's step-time cost model: model shapes, hardware profiles and a roofline.

A step is described by a few aggregates over the requests it computes (`BatchShape`);
its duration is::

    max(FLOPs / peak_flops, bytes / memory_bandwidth) + overheads + swap_bytes / host_bandwidth

    overheads = step_overhead + seq_overhead * requests + kv_token_overhead * KV tokens read
                + multi_token_overhead (only when the step computes more than one token)

FLOPs count the dense matmuls per computed token, the LM head per sampled token and
attention per (query, key) pair, so a request's context length matters. Bytes count the
weights (read once per step, shared by the whole batch) plus the KV cache read for each
request's context and written for each new token. Swap copies are serial with the forward
(the worker does them first) and go over the host link.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

# The step's shape and the overhead terms are the scheduler's (its online step-cost fit reads
# the same ones); re-exported here, where the simulator's callers have always found them.
from scheduler.step_cost import BatchShape as BatchShape
from scheduler.step_cost import overhead_terms as overhead_terms
from scheduler.step_cost import swap_time

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only (Llama-family) transformer that decide its cost."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (attention projections + gated MLP)."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v + 3 * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters, norms included (8.03e9 for Llama-3.1-8B)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + norms + self.embedding_params + lm_head

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Weights a forward streams from memory (the input embedding is only gathered)."""
        return (self.num_layers * self.layer_params + self.embedding_params) * self.dtype_bytes

    @property
    def dense_flops_per_token(self) -> int:
        """Matmul FLOPs every computed token pays in the decoder layers."""
        return 2 * self.num_layers * self.layer_params

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the vocabulary projection, paid only by positions that sample."""
        return 2 * self.embedding_params

    @property
    def attention_flops_per_pair(self) -> int:
        """QK^T and PV for one (query, key) pair across all layers and heads."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def with_dtype(self, dtype: str) -> ModelShape:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        return replace(self, dtype_bytes=DTYPE_BYTES[dtype])

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelShape:
        """Read a Hugging Face `config.json` (a file or the directory holding it)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        cfg = json.loads(p.read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return cls(
            name=name or str(cfg.get("_name_or_path") or p.parent.name),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        )


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
    )
}


@dataclass(frozen=True)
class HardwareProfile:
    """Peak rates of one accelerator (or of the CPU cores a worker uses)."""

    name: str
    peak_flops: float  # FLOP/s in the model's dtype
    memory_bandwidth: float  # bytes/s
    host_bandwidth: float  # bytes/s over the host link, one direction (swap copies)
    step_overhead: float  # seconds per step that no FLOP or byte explains
    # Seconds per request in a step that no FLOP or byte explains: per-sequence work such as
    # small-matrix inefficiency, attention launches and sampling. ~0 on a GPU; on a CPU
    # worker it is what makes a decode token cost far more than its FLOPs (bench/RESULTS.md).
    seq_overhead: float = 0.0
    # Seconds per KV token a request's attention reads, beyond the roofs. ~0 where attention
    # is a fused paged kernel; on CPU the torch path gathers each request's blocks and runs
    # SDPA on them, which costs ~10 us per context token (all layers) for SmolLM2 in fp32,
    # so a decode at context 1024 costs far more than one at 64.
    kv_token_overhead: float = 0.0
    # Seconds added to a step that computes more than one token. CPU BLAS runs a one-token
    # step as matrix-vector products that stream the weights once, and anything larger as
    # matrix-matrix products that pack the weights first: on this CPU a 2-request decode
    # costs ~45 ms more than a 1-request one, and 8 requests barely more than 2. ~0 on a GPU.
    multi_token_overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "host_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.step_overhead < 0:
            raise ValueError(f"step_overhead must be >= 0 s, got {self.step_overhead}")
        for name in ("seq_overhead", "kv_token_overhead", "multi_token_overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 s, got {getattr(self, name)}")

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.peak_flops / self.memory_bandwidth

    @property
    def overheads(self) -> tuple[float, ...]:
        """The overhead parameters, in the order of `overhead_terms`."""
        return tuple(getattr(self, name) for name in OVERHEADS)

    def to_dict(self) -> dict[str, float | str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, float | str]) -> HardwareProfile:
        """A profile from `to_dict`'s keys; the overheads after the first default to 0
        (profiles written before they existed)."""
        required = {
            name: float(data[name])
            for name in ("peak_flops", "memory_bandwidth", "host_bandwidth", "step_overhead")
        }
        optional = {name: float(data.get(name, 0.0)) for name in OVERHEADS[1:]}
        return cls(name=str(data.get("name", "custom")), **required, **optional)


# HardwareProfile's overhead fields, each multiplying one of `overhead_terms`.
OVERHEADS = ("step_overhead", "seq_overhead", "kv_token_overhead", "multi_token_overhead")


HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        # Dense bf16 tensor-core peaks; host links are effective PCIe rates, not the spec sheet's.
        HardwareProfile("a100-80g", 312e12, 2.039e12, 16e9, 2e-3),
        HardwareProfile("h100", 989e12, 3.35e12, 32e9, 2e-3),
        HardwareProfile("h200", 989e12, 4.8e12, 32e9, 2e-3),
        # Two AVX2 cores in fp32 running SmolLM2 (torch 2.13, 2 threads): the fit of a
        # bench/worker_step.py grid (docs/simulator.md); swap is a memcpy within the same RAM.
        HardwareProfile(
            "cpu",
            120e9,
            14e9,
            30e9,
            22e-3,
            seq_overhead=1.5e-3,
            kv_token_overhead=6e-6,
            multi_token_overhead=50e-3,
        ),
    )
}
HARDWARE_ALIASES: dict[str, str] = {"a100": "a100-80g", "h100-80g": "h100", "h200-141g": "h200"}


def get_model_shape(name_or_path: str) -> ModelShape:
    """A preset name, or a path to a Hugging Face config.json (or its directory)."""
    if name_or_path in MODEL_SHAPES:
        return MODEL_SHAPES[name_or_path]
    if Path(name_or_path).exists():
        return ModelShape.from_hf_config(name_or_path)
    raise ValueError(f"unknown model shape {name_or_path!r}: use one of {sorted(MODEL_SHAPES)} "
                     "or a path to a config.json")


def get_hardware(name_or_path: str) -> HardwareProfile:
    """A preset name (or alias), or a path to a JSON profile written by `calibrate`."""
    name = HARDWARE_ALIASES.get(name_or_path, name_or_path)
    if name in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[name]
    if Path(name_or_path).is_file():
        data = json.loads(Path(name_or_path).read_text())
        return HardwareProfile.from_dict(data.get("profile", data))
    raise ValueError(f"unknown hardware {name_or_path!r}: use one of {sorted(HARDWARE_PROFILES)} "
                     "or a path to a calibrated profile JSON")


@dataclass(frozen=True)
class StepCost:
    """What one step costs, and which roof bounds it."""

    flops: float
    bytes: float
    swap_bytes: float
    compute_time: float
    memory_time: float
    swap_time: float
    overhead: float

    @property
    def time(self) -> float:
        return max(self.compute_time, self.memory_time) + self.overhead + self.swap_time

    @property
    def compute_bound(self) -> bool:
        return self.compute_time >= self.memory_time


@dataclass(frozen=True)
class CostModel:
    """Step durations for one model shape on one hardware profile."""

    shape: ModelShape
    hardware: HardwareProfile
    block_size: int = 16

    def flops(self, batch: BatchShape) -> float:
        s = self.shape
        return float(
            batch.num_tokens * s.dense_flops_per_token
            + batch.num_sampled * s.lm_head_flops
            + batch.attention_pairs * s.attention_flops_per_pair
        )

    def bytes(self, batch: BatchShape) -> float:
        kv = (batch.kv_tokens_read + batch.num_tokens) * self.shape.kv_bytes_per_token
        weights = self.shape.weight_bytes if batch.num_tokens else 0
        return float(weights + kv)

    def step(self, batch: BatchShape) -> StepCost:
        hw = self.hardware
        flops, nbytes = self.flops(batch), self.bytes(batch)
        swap = float(batch.swap_blocks * self.block_size * self.shape.kv_bytes_per_token)
        return StepCost(
            flops=flops,
            bytes=nbytes,
            swap_bytes=swap,
            compute_time=flops / hw.peak_flops,
            memory_time=nbytes / hw.memory_bandwidth,
            swap_time=swap / hw.host_bandwidth,
            overhead=sum(p * n for p, n in zip(hw.overheads, overhead_terms(batch), strict=True)),
        )

    def step_time(self, batch: BatchShape) -> float:
        return self.step(batch).time

    def prefill_time(self, num_tokens: int, context: int = 0) -> float:
        """One request computing `num_tokens` at once (a prefill or a recompute)."""
        batch = BatchShape()
        batch.add(num_tokens, context)
        return self.step_time(batch)

    def swap_time(self, num_tokens: int) -> float:
        """Copy a request's KV out to the host and back in (both directions)."""
        return swap_time(num_tokens, self.shape.kv_bytes_per_token, self.hardware.host_bandwidth)
