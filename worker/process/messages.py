"""The messages between the engine process and the worker process, and their serializer.

One small frozen dataclass per message kind; `encode` / `decode` are the only
serializer (pickle, over a multiprocessing pipe). Conversation::

    parent                              worker
      │                                   │ builds the runner
      │ ◀──────── Ready(info) ─────────── │   (or StartupFailed(message), then exits)
      │ ───────── ExecuteStep(plan) ────▶ │
      │ ───────── ExecuteStep(plan) ────▶ │   up to two plans in flight
      │ ◀──────── StepResult(output) ──── │   outputs in plan order
      │ ───────── PrepareGrammar(text) ─▶ │   compiled at once, beside any step; no answer
      │ ◀──────── ForwardChanged(note) ── │   between steps, unasked: a compiled forward
      │                                   │   built in the background now runs (or failed)
      │ ───────── Shutdown() ───────────▶ │   exits cleanly
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.config import WorkerInfo


@dataclass(frozen=True)
class Ready:
    """Worker -> parent: the runner is built; what it serves."""

    info: WorkerInfo


@dataclass(frozen=True)
class StartupFailed:
    """Worker -> parent: building the runner raised; the worker exits after sending this."""

    message: str  # "ExceptionType: message"; a refused setting's: the message alone
    traceback: str
    field: str | None = None  # the WorkerConfig field a refused setting is about; None: a failure


@dataclass(frozen=True)
class ExecuteStep:
    """Parent -> worker: run one step plan."""

    plan: SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    """Worker -> parent: the answer to one plan (its `error` is set if the step raised)."""

    output: ModelRunnerOutput


@dataclass(frozen=True)
class PrepareGrammar:
    """Parent -> worker: a request will need this grammar (structured outputs); compile it
    in the background now."""

    text: str


@dataclass(frozen=True)
class ForwardChanged:
    """Worker -> parent, between two step results: the forward the steps run changed (the
    compiled one, built in the background, swapped in; or its build failed)."""

    note: str  # what runs now, as the worker's start-up log says it


@dataclass(frozen=True)
class Shutdown:
    """Parent -> worker: finish the current step, then exit."""


Message = (
    Ready | StartupFailed | ExecuteStep | StepResult | PrepareGrammar | ForwardChanged | Shutdown
)
_MESSAGE_TYPES = (
    Ready, StartupFailed, ExecuteStep, StepResult, PrepareGrammar, ForwardChanged, Shutdown
)


def encode(message: Message) -> bytes:
    """Serialize one message for `Connection.send_bytes`."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    """Deserialize one message from `Connection.recv_bytes`; reject anything else."""
    message = pickle.loads(data)
    if not isinstance(message, _MESSAGE_TYPES):
        raise TypeError(f"unexpected message type {type(message).__name__}")
    return message
