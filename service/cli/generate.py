"""`stepserve generate`: offline batch inference from a JSON Lines file of OpenAI requests to
one of responses, in order, through the server's engine without HTTP (`service.offline`).

Exit 0 when every line was answered (refused lines included: their errors are in the
output, as in OpenAI's Batch API), 2 for a flag refused, 1 when the input cannot be read or
the engine fails.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

import orjson

from service.cli.serve import print_flag_error, read_flags
from service.cli.serve_args import build_parser
from service.http.app import StartupRefused
from service.offline import Answer, BatchItem, OfflineEngine, read_line, result_line

PROG = "stepserve generate"


def read_items(path: str) -> list[BatchItem]:
    """The file's requests (blank lines skipped); `-` reads stdin."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [read_line(line) for line in text.splitlines() if line.strip()]


def write_results(path: str, lines: list[bytes]) -> None:
    """All result lines at once (a file is written whole, beside it first, then renamed, so
    a run that fails leaves no half-written output); `-` writes stdout."""
    data = b"".join(line + b"\n" for line in lines)
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(data)
    partial.replace(target)


def summary(answers: list[Answer], seconds: float) -> str:
    """One line: requests answered and refused (by status), tokens and their rate."""
    ok = [a for a in answers if a.status == 200]
    failed = Counter(a.status for a in answers if a.status != 200)
    prompt = sum(a.body["usage"]["prompt_tokens"] for a in ok)
    completion = sum(a.body["usage"]["completion_tokens"] for a in ok)
    refused = ", ".join(f"{n} x {status}" for status, n in sorted(failed.items()))
    return (
        f"{PROG}: {len(answers)} requests, {len(ok)} answered"
        + (f", {sum(failed.values())} failed ({refused})" if failed else "")
        + f"; {prompt} prompt + {completion} completion tokens in {seconds:.1f} s "
        f"({completion / seconds if seconds > 0 else 0.0:.1f} completion tokens/s)"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `stepserve generate` (exit status as the module says)."""
    parser = build_parser(offline=True)
    args, checked = read_flags(parser, argv)
    if args.input is None or args.output is None:
        parser.error("--input and --output are required")
    if checked is None:
        return 2
    try:
        items = read_items(args.input)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{PROG}: cannot read {args.input}: {exc}", file=sys.stderr)
        return 1
    engine = OfflineEngine(args, checked)
    try:
        answers, seconds = asyncio.run(_run(engine, items, not args.disable_progress_bar))
    except StartupRefused:
        assert engine.refusal.error is not None
        print_flag_error(engine.refusal.error, prog=PROG)
        return 2
    write_results(
        args.output, [orjson.dumps(result_line(i, a)) for i, a in zip(items, answers, strict=True)]
    )
    print(summary(answers, seconds), file=sys.stderr)
    if engine.failed is not None:
        print(f"{PROG}: the engine failed: {engine.failed}", file=sys.stderr)
        return 1
    return 0


async def _run(
    engine: OfflineEngine, items: list[BatchItem], progress: bool
) -> tuple[list[Answer], float]:
    try:
        await engine.start()
        start = time.perf_counter()
        answers = await engine.run(items, progress)
        return answers, time.perf_counter() - start
    finally:
        await engine.close()
