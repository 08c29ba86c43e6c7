"""The ahead-of-time compiled forward: AOTInductor packages of the model's forward, kept on
disk, loaded in milliseconds, fed the model's own weights.

    model.forward(ids, positions) ──torch.export──▶ one program per token-count range
        (T = 1: one decode; 2..cut-over; above it, where int4 layers use their dense copies)
    ──AOTInductor──▶ a .pt2 package per range (generated C++ and its .so; no weights)
    package + the live model's tensors (load_constants, user-managed: shared, not copied)
        ──▶ a forward that picks the range's package by T (eager outside every range)

The packages hold code only, so they are keyed by what shapes the code, not by the weights:
the model's tensors (names, shapes, dtypes), the ranges, the attention op, torch's version,
the CPU's vector flags and the source of the model and its kernels. Two GGUF files of one
shape share them. They live under `STEPSERVE_AOT_CACHE` (default
~/.cache/stepserve/aot/<key>), written whole into a temporary directory and renamed into
place, so a reader never sees half a build and two builders do not clash.

Building runs nothing (export traces with fake tensors; the C++ ops have fake versions)
but takes a minute: a worker with no cached build serves eagerly while a child process builds
it (`BackgroundBuild`), and swaps the compiled forward in between two steps.

Only the C++ attention op is callable from a package; with the Python attention op the
worker keeps torch.compile (`worker.model.compiled_forward`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.model.compiled_forward import Forward

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
Range = tuple[int, int]  # token counts, both ends included
_FORMAT = 1  # bumped when the cache's layout changes
_SOURCES = ("worker/model", "worker/attention", "worker/kernels/csrc")


def cache_root() -> Path:
    return Path(
        os.environ.get("STEPSERVE_AOT_CACHE", Path.home() / ".cache" / "stepserve" / "aot")
    )


def token_ranges(max_tokens: int, dense_above: int | None) -> list[Range]:
    """The ranges of token counts one package each serves: 1, 2..cut-over, the rest."""
    ranges: list[Range] = [(1, 1)]
    if dense_above is not None and 2 <= dense_above < max_tokens:
        ranges += [(2, dense_above), (dense_above + 1, max_tokens)]
    elif max_tokens >= 2:
        ranges.append((2, max_tokens))
    return ranges


class _Traced(nn.Module):
    """The forward as export sees it: token ids and positions in, hidden states out, the
    attention op fixed (it reads the step the runner bound before the call)."""

    def __init__(self, model: nn.Module, attend: Attend) -> None:
        super().__init__()
        self.model = model
        self._attend = attend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._attend)


def _constants(traced: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(traced.named_parameters()), **dict(traced.named_buffers())}


def source_digest() -> str:
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for folder in _SOURCES:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class AotSpec:
    """What one set of packages is built for; `key` names its cache directory."""

    ranges: tuple[Range, ...]
    attention: str  # the attention op's name
    cpu_flags: tuple[str, ...]  # the compiler flags the kernels were built with
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # name, shape, dtype

    @property
    def key(self) -> str:
        text = json.dumps(
            {"format": _FORMAT, "torch": torch.__version__, "source": source_digest(),
             **self.__dict__},
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:24]


class AotForward:
    """Build, store and load the packages of one model's forward."""

    def __init__(self, model: nn.Module, attend: Attend, ranges: list[Range]) -> None:
        self._traced = _Traced(model, attend)
        from worker.kernels.build import isa_flags

        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        self.spec = AotSpec(
            ranges=tuple(ranges),
            attention=str(getattr(attend, "__name__", attend)),
            cpu_flags=tuple(isa_flags(cpuinfo)),
            tensors=tuple(
                (name, tuple(t.shape), str(t.dtype))
                for name, t in sorted(_constants(self._traced).items())
            ),
        )
        self.directory = cache_root() / self.spec.key

    def built(self) -> bool:
        return all((self.directory / _file(r)).is_file() for r in self.spec.ranges)

    def build(self) -> float:
        """Export and compile every range into the cache (nothing runs the model); seconds."""
        start = time.perf_counter()
        root = self.directory.parent
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp*"):  # left by a build killed outright, an hour ago
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{self.spec.key}.tmp", dir=root))
        try:
            for lo, hi in self.spec.ranges:
                self._compile(lo, hi, tmp / _file((lo, hi)))
            (tmp / "spec.json").write_text(json.dumps(self.spec.__dict__, indent=1))
            try:
                tmp.rename(self.directory)
            except OSError:  # another worker renamed its build there first: keep that one
                if not self.built():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return time.perf_counter() - start

    def _compile(self, lo: int, hi: int, path: Path) -> None:
        example = (torch.zeros(lo, dtype=torch.long), torch.arange(lo, dtype=torch.long))
        dynamic = None
        if hi > lo:
            tokens = torch.export.Dim("tokens", min=lo, max=hi)
            dynamic = ({0: tokens}, {0: tokens})
        with torch.inference_mode():
            program = torch.export.export(
                self._traced, example, dynamic_shapes=dynamic, strict=False
            )
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(
            program,
            package_path=str(path),
            inductor_configs={
                # weights are fed at load time (load_constants), so the package is code only
                "aot_inductor.package_constants_in_so": False,
                "freezing": False,
                "compile_threads": 1,  # no pool of compiler processes beside the step loop
            },
        )

    def load(self) -> Forward:
        """The packaged forward over the live model's tensors (none copied)."""
        constants = _constants(self._traced)
        runs: list[tuple[int, int, Callable[[list[torch.Tensor]], list[torch.Tensor]]]] = []
        for lo, hi in self.spec.ranges:
            # torch._inductor.aoti_load_package wraps this loader; calling it directly spares
            # a worker importing torch._inductor (1.2 s) to load a few MB of code
            package: Any = torch._C._aoti.AOTIModelPackageLoader(  # type: ignore[attr-defined]
                str(self.directory / _file((lo, hi))), "model", False, 1, -1
            )
            names = package.get_constant_fqns()
            missing = [n for n in names if n not in constants]
            if missing:
                raise RuntimeError(f"the package needs tensors the model lacks: {missing[:3]}")
            package.load_constants(  # user-managed: the model's own tensors, not copies
                {n: constants[n] for n in names}, False, True, True
            )
            runs.append((lo, hi, package.boxed_run))
        eager = self._traced.model

        def forward(
            input_ids: torch.Tensor, positions: torch.Tensor, attention: Attend
        ) -> torch.Tensor:
            tokens = input_ids.shape[0]
            for lo, hi, run in runs:
                if lo <= tokens <= hi:
                    return run([input_ids, positions])[0]
            return eager(input_ids, positions, attention)

        return forward


def _file(token_range: Range) -> str:
    lo, hi = token_range
    return f"tokens-{lo}-{hi}.pt2"


class BackgroundBuild:
    """`AotForward.build` in a child process, watched from a daemon thread, while this
    process serves the eager forward; the step loop calls `done()` between steps and then
    loads the packages (`AotForward.load`, milliseconds).

    A child process, not a thread: tracing (torch.fx, under export) patches
    `nn.Module.__call__` for the whole process while it runs, and would capture the step
    loop's own forward. The child builds the same module from the same settings (the weights
    do not matter to a package, only their shapes) and must arrive at the same key, else
    nothing is swapped in and the log says why.
    """

    def __init__(self, aot: AotForward, settings: dict[str, Any]) -> None:
        self._aot = aot
        self._done = threading.Event()
        self.error: str | None = None
        self.seconds = 0.0
        job = {"settings": settings, "ranges": list(aot.spec.ranges), "key": aot.spec.key,
               "parent": os.getpid()}
        self._cmd = [sys.executable, "-m", "worker.model.aot_forward", json.dumps(job)]
        self._thread = threading.Thread(target=self._run, name="aot-build", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            child = subprocess.run(
                self._cmd, capture_output=True, text=True, check=False,
                cwd=Path(__file__).resolve().parents[2],
            )
            if child.returncode != 0:
                self.error = f"the build process exited with {child.returncode}: " + (
                    child.stderr.strip().splitlines() or ["(no output)"]
                )[-1][:300]
            elif not self._aot.built():
                self.error = "the build process wrote no package under this worker's key"
        except OSError as exc:
            self.error = f"the build process did not start: {exc}"
        self.seconds = time.perf_counter() - start
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()


def _child_setup(parent: int) -> None:
    """In the build process, first: its niceness (`STEPSERVE_BUILD_NICE`, default 0), and
    (Linux) SIGTERM when the worker that started it exits, so no build outlives it. Done
    here rather than between fork and exec: the worker has threads, and a forked child of a
    threaded process may call only async-signal-safe functions before exec.

    Measured under a constant stream on 2 cores: at nice 0 the build took 112 s while a token
    took 42 ms, at nice 5 367 s at 16 ms, at nice 10 946 s at 15 ms (6 ms once swapped in).
    Sooner is worth more: a stream got twice the tokens over the slower build's window at 0."""
    os.nice(int(os.environ.get("STEPSERVE_BUILD_NICE", "0")))
    # SIGTERM (the worker gone) unwinds, so the unfinished build's directory is removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the worker exited before the line above took effect
        sys.exit(128 + signal.SIGTERM)


def _build_in_child(job: dict[str, Any]) -> int:
    """The child's side of `BackgroundBuild`: the worker's model from its settings (eager,
    one thread, a small KV cache), then its packages, under the parent's key."""
    from worker.config import WorkerConfig
    from worker.execution.model_runner import ModelRunner

    settings = {**job["settings"], "enforce_eager": True, "num_threads": 1,
                "kv_cache_memory": 16 << 20, "swap_space": 0.0}
    runner = ModelRunner(WorkerConfig(**settings))
    ranges = [(int(lo), int(hi)) for lo, hi in job["ranges"]]
    aot = AotForward(runner.model, runner.attention.compiled, ranges)
    if aot.spec.key != job["key"]:
        print(f"the rebuilt model's key {aot.spec.key} is not the worker's {job['key']} "
              "(its kernel choice differed)", file=sys.stderr)
        return 3
    aot.build()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _job = json.loads(sys.argv[1])
    _child_setup(int(_job["parent"]))
    sys.exit(_build_in_child(_job))
