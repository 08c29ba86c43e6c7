"""`stepserve bench` / `python -m loadgen.bench`: open-loop load against an OpenAI server.

Requests leave at their workload arrival times (Poisson or gamma, `--request-rate inf`
sends all at once) whether or not earlier ones have finished; `--max-concurrency` caps
how many are in flight. Prints `vllm bench serve`'s table (`--percentile-metrics` and
`--metric-percentiles` choose its latency rows, as there), and optionally writes
`--result-json` in the layout of `vllm bench serve --save-result --save-detailed` (see
`result_json`) and `--plot DIR` PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from tqdm import tqdm

from common.model_files import find_default_model
from loadgen.plotting import PlotsUnavailable, require_plots
from loadgen.report import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    RequestRecord,
    error_counts,
    format_table,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    summarize,
)
from loadgen.sse_client import Target, send_request
from loadgen.tokenizer import load_tokenizer
from loadgen.workloads import WorkloadRequest, add_workload_args, workload_from_args

T = TypeVar("T")
# The result file's top-level keys that describe the run, as vLLM writes them; every other
# flag goes under "config".
_RUN_KEYS = ("request_rate", "burstiness", "max_concurrency")


def _flag(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse `type` from a parser that raises ValueError (argparse names the flag)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `stepserve bench` flags (vLLM names where the concept is the same)."""
    p = argparse.ArgumentParser(prog="stepserve bench", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="exact output lengths (default: on for synthetic and shared-prefix)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file, HF directory or tokenizer.json (default: stepserve's default model)",
    )
    p.add_argument("--no-tokenizer", action="store_true",
                   help="send token-id prompts without loading a tokenizer (completions only)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                   help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    p.add_argument(
        "--percentile-metrics",
        type=_flag(parse_percentile_metrics),
        default=DEFAULT_PERCENTILE_METRICS,
        metavar="LIST",
        help="comma-separated metrics that get mean, median, std and percentiles, among "
        f"ttft,tpot,itl,e2el (default: {','.join(DEFAULT_PERCENTILE_METRICS)})",
    )
    p.add_argument(
        "--metric-percentiles",
        type=_flag(parse_metric_percentiles),
        default=DEFAULT_PERCENTILES,
        metavar="LIST",
        help='comma-separated percentiles of those metrics, e.g. "25,50,99" (default: 99)',
    )
    p.add_argument("--extra-body", type=_flag(_json_object), default=None, metavar="JSON",
                   help="a JSON object merged into every request's body (as vllm bench's), e.g. "
                   "'{\"response_format\": {\"type\": \"json_object\"}}'")
    p.add_argument("--result-json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--disable-tqdm", action="store_true")
    add_workload_args(p)
    return p


async def fetch_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    """The id of the first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(f"{base_url.rstrip('/')}/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        return str((await resp.json())["data"][0]["id"])


async def run_benchmark(
    requests: list[WorkloadRequest],
    target: Target,
    max_concurrency: int | None = None,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; return the records (in workload order) and
    the run's duration in seconds (first arrival to last response)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.perf_counter()

        async def one(req: WorkloadRequest) -> RequestRecord:
            delay = start + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                record = await send_request(session, target, req, start)
            else:
                async with limit:
                    record = await send_request(session, target, req, start)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


def _json_value(value: Any) -> Any:
    """A flag's value as plain JSON (infinite rates as "inf", as vLLM writes them)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, int | float | str | bool | list):
        return value
    return str(value)


def run_header(
    args: argparse.Namespace, target: Target, tokenizer_id: str | None, num_prompts: int
) -> dict[str, Any]:
    """The run's description at the top of the result file, under vLLM's key names."""
    backend = "openai-chat" if target.chat else "openai"
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "model_id": target.model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        **{key: _json_value(getattr(args, key)) for key in _RUN_KEYS},
    }


def run_config(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """stepserve's own record of the run: every flag not already at the top of the file
    (model_id, tokenizer_id and num_prompts there are what the run used), less the API key."""
    skip = {*_RUN_KEYS, "model", "tokenizer", "num_prompts", "api_key"}
    config = {k: _json_value(v) for k, v in vars(args).items() if k not in skip}
    config.update(url=target.url, ignore_eos=target.ignore_eos)
    return config


def per_request(records: list[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's per-request lists, one entry per request in workload order: a failed request
    has output length 0 and its error message; a successful one the error ""."""
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [list(r.itls) for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": ["" if r.success else (r.error or "unknown error") for r in records],
    }


def result_json(
    header: dict[str, Any],
    summary: dict[str, Any],
    records: list[RequestRecord],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The result file: vLLM's keys (run header, summary, per-request lists) first, then
    stepserve's own: `error_counts` (message -> count), `config` (the other flags) and
    `requests` (each record's timing, priority, group and user)."""
    requests = []
    for r in records:
        row = asdict(r)
        row.pop("generated_text")  # already under generated_texts
        requests.append(row)
    return {
        **header,
        **summary,
        **per_request(records),
        "error_counts": error_counts(records),
        "config": config,
        "requests": requests,
    }


def write_result(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


async def _main_async(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    tokenizer = None if args.no_tokenizer else load_tokenizer(args.tokenizer)
    tokenizer_id = None if args.no_tokenizer else (args.tokenizer or str(find_default_model()))
    requests = workload_from_args(args, tokenizer)
    model = args.model
    if model is None:
        async with aiohttp.ClientSession() as session:
            model = await fetch_model(session, args.base_url, args.api_key)
    ignore_eos = (
        args.ignore_eos
        if args.ignore_eos is not None
        else args.dataset in ("synthetic", "shared-prefix")
    )
    target = Target(url=args.base_url.rstrip("/") + args.endpoint, model=model,
                    api_key=args.api_key, ignore_eos=ignore_eos, temperature=args.temperature,
                    extra_body=args.extra_body or {})
    if target.chat and any(r.prompt_text is None for r in requests):
        raise ValueError("the chat endpoint needs text prompts: drop --no-tokenizer")
    records, duration = await run_benchmark(
        requests, target, args.max_concurrency, not args.disable_tqdm
    )
    summary = summarize(
        records, duration, slos or None, args.metric_percentiles, args.percentile_metrics
    )
    print(format_table(summary, args.max_concurrency, args.request_rate))
    for message, count in error_counts(records).items():
        print(f"failed x{count}: {message}")
    if args.result_json:
        header = run_header(args, target, tokenizer_id, len(requests))
        write_result(
            args.result_json, result_json(header, summary, records, run_config(args, target))
        )
    if args.plot:
        from loadgen.plots import write_plots

        for png in write_plots(records, duration, args.plot):
            print(f"wrote {png}")
    return 0 if summary["completed"] > 0 or not records else 1


def main(argv: list[str] | None = None) -> int:
    """Run the load generator; 0 when at least one request succeeded, 1 if all failed."""
    args = build_parser().parse_args(argv)
    try:
        if args.plot:
            require_plots()
        return asyncio.run(_main_async(args))
    except (ValueError, OSError, aiohttp.ClientError, PlotsUnavailable) as exc:
        print(f"stepserve bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
