"""`stepserve bench` / `python -m loadgen.bench`: open-loop load against an OpenAI server.

Requests leave at their workload arrival times (Poisson or gamma, `--request-rate inf`
sends all at once) whether or not earlier ones have finished; `--max-concurrency` caps
how many are in flight. Prints a `vllm bench serve`-style table, and optionally writes
`--result-json` (the summary's vLLM keys at the top level, as vLLM's file has them, plus
``config``, ``summary``, ``errors`` and every per-request record) and `--plot DIR` PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from loadgen.plotting import PlotsUnavailable, require_plots
from loadgen.report import RequestRecord, error_counts, format_table, parse_goodput, summarize
from loadgen.sse_client import Target, send_request
from loadgen.tokenizer import load_tokenizer
from loadgen.workloads import WorkloadRequest, add_workload_args, workload_from_args


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


def _config(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """The run's configuration as plain JSON values."""
    config = {k: (v if isinstance(v, int | float | str | bool | list) or v is None else str(v))
              for k, v in vars(args).items()}
    config.update(model=target.model, url=target.url, ignore_eos=target.ignore_eos)
    if isinstance(config.get("request_rate"), float) and math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"
    return config


def write_result(path: str, config: dict[str, Any], summary: dict[str, Any],
                 records: list[RequestRecord]) -> None:
    """Write the result JSON: vLLM's top-level summary keys, then our sections."""
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), **summary, "config": config,
        "summary": summary, "errors": error_counts(records),
        "requests": [asdict(r) for r in records],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


async def _main_async(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    tokenizer = None if args.no_tokenizer else load_tokenizer(args.tokenizer)
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
                    api_key=args.api_key, ignore_eos=ignore_eos, temperature=args.temperature)
    if target.chat and any(r.prompt_text is None for r in requests):
        raise ValueError("the chat endpoint needs text prompts: drop --no-tokenizer")
    records, duration = await run_benchmark(
        requests, target, args.max_concurrency, not args.disable_tqdm
    )
    summary = summarize(records, duration, slos or None)
    print(format_table(summary))
    for message, count in error_counts(records).items():
        print(f"failed x{count}: {message}")
    if args.result_json:
        write_result(args.result_json, _config(args, target), summary, records)
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
