"""Runner factories that the spawned worker imports in tests/worker/test_worker_process.py.

The test puts this folder on sys.path before spawning, so the child finds this module as
"worker_process_runners" (test modules themselves are not importable by name).
"""

from __future__ import annotations

import os
import time

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.config import WorkerConfig
from worker.execution.instant_runner import InstantRunner


class FailingRunner:
    """A constructor that fails the way a bad model path does."""

    def __init__(self, config: WorkerConfig) -> None:
        raise FileNotFoundError(f"model file not found: {config.model}")


class SlowRunner(InstantRunner):
    """An InstantRunner whose steps take a minute: a worker busy in a long step."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(60.0)
        return super().execute(plan)


def exiting_runner(config: WorkerConfig) -> InstantRunner:
    """A worker that dies outright while loading (as on a crash in native code)."""
    os._exit(3)
