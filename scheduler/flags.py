"""The scheduler's command-line flags, declared once for `stepserve serve` and `stepserve
simulate`: `add_scheduler_args(parser)` declares them from `SchedulerConfig`'s fields (each
flag's dest is its field's name, its default the field's default) and `from_args(ns,
**runtime)` builds the config from them plus what only the command knows at run time
(the KV pool's size, the step-cost model, the model's context length).

`flag_error(exc)` turns a config error's field names into flag names, so a bad combination
reads as the user typed it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any

from scheduler.config import (
    PREDICTORS,
    SCHEDULING_POLICIES,
    VICTIM_POLICIES,
    SchedulerConfig,
    token_budget,
)
from scheduler.fairness import parse_tenant_weights

_DEFAULTS = SchedulerConfig()


def _number(kind: type, low: float, low_ok: bool, high: float = math.inf) -> Any:
    """An argparse type: a finite number of `kind` above `low` (or at it, when `low_ok`)
    and below `high`."""
    bound = f">= {low:g}" if low_ok else f"> {low:g}"
    if high < math.inf:
        bound = f"in [{low:g}, {high:g})"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not {'an integer' if kind is int else 'a number'}: {text!r}"
            ) from None
        ok = math.isfinite(value) and (value >= low if low_ok else value > low) and value < high
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


POSITIVE_INT = _number(int, 1, True)
NON_NEGATIVE_INT = _number(int, 0, True)
POSITIVE = _number(float, 0, False)
NON_NEGATIVE = _number(float, 0, True)
SHARE = _number(float, 0, True, 1.0)


def _tenant_weights(value: str) -> tuple[tuple[str, float], ...]:
    try:
        weights = parse_tenant_weights(value)
        SchedulerConfig(tenant_weights=weights)  # positive, each tenant once
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return weights


def add_scheduler_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Declare the scheduler's flags (vLLM's names where the concept is the same)."""
    d = _DEFAULTS
    g = parser.add_argument_group("scheduler")
    g.add_argument(
        "--max-num-batched-tokens",
        type=POSITIVE_INT,
        default=None,
        help=f"token budget of one step (default {d.max_num_batched_tokens}; with chunked prefill "
             "off, "
        "at least the max model length)",
    )
    g.add_argument(
        "--max-step-ms",
        type=NON_NEGATIVE,
        default=d.max_step_ms,
        help="step-time budget: while requests decode, prefill chunks shrink so that a step's "
             "time, "
        "as predicted by a cost model fitted online, stays within this many ms; 0: off. Needs "
        "chunked prefill (default %(default)g)",
    )
    g.add_argument(
        "--min-prefill-share",
        type=SHARE,
        default=d.min_prefill_share,
        help="share of a step's time always left to prefill: where the decodes alone fill "
        "(1 - share) of --max-step-ms, a step may run to their time / (1 - share); 0: "
        "--max-step-ms is a cap (default %(default)g)",
    )
    g.add_argument("--max-num-seqs", type=POSITIVE_INT, default=d.max_num_seqs,
                   help="most requests in the running batch (default %(default)s)")
    g.add_argument(
        "--max-model-len",
        type=POSITIVE_INT,
        default=None,
        help="context length (serve: the model's, capped at 8192 and at the KV cache; simulate: "
             "the "
        "workload's longest prompt + output)",
    )
    g.add_argument("--block-size", type=POSITIVE_INT, default=d.block_size,
                   help="tokens per KV block (default %(default)s)")
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
        help="split long prompts across steps (default on)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=NON_NEGATIVE_INT,
        default=d.long_prefill_token_threshold,
        help="cap one prompt's chunk at this many tokens (0: only the token budget caps it)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV blocks of shared prompt prefixes (default on)",
    )
    g.add_argument(
        "--preemption-mode",
        choices=("recompute", "swap", "auto"),
        default=d.preemption_mode,
        help="what preemption does with the victim's KV: drop and recompute it, swap it to host "
        "memory, or whichever is predicted cheaper (default %(default)s)",
    )
    _add_policy_args(g)
    return g


def _add_policy_args(g: argparse._ArgumentGroup) -> None:
    d = _DEFAULTS
    g.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="waiting-queue order: fcfs; priority (the request's priority field, aged); sjf "
             "(shortest "
        "predicted work first, aged); fair (Virtual Token Counter per `user`) (default "
        "%(default)s)",
    )
    g.add_argument(
        "--victim-policy",
        choices=VICTIM_POLICIES,
        default=d.victim_policy,
        help="which running request preemption evicts (default: priority under --scheduling-policy "
        "priority, else newest)",
    )
    g.add_argument(
        "--aging-period",
        type=POSITIVE,
        default=d.aging_period,
        help="priority: seconds of waiting that raise a request one priority level (default "
             "%(default)s)",
    )
    g.add_argument(
        "--priority-preemption-threshold",
        type=POSITIVE_INT,
        default=d.priority_preemption_threshold,
        help="priority: a waiting request preempts the least urgent running one when it is at "
             "least "
        "this many levels more urgent (default: never)",
    )
    g.add_argument(
        "--output-len-predictor",
        choices=PREDICTORS,
        default=d.output_len_predictor,
        help="output lengths for sjf and least_remaining: learned (per user and prompt length) or "
        "max_tokens (default %(default)s)",
    )
    g.add_argument(
        "--sjf-aging-rate",
        type=POSITIVE,
        default=d.sjf_aging_rate,
        help="sjf: tokens of predicted work forgiven per second waited (default %(default)g)",
    )
    g.add_argument(
        "--tenant-weights",
        type=_tenant_weights,
        default=d.tenant_weights,
        help='fair: share weights, e.g. alice=2,bob=1, or a JSON file {"alice": 2}; others weigh 1',
    )


# Flags whose dest is a SchedulerConfig field of the same name and value.
FLAG_FIELDS = (
    "max_step_ms",
    "min_prefill_share",
    "max_num_seqs",
    "block_size",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "enable_prefix_caching",
    "preemption_mode",
    "scheduling_policy",
    "victim_policy",
    "aging_period",
    "priority_preemption_threshold",
    "output_len_predictor",
    "sjf_aging_rate",
    "tenant_weights",
)


def from_args(ns: argparse.Namespace, *, max_model_len: int, **runtime: Any) -> SchedulerConfig:
    """The config of the flags in `ns`, with `max_model_len` resolved by the command and
    `runtime` fields (num_gpu_blocks, step_cost, ...) that no flag sets."""
    fields = {name: getattr(ns, name) for name in FLAG_FIELDS}
    budget = token_budget(ns.max_num_batched_tokens, ns.enable_chunked_prefill, max_model_len)
    return SchedulerConfig(**{**fields, **runtime, "max_model_len": max_model_len,
                              "max_num_batched_tokens": budget})


def flag_error(exc: ValueError) -> str:
    """A config error's message with field names spelled as flags (`--max-num-seqs`)."""
    names = {f.name for f in dataclasses.fields(SchedulerConfig)} & {
        *FLAG_FIELDS,
        "max_num_batched_tokens",
        "max_model_len",
    }
    return re.sub(
        r"\b[a-z_]+\b",
        lambda m: "--" + m.group(0).replace("_", "-") if m.group(0) in names else m.group(0),
        str(exc),
    )
