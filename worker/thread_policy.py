"""The scheduling policy of the worker's intra-op helper threads (`--worker-helper-policy`).

`normal` (the default) leaves every thread SCHED_OTHER. `idle` puts the OpenMP pool's
helpers (every intra-op thread but the worker's main one) under SCHED_IDLE: a core whose
only runnable task is an idle-policy one counts as free when the kernel places a woken
task, and a woken normal task preempts it at once. With the worker on every core, the
engine woken by an output then runs on a helper's core right away instead of waiting for
the kernel's next tick (4 ms at HZ=250): one stream's gaps between tokens lose their 8 ms
mode (bench/RESULTS.md). Only for a machine the server has to itself: a CPU-bound
neighbour on a helper's core leaves that helper almost no time, and every parallel region
(its work split statically) waits for it.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

from worker.config import HELPER_POLICIES


def intra_op_helpers() -> list[int]:
    """Kernel thread ids of the intra-op pool's helpers (the calling thread's pool, itself
    excluded); [] when the C++ kernels are not built here."""
    from worker.cpu_kernels import available

    if not available()[0]:
        return []
    own = threading.get_native_id()
    return [int(t) for t in torch.ops.stepserve_cpu.intra_op_thread_ids() if int(t) != own]


def apply_helper_policy(name: str) -> str:
    """Set `name` on the intra-op helpers; returns what was done, for the log."""
    if name not in HELPER_POLICIES:
        raise ValueError(f"worker helper policy must be one of {HELPER_POLICIES}, got {name!r}")
    if name == "normal":
        return "worker helper threads: SCHED_OTHER"
    if not (sys.platform.startswith("linux") and hasattr(os, "SCHED_IDLE")):
        return f"worker helper threads left as they are ({sys.platform} has no SCHED_IDLE)"
    helpers = intra_op_helpers()
    if not helpers:
        return "worker helper threads left as they are (one intra-op thread, or no C++ kernels to find them)"
    failed = []
    for tid in helpers:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # refused (a sandbox's seccomp), or a thread that ended
            failed.append(f"{tid}: {exc}")
    if failed:
        return f"worker helper threads: SCHED_IDLE not set on {len(failed)} of {len(helpers)} ({failed[0]})"
    return f"worker helper threads: SCHED_IDLE on {len(helpers)} (only for a machine without busy neighbours)"
