"""The compiled forward: torch.compile (inductor) of the model on the CPU, warmed up at start-up.

    eager forward ──torch.compile (freezing, C++ wrapper)──▶ one graph per token-count range:
        T = 1 (decode of one request), 2..cut-over, and above (int4 layers switch to their
        dense copies there), each compiled before the worker reports ready

Inductor fuses the small ops between the matmuls (norms, rope, SwiGLU, residuals), freezing
prepacks the weights once, and the C++ wrapper calls the kernels without Python in between;
attention stays one opaque op per layer (`StepAttention.compiled`). Compiled kernels are
cached on disk (`TORCHINDUCTOR_CACHE_DIR`, by default under ~/.cache/stepserve), so a restart
compiles much faster. The compiled forward is kept only if a short timing at start-up
measures it faster than the eager one at one token; otherwise, or where no C++ compiler is
found, or when compilation fails, the worker runs eagerly and logs why.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("stepserve.worker")

Forward = Callable[[torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor]
# Runs one dummy forward of T tokens (the runner binds attention to scratch KV blocks).
WarmUp = Callable[[Forward, int], None]


@dataclass(frozen=True)
class CompileResult:
    forward: Forward
    compiled: bool
    note: str  # what was decided, and why (logged, and reported by the worker)


def compiler_missing() -> str | None:
    """Why inductor cannot build C++ here (None: a compiler is found)."""
    if shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"):
        return None
    return "no C++ compiler found (inductor needs one: apt-get install g++)"


def _configure_inductor() -> None:
    import torch._inductor.config as inductor

    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "stepserve" / "inductor")
    )
    inductor.freezing = True  # weights become constants: prepacked once, not per call
    inductor.cpp_wrapper = True  # the graph's calls run from C++, not a Python wrapper


def compile_forward(
    eager: Forward,
    attend_compiled: Callable[..., torch.Tensor],
    warm_up: WarmUp,
    widths: list[int],
) -> CompileResult:
    """Compile `eager` and warm it at each of `widths` tokens (1 first); keep it if it is
    faster than `eager` at one token. `attend_compiled` is the attention the graph calls."""
    missing = compiler_missing()
    if missing is not None:
        return CompileResult(eager, False, f"eager: {missing}")
    _configure_inductor()
    # Guards evaluated in full while this forward compiles: with an earlier runner's stance
    # (below) still set, dynamo would take that runner's graph, weights frozen in, for this one.
    torch.compiler.set_stance("default")
    compiled_fn = torch.compile(eager, dynamic=None)

    def compiled(
        input_ids: torch.Tensor, positions: torch.Tensor, attention: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        return compiled_fn(input_ids, positions, attend_compiled)

    start = time.perf_counter()
    try:
        for width in widths:
            warm_up(compiled, width)
    except Exception as exc:  # an inductor or compiler failure: run eagerly, say why
        log.exception("torch.compile failed; running eagerly")
        return CompileResult(
            eager, False, f"eager: compilation failed ({type(exc).__name__}: {str(exc)[:200]})"
        )
    seconds = time.perf_counter() - start
    # Every graph this worker needs exists now, and nothing a guard checks changes between
    # steps except the token count (the weights are frozen, the attention op is fixed), so
    # dynamo need only evaluate the guards that tell its graphs apart: 0.4 ms a step saved.
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    eager_ms, compiled_ms = (one_token_ms(fn, warm_up) for fn in (eager, compiled))
    timing = (
        f"1-token forward {compiled_ms:.2f} ms compiled vs {eager_ms:.2f} ms eager; "
        f"compiled in {seconds:.0f} s"
    )
    if compiled_ms >= eager_ms:
        torch.compiler.set_stance("default")
        return CompileResult(
            eager, False, f"eager: the compiled forward is not faster here ({timing})"
        )
    return CompileResult(compiled, True, f"compiled ({timing})")


def one_token_ms(forward: Forward, warm_up: WarmUp, repeat: int = 7) -> float:
    warm_up(forward, 1)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        warm_up(forward, 1)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3
