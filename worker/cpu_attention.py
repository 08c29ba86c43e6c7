"""The CPU attention backend: `csrc/paged_attention.cpp`, built on the machine at first use.

torch has no paged attention for the CPU, and the portable torch backend gathers every
request's blocks into a padded copy per layer (a skewed batch pays its longest context for
every request) and loops over prefill chunks in Python. The C++ op reads the cache in
place, one work item per (query token, kv head), and hands long chunks to torch's SDPA
(see the source's header). It is compiled once per machine with the compiler torch's
extensions use, into torch's extension cache (`TORCH_EXTENSIONS_DIR`), with the vector
instructions this CPU lists, never `-march=native`: some virtual machines list AMX flags
but fault on AMX instructions. Where no compiler is found or the build fails, `available()`
says why and the worker uses the torch backend.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import torch

from worker.attention import AttentionMetadata, KVCacheLayer

log = logging.getLogger("stepserve.worker")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
# A request with at most this many query tokens attends through the C++ kernel (each token
# its own work item); longer chunks through SDPA, whose blocked kernel wins there.
SMALL_QUERY = 16
# ATen's vector types (at::vec) per capability: the CPU flags each needs, and the compiler flags
_CAPABILITIES = (
    ("AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c")),
    ("AVX2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
)

_lock = threading.Lock()
_status: str | None = None  # None: not tried; "ok"; else why it is unavailable


def isa_flags(cpuinfo: str) -> list[str]:
    """Compiler flags for the widest at::vec capability whose extensions /proc/cpuinfo lists;
    none (portable scalar vectors) elsewhere."""
    listed: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            listed = set(line.split(":", 1)[1].split())
            break
    for name, needs, flags in _CAPABILITIES:
        if listed.issuperset(needs):
            return [f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}", *flags]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def available() -> tuple[bool, str]:
    """Build (once per process; once per machine on disk) and load the op; (ok, why not)."""
    global _status
    with _lock:
        if _status is None:
            _status = _build()
        return _status == "ok", _status


def _build() -> str:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler found (install g++)"
    try:
        from torch.utils.cpp_extension import load

        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        # -fopenmp: at::parallel_for is OpenMP inside ATen's headers; the libgomp.so.1 it
        # links is the one torch has already loaded, so both share one thread pool
        flags = ["-O3", "-fopenmp", "-fno-math-errno", *isa_flags(cpuinfo)]
        load(name="stepserve_cpu_attention", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as exc:  # a compiler error, a missing header: fall back, say why
        return f"building {SOURCE.name} failed: {type(exc).__name__}: {str(exc)[-500:]}"
    _register_fake()
    return "ok"


def _register_fake() -> None:
    @torch.library.register_fake("stepserve_cpu::paged_attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.ops.stepserve_cpu.paged_attention(q, k, v, layer)


class CpuPagedAttention:
    """Attention through the C++ op; the caches and each step's metadata live in its registry."""

    name = "cpu"
    op = staticmethod(paged_attention_op)

    def __init__(self) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"the cpu attention backend is unavailable: {why}")

    def set_cache(self, kv_layers: list[KVCacheLayer]) -> None:
        torch.ops.stepserve_cpu.set_kv_cache([k for k, _ in kv_layers], [v for _, v in kv_layers])

    def bind(self, meta: AttentionMetadata) -> None:
        torch.ops.stepserve_cpu.bind_step(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                          meta.block_tables, SMALL_QUERY)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.ops.stepserve_cpu.paged_attention(q, k, v, layer)
