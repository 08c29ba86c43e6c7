"""stepserve's C++ CPU kernels (`csrc/`): built on the machine once (by `make install`, else at
first use), loaded once per process.

    csrc/paged_attention.cpp  attention reading the paged KV cache in place
                              (worker.attention.cpu_backend)
    csrc/lowbit_linear.cpp    GGUF Q4 / Q8 blocks as stored times float32 activations
                              (worker.model.linear.GGUFLinear)
    csrc/int8_linear.cpp      GGUF Q4 / Q8 blocks re-laid in tiles times activations quantized
                              to two int8 levels, integer dot products (AVX512-VNNI, or
                              AVX2's byte multiply-adds where the CPU lacks VNNI)
    csrc/pool_threads.cpp     the OpenMP helper threads' ids and the starvation watchdog
                              (worker.process.cpu_scheduling)

torch has neither for the CPU. They are compiled once per machine with the compiler torch's
extensions use, into torch's extension cache (`TORCH_EXTENSIONS_DIR`), with the vector
instructions this CPU lists, never `-march=native`: some virtual machines list AMX flags
but fault on AMX instructions. Where no compiler is found or the build fails, `available()`
says why and the worker runs torch's own kernels instead.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import torch

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("paged_attention.cpp", "lowbit_linear.cpp", "int8_linear.cpp", "pool_threads.cpp")
]
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
            # csrc/int8_linear.cpp's vpdpbusd path (AVX2's byte multiply-adds without it) and
            # csrc/paged_attention.cpp's bfloat16 chunk products
            wanted = (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16"))
            extra = [flag for cpu, flag in wanted if name == "AVX512" and cpu in listed]
            return [f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}", *flags, *extra]
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
        load(name="stepserve_cpu_kernels", sources=[str(p) for p in SOURCES], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # a compiler error, a missing header: fall back, say why
        return f"building the CPU kernels failed: {type(exc).__name__}: {str(exc)[-500:]}"
    _register_fake()
    return "ok"


def _register_fake() -> None:
    @torch.library.register_fake("stepserve_cpu::paged_attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("stepserve_cpu::lowbit_linear")
    def _(
        x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], d.shape[0])

    @torch.library.register_fake("stepserve_cpu::int8_linear")
    def _(
        x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, n: int
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)




if __name__ == "__main__":  # `python -m worker.kernels.build`: build ahead (make install does)
    import sys

    ok, why = available()
    print("stepserve CPU kernels: " + ("built" if ok else f"not built ({why})"))
    sys.exit(0)
