"""Runner factories for the spawned worker in service tests ("standin_runners:NAME").

They only choose options of the instant stand-in (`worker.execution.instant_runner.InstantRunner`),
so tests that use them keep working however the stand-in applies plans inside. The
spawned worker finds this module because pytest puts tests/support on `sys.path` and a
spawned child inherits its parent's path.
"""

from __future__ import annotations

import time

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.config import WorkerConfig
from worker.execution.instant_runner import InstantRunner

EOS_AFTER = 5  # the fifth output token of every request is EOS


def eos_after_5(config: WorkerConfig) -> InstantRunner:
    """The stand-in whose every request samples EOS as its fifth output token."""
    return InstantRunner(config, eos_after=EOS_AFTER)


PACED_STEP_S = 0.01


class PacedInstantRunner(InstantRunner):
    """The stand-in at a model's pace: every step takes at least `PACED_STEP_S`, so a long
    stream stays running for as long as a test needs it busy (8,000 tokens: 80 s or more),
    however fast the machine runs the instant steps."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        start = time.monotonic()
        output = super().execute(plan)
        time.sleep(max(0.0, PACED_STEP_S - (time.monotonic() - start)))
        return output
