"""The worker process: build the runner, answer the handshake, execute plans until told to stop.

`worker_main` is the target of a `spawn`ed process (never fork: the parent runs an event
loop and maybe CUDA). Two threads::

    inbox thread:  pipe ──recv──▶ queue     (drains the pipe at once, so the parent's
                                             sends never wait on a running step; exits
                                             the process when the parent is gone)
    main thread:   queue ──▶ runner.execute(plan) ──send──▶ pipe

A runner that cannot start answers `StartupFailed`; when the error refuses a setting (a bad
model path, `--device cuda` without CUDA: `worker.config.refused_field`), it names the field,
is logged without a traceback, and the server exits 2 with it as a usage error.

An exception inside a step is logged here with its traceback and answered as an error
output for that step. The engine treats such an output as fatal (the step may have applied
part of its plan, and the next plan is already here), so it stops and the server exits
non-zero; the worker itself only goes on reading until it is told to shut down or its
parent is gone.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NoReturn, Protocol

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.config import WorkerConfig, WorkerInfo, check_device, refused_field
from worker.process.messages import (
    ExecuteStep,
    ForwardChanged,
    Message,
    PrepareGrammar,
    Ready,
    Shutdown,
    StartupFailed,
    StepResult,
    decode,
    encode,
)

DEFAULT_RUNNER_FACTORY = "worker.execution.model_runner:ModelRunner"
INSTANT_RUNNER_FACTORY = "worker.execution.instant_runner:InstantRunner"
_PARENT_CHECK_INTERVAL = 0.5  # seconds between checks that the parent is still alive
_FORWARD_POLL_S = 0.5  # seconds between looks for a finished background build while idle

logger = logging.getLogger("stepserve.worker")


class Runner(Protocol):
    """What the worker process needs from a runner (`ModelRunner`, `InstantRunner`)."""

    info: WorkerInfo

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


RunnerFactory = Callable[[WorkerConfig], Runner]


def load_runner_factory(spec: str) -> RunnerFactory:
    """Resolve "package.module:callable" (the callable may be dotted, e.g. "mod:Cls.build")."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"runner factory must look like 'module:callable', got {spec!r}")
    target: object = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"runner factory {spec!r} is not callable")
    return target  # type: ignore[return-value]


def worker_main(
    conn: Connection, config: WorkerConfig, runner_factory: str = DEFAULT_RUNNER_FACTORY
) -> None:
    """Entry point of the worker process; returns when told to shut down."""
    _setup_process(config)
    grammars = _GrammarRelay()
    # started first: it watches the parent during a long load
    inbox = _start_inbox(conn, grammars)
    runner = _build_runner(conn, config, runner_factory)
    if runner is not None:
        grammars.prepare = getattr(runner, "prepare_grammar", None)
        # after start-up: the warm-up has started the pool
        if config.helper_cpu_scheduling != "normal":
            from worker.process.cpu_scheduling import (
                apply_helper_cpu_scheduling,
                log_watchdog_changes,
            )

            logger.info("%s", apply_helper_cpu_scheduling(config.helper_cpu_scheduling))
            if config.helper_cpu_scheduling == "auto":
                log_watchdog_changes(logger)
        _serve(conn, runner, inbox)
    logger.info("worker exiting")


def _setup_process(config: WorkerConfig) -> None:
    # Ctrl-C reaches the whole process group; the parent owns the shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper()),
        format="%(asctime)s worker[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    _normal_scheduling()
    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)


def _normal_scheduling() -> None:
    """SCHED_OTHER for this process and the threads it starts: the engine may run under
    SCHED_BATCH (service.cli.cpu_scheduling), and a child inherits its parent's policy; the
    compute threads must keep preempting on wake-up."""
    if hasattr(os, "sched_getscheduler") and os.sched_getscheduler(0) != os.SCHED_OTHER:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:
            logger.warning("could not set the worker back to SCHED_OTHER: %s", exc)


class _GrammarRelay:
    """Hands `PrepareGrammar` texts to the runner from the inbox thread, so a compile starts
    while a step runs; a runner without structured outputs has no `prepare`."""

    def __init__(self) -> None:
        self.prepare: Callable[[str], None] | None = None

    def __call__(self, text: str) -> None:
        if self.prepare is not None:
            self.prepare(text)


def _start_inbox(conn: Connection, grammars: _GrammarRelay) -> queue.SimpleQueue[Message]:
    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()
    thread = threading.Thread(
        target=_read_inbox, args=(conn, inbox, parent_pid, grammars), name="worker-inbox",
        daemon=True,
    )
    thread.start()
    return inbox


def _read_inbox(
    conn: Connection,
    inbox: queue.SimpleQueue[Message],
    parent_pid: int | None,
    grammars: _GrammarRelay,
) -> None:
    """Move messages from the pipe to `inbox`; leave the process when the parent is gone."""
    while True:
        try:
            if not conn.poll(_PARENT_CHECK_INTERVAL):
                if os.getppid() != parent_pid:
                    _parent_gone("the parent process changed")
                continue
            message = decode(conn.recv_bytes())
        except (EOFError, OSError):
            _parent_gone("the pipe to the parent closed")
        except Exception as exc:  # an undecodable message: the protocol is broken, stop
            _parent_gone(f"unreadable message from the parent ({type(exc).__name__}: {exc})")
        if isinstance(message, PrepareGrammar):
            grammars(message.text)
            continue
        inbox.put(message)
        if isinstance(message, Shutdown):
            return


def _parent_gone(why: str) -> NoReturn:
    # Nobody is left to read our outputs; a step in progress is not worth finishing.
    logger.warning("%s; worker exiting", why)
    logging.shutdown()
    os._exit(1)


def _build_runner(conn: Connection, config: WorkerConfig, spec: str) -> Runner | None:
    """Build the runner and answer the handshake; None when start-up failed."""
    try:
        check_device(config.device)
        runner = load_runner_factory(spec)(config)
        info = runner.info
    except Exception as exc:
        field = refused_field(exc)
        if field is None:
            logger.exception("worker start-up failed (runner factory %s)", spec)
            message = f"{type(exc).__name__}: {exc}"
        else:
            logger.error("worker start-up refused %s: %s", field, exc)
            message = str(exc)
        _send(conn, StartupFailed(message, traceback.format_exc(), field))
        return None
    logger.info("worker ready: %s on %s, %d KV blocks", info.model_name, info.device,
                info.num_gpu_blocks)
    return runner if _send(conn, Ready(info=info)) else None


def _serve(conn: Connection, runner: Runner, inbox: queue.SimpleQueue[Message]) -> None:
    pending: Callable[[], bool] = getattr(runner, "forward_pending", lambda: False)
    while True:
        try:  # while a compiled forward is being built, look for it between messages
            message: Message | None = inbox.get(timeout=_FORWARD_POLL_S if pending() else None)
        except queue.Empty:
            message = None
        if pending():
            note = runner.poll_forward()  # type: ignore[attr-defined]
            if note is not None and not _send(conn, ForwardChanged(note)):
                return
        if message is None:
            continue
        if isinstance(message, Shutdown):
            return
        if not isinstance(message, ExecuteStep):
            logger.warning("ignoring unexpected message %s", type(message).__name__)
            continue
        if not _send(conn, StepResult(output=execute_step(runner, message.plan))):
            return


def execute_step(runner: Runner, plan: SchedulerOutput) -> ModelRunnerOutput:
    """Run one plan, timed; an exception becomes an error output for that step."""
    start = time.perf_counter()
    try:
        output = runner.execute(plan)
        return dataclasses.replace(output, execute_time=time.perf_counter() - start)
    except Exception as exc:
        logger.exception("step %d failed", plan.step_id)
        return ModelRunnerOutput(step_id=plan.step_id, sampled_token_ids={},
                                 error=f"{type(exc).__name__}: {exc}")


def _send(conn: Connection, message: Message) -> bool:
    """Send one message; False when the parent has gone."""
    try:
        conn.send_bytes(encode(message))
    except OSError:
        logger.warning("could not send %s: the parent is gone", type(message).__name__)
        return False
    return True
