"""Workloads: lists of `WorkloadRequest` (arrival time, prompt, lengths, priority).

Shared by the load generator (`loadgen.bench`) and the simulator. Builders:
`synthetic`, `from_jsonl`, `from_sharegpt`, `shared_prefix`; `add_workload_args` and
`workload_from_args` give both CLIs the same flags. Each random aspect (arrivals,
lengths, priorities, prompt tokens, dataset order) draws from its own stream of the
seed, so changing e.g. the prompt length distribution leaves the arrival times alone.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.distributions import LengthDist, PriorityMix, arrival_times
from loadgen.prompts import PromptBuilder

__all__ = [
    "LengthDist", "PriorityMix", "PromptBuilder", "WorkloadRequest", "add_workload_args",
    "arrival_times", "from_jsonl", "from_sharegpt", "shared_prefix", "synthetic",
    "workload_from_args",
]

DATASETS = ("synthetic", "jsonl", "sharegpt", "shared-prefix")
_ARRIVALS, _LENGTHS, _PRIORITIES, _TOKENS, _ORDER = range(5)


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload."""

    request_id: str
    arrival_time: float  # seconds from the start of the run
    prompt_len: int  # tokens (exact with a tokenizer or token ids; estimated from text otherwise)
    output_len: int  # tokens to generate (max_tokens)
    priority: int = 0  # lower = more urgent (vLLM convention)
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    group: int | None = None  # shared-prefix group, if any
    user: str | None = None  # the OpenAI `user` (the tenant under fair share)
    # The max_tokens the client declares; None: exactly output_len (ignore_eos). When
    # larger, the request stops by EOS after output_len tokens (the simulator emits it).
    max_tokens: int | None = None
    # The request's own objectives (ms; the API's `slo_ttft_ms` / `slo_tpot_ms`): time to
    # the first token and per output token after it. None: the server's class decides.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


def _stream(seed: int, which: int) -> np.random.Generator:
    return np.random.default_rng([seed, which])


def _assemble(
    prompts: list[tuple[list[int] | None, str | None, int]],
    output_lens: list[int],
    rate: float,
    burstiness: float,
    seed: int,
    priority_mix: PriorityMix | None,
    groups: list[int] | None = None,
) -> list[WorkloadRequest]:
    """Attach ids, arrival times and priorities to (ids, text, prompt_len) prompts."""
    n = len(prompts)
    arrivals = arrival_times(n, rate, burstiness, _stream(seed, _ARRIVALS))
    prios = priority_mix.sample(_stream(seed, _PRIORITIES), n) if priority_mix else [0] * n
    return [
        WorkloadRequest(
            request_id=f"req-{i}",
            arrival_time=arrivals[i],
            prompt_len=plen,
            output_len=output_lens[i],
            priority=prios[i],
            prompt_token_ids=ids,
            prompt_text=text,
            group=groups[i] if groups is not None else None,
        )
        for i, (ids, text, plen) in enumerate(prompts)
    ]


def synthetic(
    n: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    tokenizer: Any | None = None,
    priority_mix: PriorityMix | None = None,
) -> list[WorkloadRequest]:
    """`n` random prompts of exact token lengths (word tokens with a tokenizer, else ids)."""
    lengths = _stream(seed, _LENGTHS)
    plens, olens = prompt_len.sample(lengths, n), output_len.sample(lengths, n)
    builder, tokens = PromptBuilder(tokenizer, seed=seed), _stream(seed, _TOKENS)
    prompts = [(*builder.prompt(tokens, plen), plen) for plen in plens]
    return _assemble(prompts, olens, rate, burstiness, seed, priority_mix)


def shared_prefix(
    n: int,
    groups: int,
    prefix_len: int,
    suffix_len: LengthDist,
    output_len: LengthDist,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    tokenizer: Any | None = None,
    priority_mix: PriorityMix | None = None,
) -> list[WorkloadRequest]:
    """`n` prompts in `groups` groups; each group's prompts start with the same
    `prefix_len`-token prefix (a shared system prompt), followed by a random suffix."""
    if groups < 1 or prefix_len < 0:
        raise ValueError(
            f"shared prefix needs groups >= 1 and prefix_len >= 0, got {groups}, {prefix_len}"
        )
    lengths = _stream(seed, _LENGTHS)
    slens, olens = suffix_len.sample(lengths, n), output_len.sample(lengths, n)
    builder, tokens = PromptBuilder(tokenizer, seed=seed), _stream(seed, _TOKENS)
    prefixes = [builder.ids(tokens, prefix_len) for _ in range(groups)]
    members = [int(g) for g in _stream(seed, _ORDER).integers(0, groups, size=n)]
    prompts = [
        (*builder.prompt(tokens, slen, prefix=prefixes[g]), prefix_len + slen)
        for g, slen in zip(members, slens, strict=True)
    ]
    return _assemble(prompts, olens, rate, burstiness, seed, priority_mix, members)


def _cycle(items: list[Any], n: int | None) -> list[Any]:
    """The first `n` items, repeating the list when it is shorter (all items if n is None)."""
    if not items:
        raise ValueError("the dataset has no usable entries")
    count = len(items) if n is None else n
    return [items[i % len(items)] for i in range(count)]


def from_jsonl(
    path: str | Path,
    n: int | None = None,
    output_len: LengthDist | None = None,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    tokenizer: Any | None = None,
    priority_mix: PriorityMix | None = None,
) -> list[WorkloadRequest]:
    """Prompts from a JSONL file, one object per line, in file order (repeated to reach `n`).

    Each line has ``"prompt"`` (text) or ``"prompt_token_ids"``, and optionally
    ``"output_len"`` (or ``"max_tokens"``, default 128), ``"priority"``, ``"user"`` (the
    tenant) and the request's objectives ``"slo_ttft_ms"`` / ``"slo_tpot_ms"`` (positive
    milliseconds; absent or null: none of its own). A given `output_len` distribution
    overrides the file's lengths; a line's priority overrides the `priority_mix`.
    """
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    rows = _cycle([json.loads(ln) for ln in lines], n)
    builder = PromptBuilder(tokenizer, seed=seed)
    prompts: list[tuple[list[int] | None, str | None, int]] = []
    for row in rows:
        ids, text = row.get("prompt_token_ids"), row.get("prompt")
        if ids is None and not isinstance(text, str):
            raise ValueError(f"{path}: each line needs 'prompt' or 'prompt_token_ids'")
        plen = len(ids) if ids is not None else builder.count(text)
        prompts.append((ids, text, plen))
    if output_len is not None:
        olens = output_len.sample(_stream(seed, _LENGTHS), len(rows))
    else:
        olens = [int(r.get("output_len", r.get("max_tokens", 128))) for r in rows]
    requests = _assemble(prompts, olens, rate, burstiness, seed, priority_mix)
    for i, (req, row) in enumerate(zip(requests, rows, strict=True)):
        req.priority = int(row.get("priority", req.priority))
        if row.get("user") is not None:
            req.user = str(row["user"])
        req.slo_ttft_ms = _objective_ms(row, "slo_ttft_ms", path, i)
        req.slo_tpot_ms = _objective_ms(row, "slo_tpot_ms", path, i)
    return requests


def _objective_ms(row: dict[str, Any], key: str, path: str | Path, line: int) -> float | None:
    """A line's objective in ms (None when absent or null); a positive finite number."""
    value = row.get(key)
    if value is None:
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if isinstance(value, bool) or not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"{path}: entry {line + 1}: {key} must be a positive number of "
                         f"milliseconds, got {value!r}")
    return ms


def from_sharegpt(
    path: str | Path,
    n: int | None = None,
    output_len: LengthDist | None = None,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    tokenizer: Any | None = None,
    priority_mix: PriorityMix | None = None,
    max_prompt_len: int | None = None,
) -> list[WorkloadRequest]:
    """Conversations from a ShareGPT JSON file (a list of ``{"conversations": [...]}``).

    The first turn is the prompt, the second turn's token count the output length (unless
    `output_len` is given). Conversations are shuffled by the seed; like vLLM, those with
    under 4 prompt or output tokens are skipped, as are prompts over `max_prompt_len`.
    """
    builder = PromptBuilder(tokenizer, seed=seed)
    entries = [
        e for e in json.loads(Path(path).read_text()) if len(e.get("conversations", [])) >= 2
    ]
    order = _stream(seed, _ORDER).permutation(len(entries))
    usable: list[tuple[str, int, int]] = []
    for idx in order:
        turns = entries[int(idx)]["conversations"]
        prompt = turns[0]["value"]
        plen, olen = builder.count(prompt), builder.count(turns[1]["value"])
        if plen < 4 or olen < 4 or (max_prompt_len is not None and plen > max_prompt_len):
            continue
        usable.append((prompt, plen, olen))
        if n is not None and len(usable) >= n:
            break
    chosen = _cycle(usable, n)
    olens = [o for _, _, o in chosen]
    if output_len is not None:
        olens = output_len.sample(_stream(seed, _LENGTHS), len(chosen))
    prompts = [(None, text, plen) for text, plen, _ in chosen]
    return _assemble(prompts, olens, rate, burstiness, seed, priority_mix)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Add the workload flags (`--dataset`, `--num-prompts`, `--prompt-len`, ...)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="synthetic")
    g.add_argument("--dataset-path", default=None, help="JSONL or ShareGPT JSON file")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist.parse("256"),
                   help="N | fixed:N | uniform:LO:HI | lognormal:MEAN:SIGMA[:MAX] "
                        "(shared-prefix: the suffix length)")
    g.add_argument("--output-len", type=LengthDist.parse, default=None,
                   help="same forms; default 128 (jsonl/sharegpt: from the dataset)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix: number of prefixes")
    g.add_argument("--priority-mix", type=PriorityMix.parse, default=None,
                   help="e.g. 0:0.8,10:0.2 (priority:weight)")
    g.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)"
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--seed", type=int, default=0)


def workload_from_args(
    args: argparse.Namespace, tokenizer: Any | None = None
) -> list[WorkloadRequest]:
    """Build the workload the flags of `add_workload_args` describe."""
    common: dict[str, Any] = {
        "rate": args.request_rate, "burstiness": args.burstiness, "seed": args.seed,
        "tokenizer": tokenizer, "priority_mix": args.priority_mix,
    }
    out = args.output_len
    if args.dataset in ("jsonl", "sharegpt"):
        if not args.dataset_path:
            raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
        build = from_jsonl if args.dataset == "jsonl" else from_sharegpt
        return build(args.dataset_path, args.num_prompts, out, **common)
    out = out or LengthDist.parse("128")
    if args.dataset == "shared-prefix":
        return shared_prefix(
            args.num_prompts, args.num_groups, args.prefix_len, args.prompt_len, out, **common
        )
    return synthetic(args.num_prompts, args.prompt_len, out, **common)
