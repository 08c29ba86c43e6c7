"""Sweeps: one simulated run per value of one parameter, and the three ready presets.

A parameter is any `SchedulerConfig` field under its dataclass name or its flag's
(`max_num_batched_tokens`, `num_gpu_blocks`, `preemption_mode`, ...; `token_budget` and
`kv_blocks` are aliases), or a workload parameter: `request_rate`, `num_prompts`,
`burstiness`, `prompt_len_max`, `output_len_max`, `prefix_len`, `num_groups`, `seed`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from loadgen.distributions import LengthDist
from loadgen.sim.setup import STRATEGIES, build_workload, run_strategy
from scheduler.config import SchedulerConfig

ALIASES = {"token_budget": "max_num_batched_tokens", "kv_blocks": "num_gpu_blocks",
           "policy": "scheduling_policy", "max_model_length": "max_model_len"}
WORKLOAD_PARAMS = {"request_rate": float, "num_prompts": int, "burstiness": float,
                   "prompt_len_max": int, "output_len_max": int, "prefix_len": int,
                   "num_groups": int, "seed": int}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_OTHER_PARAMS = {"scheduling_policy", "batch_size", "batch_timeout", "max_step_ms"}
ROW_KEYS = (
    "request_throughput", "output_throughput", "total_token_throughput", "median_ttft_ms",
    "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms", "median_tpot_ms", "p99_itl_ms",
    "num_preemptions", "mean_kv_cache_usage", "unfinished",
)


@dataclass(frozen=True)
class Preset:
    """A ready sweep: the parameter, its values and the flags that set the scene."""

    name: str
    param: str
    values: tuple[str, ...]
    defaults: dict[str, Any]  # argparse dests -> values, applied before the user's flags
    about: str
    # A second sweep on the same scene, with the step-time target off, plotted alongside
    companion: tuple[str, tuple[str, ...]] | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "token-budget",
            "max_num_batched_tokens",
            ("256", "512", "1024", "2048", "4096", "8192"),
            {
                "num_prompts": 300,
                "request_rate": 6.0,
                "prompt_len": LengthDist.parse("uniform:100:3000"),
                "output_len": LengthDist.parse("uniform:50:400"),
                "num_gpu_blocks": 16384,
                "seed": 0,
            },
            "larger token budgets prefill faster (TTFT) "
            "but put long prefills next to decodes (ITL)",
        ),
        Preset(
            "kv-capacity",
            "num_gpu_blocks",
            ("50", "100", "200", "400", "800", "1600"),
            {
                "num_prompts": 200,
                "request_rate": 8.0,
                "prompt_len": LengthDist.parse("uniform:20:400"),
                "output_len": LengthDist.parse("uniform:20:400"),
                "max_model_len": 800,
                "seed": 0,
            },
            "a small KV cache caps the batch and preempts; "
            "capacity buys throughput until compute binds",
        ),
        Preset(
            "prompt-len",
            "prompt_len_max",
            ("200", "500", "1000", "2000", "3000", "5000"),
            {
                "num_prompts": 200,
                "request_rate": 4.0,
                "prompt_len": LengthDist.parse("uniform:20:200"),
                "output_len": LengthDist.parse("uniform:50:300"),
                "num_gpu_blocks": 1024,
                "seed": 0,
            },
            "longer prompts cost prefill compute and KV; "
            "TTFT and preemptions grow, throughput falls",
        ),
        Preset(
            "step-time",
            "max_step_ms",
            ("100", "200", "300", "400", "600", "800", "1200"),
            {
                "num_prompts": 48,
                "prompt_len": LengthDist.parse("uniform:20:600"),
                "output_len": LengthDist.parse("uniform:32:256"),
                "model_shape": "smollm2-135m",
                "hardware": "cpu",
                "num_gpu_blocks": 1456,
                "seed": 0,
            },
            "a step-time target bounds ITL p99 near itself; "
            "too low starves prefill (TTFT, throughput)",
            companion=("max_num_batched_tokens", ("256", "512", "1024", "2048")),
        ),
    )
}


def companion_rows(args: argparse.Namespace, preset: Preset) -> list[dict[str, Any]]:
    """The preset's second sweep on the same scene, with the step-time target off."""
    assert preset.companion is not None
    param, values = preset.companion
    return sweep(with_param(args, "max_step_ms", "0"), param, list(values))


def canonical(param: str) -> str:
    """The namespace attribute a sweep parameter sets (flag spellings accepted)."""
    name = param.replace("-", "_").lstrip("_")
    name = ALIASES.get(name, name)
    if name not in _CONFIG_FIELDS and name not in WORKLOAD_PARAMS and name not in _OTHER_PARAMS:
        raise ValueError(f"unknown sweep parameter {param!r}: use a SchedulerConfig field "
                         f"or one of {sorted(WORKLOAD_PARAMS)}")
    return name


def _convert(name: str, text: str, current: Any) -> Any:
    if name in WORKLOAD_PARAMS:
        return WORKLOAD_PARAMS[name](text)
    if isinstance(current, bool) or text.lower() in ("true", "false"):
        return text.lower() in ("1", "true", "yes", "on")
    if isinstance(current, int) or (current is None and text.isdigit()):
        return int(text)
    if isinstance(current, float):
        return float(text)
    return text


def _cap(dist: LengthDist, top: int) -> LengthDist:
    """The same distribution with its maximum moved to `top`."""
    if dist.kind == "fixed":
        return LengthDist("fixed", top)
    if dist.kind == "uniform":
        return LengthDist("uniform", min(dist.a, top), top)
    return LengthDist("lognormal", dist.a, dist.b, top)


def with_param(args: argparse.Namespace, param: str, text: str) -> argparse.Namespace:
    """A copy of `args` with one parameter set from its text value."""
    out = argparse.Namespace(**vars(args))
    name = canonical(param)
    if name == "prompt_len_max":
        out.prompt_len = _cap(args.prompt_len, int(text))
    elif name == "output_len_max":
        out.output_len = _cap(args.output_len or LengthDist.parse("128"), int(text))
    elif hasattr(args, name):
        setattr(out, name, _convert(name, text, getattr(args, name)))
    else:  # a SchedulerConfig field with no flag of its own
        value = _convert(name, text, getattr(SchedulerConfig(), name))
        out.config_overrides = {**getattr(args, "config_overrides", {}), name: value}
    return out


def run_point(args: argparse.Namespace, param: str, text: str) -> dict[str, Any]:
    """One row: the value and the run's headline numbers."""
    point = with_param(args, param, text)
    strategy = args.strategy if args.strategy in STRATEGIES else "continuous"
    result = run_strategy(point, strategy, build_workload(point))
    summary = result.summary()
    row: dict[str, Any] = {"value": text}
    row.update((k, summary[k]) for k in ROW_KEYS)
    row["duration"] = summary["duration"]
    return row


def sweep(args: argparse.Namespace, param: str, values: list[str]) -> list[dict[str, Any]]:
    return [run_point(args, param, v) for v in values]


def format_rows(rows: list[dict[str, Any]], param: str) -> str:
    """A fixed-width table, one row per value."""
    heads = (param, "req/s", "tok/s", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "TPOT p50",
             "ITL p99", "preempt", "KV use", "unfin")
    lines = [" ".join(f"{h:>10}" for h in heads)]
    for r in rows:
        cells = [str(r["value"]), f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.0f}",
                 *(_ms(r[k]) for k in ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms",
                                       "p99_e2el_ms", "median_tpot_ms", "p99_itl_ms")),
                 str(r["num_preemptions"]), f"{r['mean_kv_cache_usage']:.0%}", str(r["unfinished"])]
        lines.append(" ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def _ms(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return f"{x:.0f}ms" if x < 10_000 else f"{x / 1e3:.1f}s"
