"""A small run of the real scheduler whose requests have objectives, recorded step by step:
the step-record tests check its `slack` and `lost` entries, the dashboard's tests replay it.

One request runs at a time (`max_num_seqs=1`); plan i is made at t = i and its output
applied at t = i + 0.5, so each request's deadlines are known in advance::

    R1  ttft 2 s, tpot 0.8 s   first token at 0.5; its 2nd token, due 1.3, comes at 1.5: TPOT lost
    R2  ttft 2 s               waits for R1: no first token by 2.0: TTFT lost while it waits
    R3  no objectives          nothing to judge, nothing recorded about deadlines
    R4  ttft 60 s, tpot 5 s    meets both: its slack is listed, no deadline lost
"""

from __future__ import annotations

from typing import Any

from sched_driver import MirrorWorker, make_request

from scheduler import Scheduler, SchedulerConfig
from scheduler.slo import SLO
from scheduler.step_records import Record, StepRecorder, scheduler_hello

OBJECTIVES = {"R1": SLO(2.0, 0.8), "R2": SLO(ttft_s=2.0), "R3": None, "R4": SLO(60.0, 5.0)}
LENGTHS = {"R1": (8, 4), "R2": (8, 3), "R3": (8, 2), "R4": (8, 3)}


def slo_run() -> tuple[Scheduler, Record, list[Record]]:
    """The scheduler after the run, the run's hello, and every step's record (full)."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_gpu_blocks=40, block_size=4,
                          max_model_len=64, max_num_seqs=1)
    sched = Scheduler(cfg)
    for rid, (prompt, outputs) in LENGTHS.items():
        req = make_request(rid, prompt, outputs)
        slo = OBJECTIVES[rid]
        if slo is not None:
            req.slo = slo
        sched.add_request(req)
    worker, recorder = MirrorWorker(4, 40), StepRecorder(sched)
    records: list[dict[str, Any]] = []
    i = 0
    while sched.needs_plan():
        plan = sched.schedule(now=float(i))
        recorder.on_plan(plan, float(i))
        outs = sched.update_from_output(plan, worker.execute(plan), now=i + 0.5)
        rec = recorder.on_output(plan, outs, i + 0.5, 0.5)
        assert rec is not None
        records.append(rec)
        i += 1
    return sched, scheduler_hello(sched, strategy="continuous", source="simulator"), records
