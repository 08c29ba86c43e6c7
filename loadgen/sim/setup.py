"""Flags of `stepserve simulate` and the one place they become a workload, a
`SchedulerConfig`, a `CostModel` and a run of the chosen batching strategy.

Scheduler flags use the `vllm serve` names. `--max-model-len` defaults to the longest
prompt + output of the workload; the `auto` preemption mode's cost constants come from the
cost model, so the scheduler and the simulator price a swap the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from loadgen.report import parse_goodput
from loadgen.sim.cost_model import (
    HARDWARE_PROFILES,
    MODEL_SHAPES,
    CostModel,
    get_hardware,
    get_model_shape,
)
from loadgen.sim.result import SimResult
from loadgen.sim.simulator import DEFAULT_MAX_RETRIES, SimLimits, Simulator
from loadgen.sim.step_cost import seeded_model
from loadgen.sim.strategies import FixedBatchConfig, simulate_padding, simulate_static
from loadgen.workloads import WorkloadRequest, add_workload_args, workload_from_args
from scheduler import flags as scheduler_flags
from scheduler.config import SchedulerConfig
from scheduler.flags import NON_NEGATIVE_INT, POSITIVE_INT, add_scheduler_args
from scheduler.step_cost_fit import OnlineStepCost

STRATEGIES = ("continuous", "static", "padding")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cost model")
    g.add_argument("--model-shape", default="llama-3.1-8b",
                   help=f"{', '.join(MODEL_SHAPES)} or a path to a HF config.json")
    g.add_argument(
        "--hardware",
        default="a100-80g",
        help=f"{', '.join(HARDWARE_PROFILES)} (a100 works too) or a calibrated profile JSON",
    )
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on the cpu profile, else the shape's own (bfloat16)")


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    """The KV pool's size, which `serve` learns from the worker's memory."""
    g = parser.add_argument_group("KV pool (serve sizes it from memory)")
    g.add_argument("--num-gpu-blocks", type=POSITIVE_INT, default=SchedulerConfig().num_gpu_blocks,
                   help="device KV blocks (default %(default)s)")
    g.add_argument(
        "--num-cpu-blocks",
        type=NON_NEGATIVE_INT,
        default=None,
        help="host swap blocks; default 0, or --num-gpu-blocks under swap/auto preemption",
    )


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Everything a simulated run takes: workload, scheduler, cost model, strategy, output."""
    add_workload_args(parser)
    add_scheduler_args(parser)
    add_pool_args(parser)
    add_cost_args(parser)
    g = parser.add_argument_group("strategy and limits")
    g.add_argument("--strategy", choices=(*STRATEGIES, "all"), default="continuous")
    g.add_argument("--batch-size", type=int, default=32, help="static/padding: requests per batch")
    g.add_argument("--batch-timeout", type=float, default=1.0,
                   help="static: seconds the oldest request waits for a full batch")
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--max-time", type=float, default=None, help="virtual seconds")
    c = parser.add_argument_group("clients refused by --reject-unmeetable")
    c.add_argument("--max-retries", type=NON_NEGATIVE_INT, default=DEFAULT_MAX_RETRIES,
                   help="a refused client sends again after the Retry-After at most this many "
                        "times, then gives up (default %(default)s)")
    c.add_argument("--exact-retry-after", action="store_true",
                   help="the client waits the scheduler's predicted seconds, not the header's "
                        "whole seconds (rounded up, at least 1)")
    c.add_argument("--retry-after-every", type=_seconds, default=None, metavar="SECONDS",
                   help="check the Retry-After of a refusal at most every SECONDS of the run by "
                        "re-simulating from it (0: every refusal; each costs a dozen short "
                        "simulations; default: none)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the summary as JSON, not tables")
    o.add_argument("--result-json", default=None, help="write config, summary and records here")
    o.add_argument("--timeline", default=None, help="PNG of the run's per-step timeline")
    o.add_argument(
        "--timeline-json",
        default=None,
        help="every step as a dashboard record (all strategies in one file): "
        "play it with `stepserve view FILE`",
    )
    o.add_argument("--goodput", nargs="*", default=None, help="SLOs: ttft:MS tpot:MS e2el:MS")


def cost_model_from_args(args: argparse.Namespace) -> CostModel:
    shape, hardware = get_model_shape(args.model_shape), get_hardware(args.hardware)
    dtype = args.dtype
    if dtype == "auto" and hardware.name.startswith("cpu"):
        dtype = "float32"
    if dtype != "auto":
        shape = shape.with_dtype(dtype)
    return CostModel(shape, hardware, args.block_size)


def scheduler_config_from_args(
    args: argparse.Namespace,
    workload: list[WorkloadRequest],
    cm: CostModel,
    step_model: OnlineStepCost | None = None,
) -> SchedulerConfig:
    """`step_model` (default: a fresh seeded one) prices steps for the time budget and
    recomputes for "auto" preemption; the simulator must feed it every step."""
    longest = max((w.prompt_len + (w.max_tokens or w.output_len) for w in workload), default=1)
    cpu_blocks = args.num_cpu_blocks
    if cpu_blocks is None:
        cpu_blocks = args.num_gpu_blocks if args.preemption_mode in ("swap", "auto") else 0
    max_model_len = args.max_model_len or longest
    config = scheduler_flags.from_args(
        args,
        max_model_len=max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        num_cpu_blocks=cpu_blocks,
        kv_bytes_per_token=cm.shape.kv_bytes_per_token,
        flops_per_token=float(cm.shape.dense_flops_per_token),
        swap_bandwidth=cm.hardware.host_bandwidth,
        compute_rate=cm.hardware.peak_flops,
        step_cost=step_model or seeded_model(cm),
    )
    overrides = getattr(args, "config_overrides", None)  # fields without a flag (set by sweeps)
    return dataclasses.replace(config, **overrides) if overrides else config


def fixed_batch_config(args: argparse.Namespace) -> FixedBatchConfig:
    """Static/padding batches get the same KV memory the paged cache has."""
    return FixedBatchConfig(batch_size=args.batch_size, timeout=args.batch_timeout,
                            kv_capacity_tokens=args.num_gpu_blocks * args.block_size,
                            block_size=args.block_size)


def run_strategy(args: argparse.Namespace, strategy: str, workload: list[WorkloadRequest],
                 timeline: bool = False, record_steps: bool = False) -> SimResult:
    """One simulated run of `strategy` on `workload` with the flags in `args`; `record_steps`
    keeps every step as a dashboard record (`--timeline-json`)."""
    cm = cost_model_from_args(args)
    if strategy == "continuous":
        model = seeded_model(cm)
        config = scheduler_config_from_args(args, workload, cm, model)
        limits = SimLimits(max_steps=args.max_steps, max_time=args.max_time)
        # The scheduler reads the step model only for the time budget and "auto" preemption:
        # without either, spare the refits.
        used = config.step_time_limit_s > 0 or config.preemption_mode == "auto"
        # The scheduler reads the step model for the time budget, "auto" preemption and the
        # forecasts (slo policy, admission checks).
        used = used or config.scheduling_policy == "slo" or config.reject_unmeetable
        return Simulator(config, cm, limits, record_timeline=timeline, record_steps=record_steps,
                         step_model=model if used else None,
                         max_retries=getattr(args, "max_retries", DEFAULT_MAX_RETRIES),
                         retry_after_every=getattr(args, "retry_after_every", None),
                         whole_second_retry=not getattr(args, "exact_retry_after", False),
                         ).run(workload)
    run = simulate_static if strategy == "static" else simulate_padding
    return run(
        workload, cm, fixed_batch_config(args), record_timeline=timeline, record_steps=record_steps
    )


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The flags worth recording next to a result."""
    keep = (
        "num_prompts", "request_rate", "burstiness", "seed", "dataset", "model_shape", "hardware",
        "dtype", "max_num_batched_tokens", "max_step_ms", "min_prefill_share", "max_num_seqs",
        "max_model_len", "block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_chunked_prefill",
        "long_prefill_token_threshold", "preemption_mode", "scheduling_policy", "victim_policy",
        "aging_period", "priority_preemption_threshold", "output_len_predictor", "sjf_aging_rate",
        "tenant_weights", "enable_prefix_caching", "batch_size", "batch_timeout",
        "slo_demotion_s", "reject_unmeetable", "max_retries", "retry_after_every",
    )
    cfg = {k: getattr(args, k) for k in keep if hasattr(args, k)}
    cfg.update(prompt_len=str(args.prompt_len), output_len=str(args.output_len))
    if hasattr(args, "default_slo"):
        cfg["default_slo"] = args.default_slo.as_ms()
        cfg["slo_class"] = {name: slo.as_ms() for given in args.slo_class for name, slo in given}
    return cfg


def build_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    return workload_from_args(args)


def goodput_of(args: argparse.Namespace) -> dict[str, float] | None:
    return parse_goodput(args.goodput) or None
