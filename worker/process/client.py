"""`WorkerClient`: the engine's asyncio handle on the worker process.

It spawns the worker (`worker.process.worker_main`), waits for the handshake, sends plans
without blocking (two may be in flight) and awaits outputs in plan order. The pipe and
the process sentinel are watched with `loop.add_reader`, so a worker that dies (even by
SIGKILL) is noticed at once: pending and later `get_output` calls raise `WorkerDiedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.config import WorkerConfig, WorkerInfo
from worker.process.main import DEFAULT_RUNNER_FACTORY, worker_main
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

logger = logging.getLogger("stepserve.worker.client")

_KILL_GRACE = 2.0  # seconds to wait after SIGTERM, then after SIGKILL
_EXIT_CODE_WAIT = 0.5  # seconds a death report waits for the exit code


class WorkerStartupError(RuntimeError):
    """The worker could not start; the message is the worker's own (e.g. a bad model path).
    `field` names the `WorkerConfig` field when the worker refused that setting, else None."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class WorkerDiedError(RuntimeError):
    """The worker process exited while the engine still needed it."""


class _Died:
    """Queued once when the worker can no longer answer; stays queued for later readers."""


_DIED = _Died()


class WorkerClient:
    """Start, drive and stop one worker process from an asyncio event loop."""

    def __init__(
        self, config: WorkerConfig, runner_factory: str = DEFAULT_RUNNER_FACTORY
    ) -> None:
        self.config = config
        self.runner_factory = runner_factory
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: asyncio.Queue[Message | _Died] = asyncio.Queue()
        self._exited = asyncio.Event()
        self._info: WorkerInfo | None = None
        self._dead = False
        self._closed = False
        self._in_flight = 0
        self.forward: str | None = None  # the worker's latest ForwardChanged note, if any
        # called with that note as it arrives (the engine sets it)
        self.on_forward_changed: Callable[[str], None] | None = None

    @property
    def info(self) -> WorkerInfo:
        if self._info is None:
            raise RuntimeError("worker not started: await start() first")
        return self._info

    @property
    def is_alive(self) -> bool:
        return self._process is not None and not self._dead and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once it has exited (negative: killed by that signal)."""
        return None if self._process is None else self._process.exitcode

    @property
    def num_in_flight(self) -> int:
        """Plans submitted whose outputs have not been read yet."""
        return self._in_flight

    async def start(self, timeout: float = 600.0) -> WorkerInfo:
        """Spawn the worker and wait for its handshake; raise WorkerStartupError on failure."""
        if self._process is not None:
            raise RuntimeError("worker already started")
        self._spawn()
        try:
            message = await asyncio.wait_for(self._next_message(), timeout)
        except TimeoutError:
            await self.shutdown()
            raise WorkerStartupError(f"worker did not start within {timeout:g} s") from None
        except WorkerDiedError as exc:
            await self.shutdown()
            raise WorkerStartupError(f"worker exited during start-up: {exc}") from None
        except BaseException:
            await self.shutdown()
            raise
        if isinstance(message, StartupFailed):
            await self.shutdown()
            raise WorkerStartupError(message.message, message.field)
        if not isinstance(message, Ready):
            await self.shutdown()
            raise WorkerStartupError(f"unexpected handshake {type(message).__name__}")
        self._info = message.info
        return message.info

    def submit(self, plan: SchedulerOutput) -> None:
        """Send a plan to the worker without waiting for earlier outputs."""
        if self._conn is None or self._closed:
            raise RuntimeError("worker not running")
        if self._dead:
            raise WorkerDiedError(self._death_message())
        try:
            self._conn.send_bytes(encode(ExecuteStep(plan=plan)))
        except OSError:
            self._mark_dead()
            raise WorkerDiedError(self._death_message()) from None
        self._in_flight += 1

    def prepare_grammar(self, text: str) -> None:
        """Ask the worker to start compiling a grammar now (it sends no answer)."""
        if self._conn is None or self._closed or self._dead:
            return  # the next submit reports the death
        try:
            self._conn.send_bytes(encode(PrepareGrammar(text=text)))
        except OSError:
            self._mark_dead()

    async def get_output(self) -> ModelRunnerOutput:
        """The output of the oldest submitted plan; WorkerDiedError if the worker died."""
        if self._in_flight == 0:
            raise RuntimeError("get_output() with no plan in flight")
        message = await self._next_message()
        if not isinstance(message, StepResult):
            raise RuntimeError(f"unexpected message from worker: {type(message).__name__}")
        self._in_flight -= 1
        return message.output

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; terminate, then kill it if it does not. Idempotent."""
        process, conn = self._process, self._conn
        if process is None or conn is None or self._closed:
            return
        self._closed = True
        if not self._dead:
            with contextlib.suppress(OSError):
                conn.send_bytes(encode(Shutdown()))
        if not await self._wait_exit(timeout):
            logger.warning("worker %s did not exit in %g s; terminating", process.pid, timeout)
            process.terminate()
            if not await self._wait_exit(_KILL_GRACE):
                process.kill()
                await self._wait_exit(_KILL_GRACE)
        self._mark_dead()
        self._remove_readers()
        conn.close()

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_main,
            args=(child_conn, self.config, self.runner_factory),
            name="stepserve-worker",
            daemon=True,  # multiprocessing kills it if this interpreter exits normally
        )
        process.start()
        # Only the child may hold its end, so its death reads as EOF here.
        child_conn.close()
        self._process, self._conn = process, parent_conn
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(parent_conn.fileno(), self._on_readable)
        self._loop.add_reader(process.sentinel, self._on_exit)

    async def _next_message(self) -> Message:
        message = await self._inbox.get()
        if isinstance(message, _Died):
            self._inbox.put_nowait(message)
            # EOF and the sentinel both come a moment before the exit code exists (files
            # close before the kernel marks the exit); wait for it briefly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exited.wait(), _EXIT_CODE_WAIT)
            if self._exited.is_set() and self._process is not None:
                self._process.join(_EXIT_CODE_WAIT)
            raise WorkerDiedError(self._death_message())
        return message

    def _on_readable(self) -> None:
        conn = self._conn
        if conn is None or self._dead:
            return
        try:
            while conn.poll():
                message = decode(conn.recv_bytes())
                if isinstance(message, ForwardChanged):
                    self.forward = message.note
                    if self.on_forward_changed is not None:
                        self.on_forward_changed(message.note)
                    continue
                self._inbox.put_nowait(message)
        except (EOFError, OSError):
            self._mark_dead()
        except Exception:  # an undecodable message: treat the worker as lost, never hang
            logger.exception("unreadable message from the worker")
            self._mark_dead()

    def _on_exit(self) -> None:
        self._on_readable()  # outputs sent before the exit are still delivered
        self._mark_dead()
        self._exited.set()
        if self._loop is not None and self._process is not None:
            self._loop.remove_reader(self._process.sentinel)

    def _mark_dead(self) -> None:
        if self._dead:
            return
        self._dead = True
        if self._loop is not None and self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._inbox.put_nowait(_DIED)

    async def _wait_exit(self, timeout: float) -> bool:
        """True once the process has exited (and been reaped) within `timeout` seconds."""
        assert self._process is not None
        if not self._exited.is_set() and self._process.exitcode is None:
            try:
                await asyncio.wait_for(self._exited.wait(), timeout)
            except TimeoutError:
                return False
        self._process.join()
        return True

    def _remove_readers(self) -> None:
        if self._loop is None or self._process is None or self._loop.is_closed():
            return
        self._loop.remove_reader(self._process.sentinel)
        if self._conn is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())

    def _death_message(self) -> str:
        process = self._process
        if process is None:
            return "worker process not started"
        code = process.exitcode
        return (
            f"worker process {process.pid} died (exit code {'unknown' if code is None else code})"
        )
