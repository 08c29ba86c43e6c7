"""The scheduling policy of the worker's intra-op helper threads (`--helper-cpu-scheduling`).

`normal` (the default) leaves every thread SCHED_OTHER. `idle` puts the OpenMP pool's
helpers (every intra-op thread but the worker's main one) under SCHED_IDLE: a core whose
only runnable task is an idle-policy one counts as free when the kernel places a woken
task, and a woken normal task preempts it at once. With the worker on every core, the
engine woken by an output then runs on a helper's core right away instead of waiting for
the kernel's next tick (4 ms at HZ=250): one stream's gaps between tokens lose their 8 ms
mode (bench/RESULTS.md). Alone it is only for a machine the server has to itself: a
CPU-bound neighbour on a helper's core leaves that helper almost no time, and every
parallel region (its work split statically) waits for it. `auto` is `idle` with a watchdog
(a C++ thread, `csrc/pool_threads.cpp`) that samples the helpers every 5 ms and puts them
back under SCHED_OTHER once one is starved (runnable with almost no CPU time, or waiting
for a CPU for more than half the period) two periods running, for a hold of 1 s that
doubles (up to 64 s) while starvation recurs soon after each return to SCHED_IDLE.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from worker.config import HELPER_CPU_SCHEDULING


def intra_op_helpers() -> list[int]:
    """Kernel thread ids of the intra-op pool's helpers (the calling thread's pool, itself
    excluded); [] when the C++ kernels are not built here."""
    from worker.kernels.build import available

    if not available()[0]:
        return []
    own = threading.get_native_id()
    return [int(t) for t in torch.ops.stepserve_cpu.intra_op_thread_ids() if int(t) != own]


# The watchdog's settings: its period, the share of a period waited that counts as starved
# (two periods running), and the first hold under SCHED_OTHER.
WATCHDOG_PERIOD_US = 5000
WATCHDOG_STARVED = 0.5
WATCHDOG_HOLD_MS = 1000


def watchdog_stats() -> dict[str, int]:
    """The `auto` watchdog's counts: demotions (back to SCHED_OTHER), restores (back to
    SCHED_IDLE), and whether the helpers are SCHED_OTHER now; zeros without a watchdog."""
    from worker.kernels.build import available

    if not available()[0]:
        return {"demotions": 0, "restores": 0, "normal_now": 0}
    demotions, restores, normal = (int(v) for v in torch.ops.stepserve_cpu.helper_watchdog_stats())
    return {"demotions": demotions, "restores": restores, "normal_now": normal}


def log_watchdog_changes(logger: logging.Logger, interval: float = 1.0) -> threading.Thread:
    """A daemon thread that logs, at most every `interval` s, when the watchdog has moved
    the helpers since it last looked."""
    def run() -> None:
        seen = watchdog_stats()
        while True:
            time.sleep(interval)
            now = watchdog_stats()
            if now["demotions"] != seen["demotions"]:
                logger.info(
                    "worker helper threads starved: SCHED_OTHER "
                    "(%d times so far, back to SCHED_IDLE %d)",
                    now["demotions"],
                    now["restores"],
                )
            seen = now

    thread = threading.Thread(target=run, name="helper-watchdog-log", daemon=True)
    thread.start()
    return thread


def can_leave_idle() -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to SCHED_OTHER: Linux
    allows it only with CAP_SYS_NICE or an RLIMIT_NICE that admits nice 0 (20 or more; the
    default is 0), so an unprivileged watchdog could starve a helper for good. Tried on a
    throwaway thread."""
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="sched-idle-probe")
    thread.start()
    thread.join()
    return bool(result and result[0])


def apply_helper_cpu_scheduling(name: str) -> str:
    """Set `name` on the intra-op helpers; returns what was done, for the log."""
    if name not in HELPER_CPU_SCHEDULING:
        raise ValueError(
            f"worker helper policy must be one of {HELPER_CPU_SCHEDULING}, got {name!r}"
        )
    if name == "normal":
        return "worker helper threads: SCHED_OTHER"
    if not (sys.platform.startswith("linux") and hasattr(os, "SCHED_IDLE")):
        return f"worker helper threads left as they are ({sys.platform} has no SCHED_IDLE)"
    if name == "auto" and not can_leave_idle():
        return (
            "worker helper threads: SCHED_OTHER (auto needs to move them back from "
            "SCHED_IDLE, which this process may not: CAP_SYS_NICE or RLIMIT_NICE >= 20)"
        )
    helpers = intra_op_helpers()
    if not helpers:
        return (
            "worker helper threads left as they are "
            "(one intra-op thread, or no C++ kernels to find them)"
        )
    failed = []
    for tid in helpers:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # refused (a sandbox's seccomp), or a thread that ended
            failed.append(f"{tid}: {exc}")
    if failed:
        return (
            f"worker helper threads: SCHED_IDLE not set on {len(failed)} of {len(helpers)} "
            f"({failed[0]})"
        )
    if name == "auto":
        torch.ops.stepserve_cpu.helper_watchdog_start(
            helpers, WATCHDOG_PERIOD_US, WATCHDOG_STARVED, WATCHDOG_HOLD_MS
        )
        return (
            f"worker helper threads: SCHED_IDLE on {len(helpers)}, back to SCHED_OTHER "
            f"while starved (watchdog every {WATCHDOG_PERIOD_US / 1000:g} ms)"
        )
    return (
        f"worker helper threads: SCHED_IDLE on {len(helpers)} "
        "(only for a machine without busy neighbours)"
    )
