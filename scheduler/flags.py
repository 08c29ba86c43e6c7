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
from scheduler.slo import SLO, SLOClasses, parse_slo, parse_slo_classes

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


def _slo(value: str) -> SLO:
    try:
        return parse_slo(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _slo_class(value: str) -> tuple[tuple[str, SLO], ...]:
    try:
        return parse_slo_classes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_scheduler_args(
    parser: argparse.ArgumentParser, defaults: SchedulerConfig = _DEFAULTS
) -> argparse._ArgumentGroup:
    """Declare the scheduler's flags (vLLM's names where the concept is the same) with the
    values of `defaults` (an offline run's are `OFFLINE_DEFAULTS`); the docs say more:
    docs/scheduling.md, docs/step_time_budget.md."""
    d = defaults
    # the token budget's flag defaults to None (resolved with chunked prefill and the
    # context length); this is the budget it resolves to when prompts are chunked
    parser.set_defaults(default_token_budget=d.max_num_batched_tokens)
    g = parser.add_argument_group("scheduler")
    add = g.add_argument
    add("--max-num-batched-tokens", type=POSITIVE_INT, default=None,
        help=f"token budget of one step (default {d.max_num_batched_tokens}; without chunked "
             "prefill, at least the context length)")
    add("--max-step-ms", type=NON_NEGATIVE, default=d.max_step_ms,
        help="step-time budget: prefill chunks shrink so a step with decodes stays within it "
             "(0: off; default %(default)g)")
    add("--min-prefill-share", type=SHARE, default=d.min_prefill_share,
        help="share of a step left to prefill where decodes alone fill the budget "
             "(0: the budget is a cap; default %(default)g)")
    add("--max-num-seqs", type=POSITIVE_INT, default=d.max_num_seqs,
        help="most requests in the running batch (default %(default)s)")
    add("--max-model-len", type=POSITIVE_INT, default=None,
        help="context length (serve: the model's, capped at 8192 and the KV cache; simulate: "
             "the longest request)")
    add("--block-size", type=POSITIVE_INT, default=d.block_size,
        help="tokens per KV block (default %(default)s)")
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill, help="split long prompts across steps (default on)")
    add("--long-prefill-token-threshold", type=NON_NEGATIVE_INT,
        default=d.long_prefill_token_threshold,
        help="cap one prompt's chunk at this many tokens (0: only the token budget caps it)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV blocks of shared prompt prefixes (default on)")
    add("--preemption-mode", choices=("recompute", "swap", "auto"), default=d.preemption_mode,
        help="a victim's KV: recompute it, swap it to host memory, or the cheaper of the two "
             "(default %(default)s)")
    _add_policy_args(g, d)
    return g


def _add_policy_args(g: argparse._ArgumentGroup, d: SchedulerConfig) -> None:
    add = g.add_argument
    add("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
        help="waiting-queue order: fcfs, priority (aged), sjf (shortest predicted first, aged), "
             "fair (per `user`), slo (least slack first)")
    add("--victim-policy", choices=VICTIM_POLICIES, default=d.victim_policy,
        help="which running request preemption evicts (default: priority under the priority "
             "policy, slack under slo, else newest)")
    add("--aging-period", type=POSITIVE, default=d.aging_period,
        help="priority: seconds of waiting that raise a request one priority level "
             "(default %(default)s)")
    add("--priority-preemption-threshold", type=POSITIVE_INT,
        default=d.priority_preemption_threshold,
        help="priority: a waiting request this many levels more urgent preempts a running one "
             "(default: never)")
    add("--output-len-predictor", choices=PREDICTORS, default=d.output_len_predictor,
        help="output lengths for sjf and least_remaining: learned (per user) or max_tokens "
             "(default %(default)s)")
    add("--sjf-aging-rate", type=POSITIVE, default=d.sjf_aging_rate,
        help="sjf: tokens of predicted work forgiven per second waited (default %(default)g)")
    add("--tenant-weights", type=_tenant_weights, default=d.tenant_weights,
        help='fair: share weights, e.g. alice=2,bob=1, or a JSON file {"alice": 2}; others weigh 1')
    add("--default-slo", type=_slo, default=d.slo_classes.default, metavar="ttft=MS,tpot=MS",
        help="objectives of a request that sets none (slo_ttft_ms / slo_tpot_ms), e.g. "
             "ttft=2000,tpot=150 (default: none)")
    add("--slo-class", type=_slo_class, action="append", default=[],
        metavar="CLASS=ttft=MS,tpot=MS",
        help="a class's objectives over the default, e.g. user:batch=ttft=60000,tpot=none or "
             "priority:0=ttft=500; repeatable, or a JSON file")
    add("--slo-demotion-s", type=NON_NEGATIVE, default=d.slo_demotion_s,
        help="slo: seconds a request whose deadline is lost (or that has none) yields to "
             "meetable ones (default %(default)g)")
    add("--reject-unmeetable", action="store_true", default=d.reject_unmeetable,
        help="refuse a request whose TTFT objective is forecast unmeetable: 429, with the "
             "predicted wait until it could be met as Retry-After")


# Flags whose dest is a SchedulerConfig field of the same name and value.
FLAG_FIELDS = (
    "max_step_ms", "min_prefill_share", "max_num_seqs", "block_size", "enable_chunked_prefill",
    "long_prefill_token_threshold", "enable_prefix_caching", "preemption_mode", "scheduling_policy",
    "victim_policy", "aging_period", "priority_preemption_threshold", "output_len_predictor",
    "sjf_aging_rate", "tenant_weights", "slo_demotion_s", "reject_unmeetable",
)


def from_args(ns: argparse.Namespace, *, max_model_len: int, **runtime: Any) -> SchedulerConfig:
    """The config of the flags in `ns`, with `max_model_len` resolved by the command and
    `runtime` fields (num_gpu_blocks, step_cost, ...) that no flag sets."""
    fields = {name: getattr(ns, name) for name in FLAG_FIELDS}
    classes = tuple(entry for given in ns.slo_class for entry in given)
    try:
        fields["slo_classes"] = SLOClasses(ns.default_slo, classes)
    except ValueError as exc:  # a class named twice across --slo-class flags
        raise ValueError(f"--slo-class: {exc}") from None
    budget = token_budget(
        ns.max_num_batched_tokens, ns.enable_chunked_prefill, max_model_len, ns.default_token_budget
    )
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
