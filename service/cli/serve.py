"""`stepserve serve`: reading and checking the flags (named as in `vllm serve`), building the
engine, and the process lifetime: serve until SIGTERM/SIGINT, drain, stop the worker, exit 0;
exit 2 for a flag refused (before the port is bound, or by the worker at start-up); exit 1
when the worker dies or the engine cannot start, so a supervisor restarts the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from scheduler import flags as scheduler_flags
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.step_cost import StepCostFn
from service.cli.args import parse_serve_args
from service.cli.checks import (
    CheckedFlags,
    FlagError,
    check_serve_flags,
    worker_config,
    worker_flag_error,
)
from service.cli.cpu_scheduling import apply_engine_cpu_scheduling
from service.cli.serve_args import build_parser
from service.cli.stats_log import log_stats
from service.engine.grammars import ServiceGrammars
from service.engine.loop import AsyncEngine
from service.engine.metrics import ServiceMetrics
from service.engine.step_cost_feed import StepCostFeed, calibrate, new_model
from service.http.app import StartupRefused, create_app
from service.http.protocol import GenerationDefaults
from service.http.state import STATE, AppConfig, EngineFactory, LoadedEngine, ServiceState, Status
from worker.config import WorkerInfo

log = logging.getLogger("stepserve.server")
GC_GEN0_THRESHOLD = 10_000  # see freeze_startup_heap
# aiohttp's access log: client, request line, status, bytes, seconds
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs'


@dataclass
class Refusal:
    """Where the engine factory leaves a flag the worker refused at start-up (exit 2)."""

    error: FlagError | None = None


def scheduler_config(
    args: argparse.Namespace, info: WorkerInfo, step_cost: StepCostFn | None = None
) -> SchedulerConfig:
    """The one place the scheduler's config is built: flags plus the worker's handshake
    (and its measured step-cost model and copy bandwidth, when there is one)."""
    pool_tokens = info.num_gpu_blocks * info.block_size
    max_model_len = info.max_model_len
    if pool_tokens < max_model_len:
        log.warning(
            "KV cache holds %d tokens; capping max_model_len %d to it", pool_tokens, max_model_len
        )
        max_model_len = pool_tokens
    bandwidth = {"swap_bandwidth": info.copy_bandwidth} if info.copy_bandwidth > 0 else {}
    return scheduler_flags.from_args(
        args, max_model_len=max_model_len, block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks, num_cpu_blocks=info.num_cpu_blocks,
        kv_bytes_per_token=info.kv_bytes_per_token, step_cost=step_cost, **bandwidth,
    )


def engine_factory(
    args: argparse.Namespace, refusal: Refusal, own_process: bool = True
) -> EngineFactory:
    """Start the worker and load the tokenizer (concurrently), then build the engine. A
    setting the worker refuses is left in `refusal` and raised as `StartupRefused`. With
    `own_process` (the server, `stepserve generate`) the start-up heap is frozen out of the
    garbage collector's sweeps; a library caller's process keeps its collector as it was."""
    from common.tokenizer import load_tokenizer
    from worker.process.client import WorkerClient, WorkerStartupError

    a = vars(args)
    load = functools.partial(load_tokenizer, a["model"], chat_template=a["chat_template"])

    async def build() -> LoadedEngine:
        worker = WorkerClient(worker_config(args), a["worker_runner"])
        tokenizer_future = asyncio.get_running_loop().run_in_executor(None, load)
        try:
            info, tokenizer = await asyncio.gather(worker.start(), tokenizer_future)
            step_model = new_model(info)
            await calibrate(worker, info, step_model)
            sched_config = scheduler_config(args, info, step_model)
        except WorkerStartupError as exc:
            await worker.shutdown()
            if exc.field is None:
                raise
            refusal.error = worker_flag_error(exc.field, str(exc))
            raise StartupRefused(str(refusal.error)) from None
        except BaseException:
            await worker.shutdown()
            raise
        name = a["served_model_name"] or info.model_name
        metrics = _metrics(name, info, a["metrics_compat"])
        engine = AsyncEngine(
            Scheduler(sched_config),
            worker,
            tokenizer,
            eos_token_ids=info.eos_token_ids,
            max_waiting_requests=a["max_waiting_requests"],
            metrics=metrics,
            step_time=StepCostFeed(step_model, sched_config.step_time_limit_s, metrics),
            grammars=_grammars(info, tokenizer, worker, metrics),
            forward=info.extra.get("forward", "eager"),
        )
        _log_ready(info, sched_config)
        if own_process:
            freeze_startup_heap()
        # after the worker started (it would inherit the policy, though it resets its own);
        # None: a library caller's process, whose policy stays its own
        if a["engine_cpu_scheduling"] is not None:
            log.info("%s", apply_engine_cpu_scheduling(a["engine_cpu_scheduling"]))
        return LoadedEngine(
            engine, name, sched_config.max_model_len, info.vocab_size, info.model_path
        )

    return build


def _grammars(
    info: WorkerInfo, tokenizer: Any, worker: Any, metrics: ServiceMetrics
) -> ServiceGrammars | None:
    """Structured outputs, where the worker masks by a grammar."""
    if not info.structured_outputs:
        return None
    return ServiceGrammars(
        tokenizer, info.vocab_size, info.eos_token_ids[0], worker.prepare_grammar, metrics
    )


def _metrics(name: str, info: WorkerInfo, compat: str | None) -> ServiceMetrics:
    metrics = ServiceMetrics(name, compat=compat)
    metrics.set_worker(
        device=info.device, dtype=info.dtype, quantization=info.quantization,
        compiled=info.compiled, attention_backend=info.attention_backend,
        num_threads=info.num_threads, batch_invariant=info.batch_invariant,
        kv_cache_dtype=info.kv_cache_dtype, wide_steps=info.extra.get("wide_steps", ""),
    )
    return metrics


def _log_ready(info: WorkerInfo, sched_config: SchedulerConfig) -> None:
    log.info(
        "worker ready: %s on %s (%s, quantization %s, %s, %s attention, %d threads), %d KV "
        "blocks of %d tokens (%s)",
        info.model_name,
        info.device,
        info.dtype,
        info.quantization,
        info.extra.get("forward", "eager"),
        info.attention_backend,
        info.num_threads,
        info.num_gpu_blocks,
        info.block_size,
        info.kv_cache_dtype,
    )
    log.info(
        "step budget: %d tokens, %s; swap copies at %.1f GB/s",
        sched_config.max_num_batched_tokens,
        f"{sched_config.max_step_ms:g} ms (prefill share >= {sched_config.min_prefill_share:g})"
        if sched_config.step_time_limit_s
        else "no time budget",
        info.copy_bandwidth / 1e9,
    )


def freeze_startup_heap() -> None:
    """Move what start-up allocated (modules, the tokenizer, config) out of the collector's reach,
    and collect the young generation less often.

    A full collection traverses every tracked object: with the tokenizer and the app's modules
    loaded it took ~140 ms on the serving thread (measured when the tokenizer still came
    from transformers), every ~10 s under load — a stall every stream sees. Frozen objects
    are never traversed again (they live as long as the process anyway), so a full
    collection only walks what serving allocated. Serving allocates in bursts (a step's
    outputs, events, records) that mostly die young by reference count; a gen-0 threshold of
    10,000 instead of 700 collects the survivors a few times a second instead of hundreds of
    times.
    """
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, g1, g2)


async def serve(args: argparse.Namespace, checked: CheckedFlags) -> int:
    """Run the server until a signal (exit 0 after draining), a refused flag (exit 2) or a
    failure (exit 1)."""
    a = vars(args)
    config = AppConfig(
        api_key=a["api_key"] or os.environ.get("STEPSERVE_API_KEY") or None,
        max_body_size=a["max_body_size"],
        enable_debug_endpoints=a["enable_debug_endpoints"],
        enable_dashboard=not a["disable_dashboard"],
        stream_stall_timeout=a["stream_stall_timeout"],
        tool_call_parser=a["tool_call_parser"] if a["enable_auto_tool_choice"] else None,
    )
    refusal = Refusal()
    app = create_app(config, engine_factory(args, refusal), checked.generation_defaults)
    state = app[STATE]
    # After the engine drained, aiohttp waits (up to the same timeout) for handlers to write
    # their last events before it closes connections.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=a["shutdown_timeout"],
        access_log=None if a["disable_access_log"] else logging.getLogger("aiohttp.access"),
        access_log_format=ACCESS_LOG_FORMAT,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, a["host"], a["port"]).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", a["host"], a["port"], exc)
        await runner.cleanup()
        return 1
    log.info(
        "listening on http://%s:%d (/health turns 200 once the model is loaded)",
        a["host"],
        a["port"],
    )
    stats = (
        None
        if a["disable_log_stats"]
        else asyncio.create_task(log_stats(state, a["log_stats_interval"]), name="stepserve-stats")
    )
    code = await _serve_until_stopped(state, a["shutdown_timeout"])
    if stats is not None:
        stats.cancel()
    await runner.cleanup()
    if refusal.error is not None:
        print_flag_error(refusal.error)
        return 2
    return code


async def _serve_until_stopped(state: ServiceState, shutdown_timeout: float) -> int:
    """Wait for SIGTERM/SIGINT (drain, then 0) or a fatal error (1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(state.fatal.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    if state.fatal.is_set():
        log.error("exiting: %s", state.error)
        return 1
    await _drain(state, shutdown_timeout)
    return 0


async def _drain(state: ServiceState, timeout: float) -> None:
    state.status = Status.DRAINING
    if state.loaded is None:
        return
    log.info(
        "draining %d in-flight requests (up to %g s)", state.loaded.engine.num_unfinished, timeout
    )
    if not await state.loaded.engine.drain(timeout):
        log.warning("shutdown timeout: aborted the requests still running")


def print_flag_error(
    error: FlagError, parser: argparse.ArgumentParser | None = None, prog: str = "stepserve serve"
) -> None:
    """As argparse prints its own errors: the usage line, then `stepserve serve: error: ...`."""
    if parser is not None:
        parser.print_usage(sys.stderr)
    print(f"{parser.prog if parser else prog}: error: {error}", file=sys.stderr)


def read_flags(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, CheckedFlags | None]:
    """The command line parsed (argparse exits 2 on what it refuses), logging set to its
    level, and the flags checked: None in place of the checked flags once a refusal is
    printed."""
    args = parse_serve_args(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return args, check_serve_flags(args)
    except FlagError as exc:
        print_flag_error(exc, parser)
        return args, None


def main(argv: list[str] | None = None) -> int:
    """Entry point of `stepserve serve`: 0 after a drained shutdown, 2 for a refused flag,
    1 for a failure."""
    args, checked = read_flags(build_parser(), argv)
    if checked is None:
        return 2
    _log_startup(args, checked)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(args, checked))
    return 0


def _log_startup(args: argparse.Namespace, checked: CheckedFlags) -> None:
    log.info("model: %s", checked.model_path)
    if args.chat_template is not None:
        log.info("chat template: --chat-template %s", _short(args.chat_template))
    defaults, source = checked.generation_defaults, checked.generation_source
    if defaults == GenerationDefaults():
        log.info("generation defaults: none (%s); unset request fields take vLLM's", source)
    else:
        log.info("generation defaults from %s for unset request fields: %s", source,
                 defaults.describe())


def _short(text: str, limit: int = 60) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 3] + "..."
