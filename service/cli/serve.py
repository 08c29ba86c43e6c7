"""`stepserve serve`: flags (named as in `vllm serve`), building the engine, and the process
lifetime: serve until SIGTERM/SIGINT, drain, stop the worker, exit 0 — or exit 1 when the
worker dies or the engine cannot start, so a supervisor restarts the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys

from aiohttp import web

from scheduler import flags as scheduler_flags
from scheduler.config import SchedulerConfig, token_budget
from scheduler.scheduler import Scheduler
from scheduler.step_cost import StepCostFn
from service.cli.cpu_scheduling import apply_engine_cpu_scheduling
from service.cli.serve_args import build_parser, kv_cache_bytes
from service.engine.loop import AsyncEngine
from service.engine.metrics import ServiceMetrics
from service.engine.step_cost_feed import StepCostFeed, calibrate, new_model
from service.http.app import create_app
from service.http.state import STATE, AppConfig, EngineFactory, LoadedEngine, ServiceState, Status
from worker.config import WorkerConfig, WorkerInfo

log = logging.getLogger("stepserve.server")
GC_GEN0_THRESHOLD = 10_000  # see freeze_startup_heap


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker's settings from the flags."""
    a = vars(args)
    return WorkerConfig(
        model=a["model"],
        dtype=a["dtype"],
        quantization=a["quantization"],
        gguf_activations=a["gguf_activations"],
        enforce_eager=a["enforce_eager"],
        batch_invariant=a["batch_invariant"],
        device=a["device"],
        block_size=a["block_size"],
        kv_cache_dtype=a["kv_cache_dtype"],
        max_model_len=a["max_model_len"],
        # sizes the CUDA profiling forward, which is capped at the model's length anyway
        max_num_batched_tokens=_token_budget(args, a["max_model_len"] or 1 << 31),
        kv_cache_memory=kv_cache_bytes(a["kv_cache_memory"]),
        gpu_memory_utilization=a["gpu_memory_utilization"],
        swap_space=a["swap_space"],
        attention_backend=a["attention_backend"],
        seed=a["seed"],
        num_threads=a["num_threads"],
        helper_cpu_scheduling=a["helper_cpu_scheduling"],
    )


def _token_budget(args: argparse.Namespace, max_model_len: int) -> int:
    """--max-num-batched-tokens, or its default for this max model length."""
    return token_budget(args.max_num_batched_tokens, args.enable_chunked_prefill, max_model_len)


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
        args,
        max_model_len=max_model_len,
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        kv_bytes_per_token=info.kv_bytes_per_token,
        step_cost=step_cost,
        **bandwidth,
    )


def engine_factory(args: argparse.Namespace) -> EngineFactory:
    """Start the worker and load the tokenizer (concurrently), then build the engine."""
    from common.tokenizer import load_tokenizer
    from worker.process.client import WorkerClient

    a = vars(args)

    async def build() -> LoadedEngine:
        worker = WorkerClient(worker_config(args), a["worker_runner"])
        loop = asyncio.get_running_loop()
        tokenizer_future = loop.run_in_executor(None, load_tokenizer, a["model"])
        try:
            info, tokenizer = await asyncio.gather(worker.start(), tokenizer_future)
            step_model = new_model(info)
            await calibrate(worker, info, step_model)
            sched_config = scheduler_config(args, info, step_model)
        except BaseException:
            await worker.shutdown()
            raise
        name = a["served_model_name"] or info.model_name
        metrics = ServiceMetrics(name)
        metrics.set_worker(
            device=info.device,
            dtype=info.dtype,
            quantization=info.quantization,
            compiled=info.compiled,
            attention_backend=info.attention_backend,
            num_threads=info.num_threads,
            batch_invariant=info.batch_invariant,
            kv_cache_dtype=info.kv_cache_dtype,
        )
        engine = AsyncEngine(
            Scheduler(sched_config),
            worker,
            tokenizer,
            eos_token_ids=info.eos_token_ids,
            max_waiting_requests=a["max_waiting_requests"],
            metrics=metrics,
            step_time=StepCostFeed(step_model, sched_config.step_time_limit_s, metrics),
        )
        log.info(
            "worker ready: %s on %s (%s, quantization %s, %s, %s attention, %d threads), %d KV blocks of %d "
            "tokens (%s)",
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
        freeze_startup_heap()
        # after the worker started (it would inherit the policy, though it resets its own)
        log.info("%s", apply_engine_cpu_scheduling(a["engine_cpu_scheduling"]))
        return LoadedEngine(
            engine, name, sched_config.max_model_len, info.vocab_size, info.model_path
        )

    return build


def freeze_startup_heap() -> None:
    """Move what start-up allocated (modules, the tokenizer, config) out of the collector's
    reach, and collect the young generation less often.

    A full collection traverses every tracked object: with the tokenizer and transformers
    loaded that is ~140 ms on the serving thread, every ~10 s under load — a stall every
    stream sees. Frozen objects are never traversed again (they live as long as the process
    anyway), so a full collection only walks what serving allocated. Serving allocates in
    bursts (a step's outputs, events, records) that mostly die young by reference count; a
    gen-0 threshold of 10,000 instead of 700 collects the survivors a few times a second
    instead of hundreds of times.
    """
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, g1, g2)


async def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal (exit 0 after draining) or a failure (exit 1)."""
    a = vars(args)
    config = AppConfig(
        api_key=a["api_key"] or os.environ.get("STEPSERVE_API_KEY") or None,
        max_body_size=a["max_body_size"],
        enable_debug_endpoints=a["enable_debug_endpoints"],
        enable_dashboard=not a["disable_dashboard"],
        stream_stall_timeout=a["stream_stall_timeout"],
    )
    app = create_app(config, engine_factory(args))
    state = app[STATE]
    # After the engine drained, aiohttp waits (up to the same timeout) for handlers to write
    # their last events before it closes connections.
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=a["shutdown_timeout"], access_log=None
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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(state.fatal.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    code = 1 if state.fatal.is_set() else 0
    if code == 0:
        await _drain(state, a["shutdown_timeout"])
    else:
        log.error("exiting: %s", state.error)
    await runner.cleanup()
    return code


async def _drain(state: ServiceState, timeout: float) -> None:
    state.status = Status.DRAINING
    if state.loaded is None:
        return
    log.info(
        "draining %d in-flight requests (up to %g s)", state.loaded.engine.num_unfinished, timeout
    )
    if not await state.loaded.engine.drain(timeout):
        log.warning("shutdown timeout: aborted the requests still running")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `stepserve serve`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        _static_scheduler_checks(args)
    except ValueError as exc:
        print(f"stepserve serve: error: {scheduler_flags.flag_error(exc)}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(args))
    return 0


def _static_scheduler_checks(args: argparse.Namespace) -> SchedulerConfig:
    """The flag combinations SchedulerConfig can reject before the model loads."""
    return scheduler_flags.from_args(args, max_model_len=args.max_model_len or 1,
                                     num_cpu_blocks=1 if args.swap_space > 0 else 0)
