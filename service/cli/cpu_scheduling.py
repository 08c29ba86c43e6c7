"""The engine process's CPU scheduling policy (Linux): `SCHED_BATCH` by default, so that
a worker output waking the engine does not take a core from the worker's compute thread.

With the worker's OpenMP threads on every core (the default, docs/cpu.md: Threads), a
step's output wakes the engine while both cores are busy: the worker's main thread in its
`send()` and its helper spinning at the next barrier. Under the default policy the woken
engine preempts the thread that woke it, so the main thread waits out the engine's whole
turn (output processing, SSE writes, the next plan: ~0.5 ms a token) before it starts the
next step. `SCHED_BATCH` (any process may set it on itself, no privilege) differs from
`SCHED_OTHER` only in that its threads never preempt on wake-up: the engine runs when a
core frees or the kernel's next tick rebalances, and with two plans in flight the worker
already holds the next plan, so nothing waits for it. Measured by
`bench/engine_cpu_scheduling.py` (docs/cpu.md: CPU scheduling). The worker process sets
itself back to `SCHED_OTHER` at start (`worker.process.main`), since a child inherits its
parent's policy.
"""

from __future__ import annotations

import os
import sys

ENGINE_CPU_SCHEDULING = ("batch", "normal")
DEFAULT_ENGINE_CPU_SCHEDULING = "batch"


def _supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "SCHED_BATCH")


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: the calling thread alone


def apply_engine_cpu_scheduling(name: str) -> str:
    """Set `name` ("batch" or "normal") on every thread of this process (threads started
    later inherit it from their creator); returns what was done, for the log."""
    if name not in ENGINE_CPU_SCHEDULING:
        raise ValueError(
            f"engine scheduling policy must be one of {ENGINE_CPU_SCHEDULING}, got {name!r}"
        )
    if not _supported():
        return f"engine scheduling policy left as is ({sys.platform} has no SCHED_BATCH)"
    policy = os.SCHED_BATCH if name == "batch" else os.SCHED_OTHER
    failed = []
    for tid in _thread_ids():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:  # refused (a sandbox's seccomp)
            failed.append(f"{tid}: {exc}")
    if failed:
        return f"engine scheduling policy {name}: not set on {len(failed)} thread(s) ({failed[0]})"
    return (
        f"engine scheduling policy {name} ({'SCHED_BATCH' if name == 'batch' else 'SCHED_OTHER'})"
    )
