"""Structured outputs' cost: 32 concurrent streams on the default model, all constrained by one
JSON schema against all unconstrained, the same prompts and output lengths, on one fresh
server, alternating the two in rounds; plus the grammar engine's own costs measured in
process (tokenizer set-up, compile cold and cached, the mask per token).

The schema never completes within the output budget (an array of at least 100 numbers), so
every constrained request runs exactly `--output-len` tokens, as the unconstrained ones do
with ignore_eos: the two differ only by the mask.

Prints JSON: per arm the `stepserve bench` summary and the server's mean step time, and
constrained / unconstrained ratios of step time and TPOT p50/p99 (medians over rounds).

    python -m bench.structured                   # ~6 min on 2 cores
    python -m bench.structured --rounds 3 --num-prompts 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.servers import cpu_info, free_port, load, running, step_histogram, stepserve_cmd

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "station": {"type": "string", "maxLength": 24},
        "readings": {"type": "array", "items": {"type": "number"}, "minItems": 100},
    },
    "required": ["station", "readings"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "readings", "schema": SCHEMA}}
KEYS = (
    "completed", "failed", "total_output_tokens", "output_throughput", "median_tpot_ms",
    "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_ttft_ms",
)


def workload(args: argparse.Namespace, constrained: bool) -> list[str]:
    flags = [
        "--endpoint", "/v1/chat/completions", "--num-prompts", str(args.num_prompts),
        "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
        "--request-rate", "inf", "--seed", "1",
    ]
    if constrained:  # ignore_eos cannot be combined with a grammar; the schema runs long
        return [*flags, "--no-ignore-eos", "--extra-body", json.dumps(
            {"response_format": RESPONSE_FORMAT})]
    return [*flags, "--ignore-eos"]


def one_arm(url: str, args: argparse.Namespace, constrained: bool, out: Path) -> dict[str, Any]:
    before = step_histogram(url)
    summary = load(url, workload(args, constrained), out, KEYS)
    after = step_histogram(url)
    steps = after[0] - before[0]
    summary["mean_step_ms"] = 1e3 * (after[1] - before[1]) / steps if steps else None
    return summary


def engine_costs() -> dict[str, Any]:
    """The grammar engine in this process: tokenizer set-up, the schema's compile cold and
    cached, and the mask per token along a valid document."""
    import numpy as np

    from common.grammar import Constraint, GrammarCompiler, tokenizer_json
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    compiler = GrammarCompiler(lambda: tokenizer_json(tokenizer.backend_tokenizer), vocab, eos)
    t0 = time.perf_counter()
    compiler.tokenizer()
    setup_ms = (time.perf_counter() - t0) * 1e3
    text = Constraint("json", SCHEMA).grammar_text()
    t0 = time.perf_counter()
    compiler.compile(text)
    cold_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    matcher = compiler.matcher(text)
    cached_ms = (time.perf_counter() - t0) * 1e3
    doc = json.dumps({"station": "north", "readings": [round(0.37 * i, 2) for i in range(120)]},
                     separators=(",", ":"))
    ids = tokenizer.encode(doc, add_special_tokens=False)
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append((time.perf_counter() - t0) * 1e3)
        assert matcher.consume_token(token), "the sample document leaves the schema"
    return {
        "tokenizer_setup_ms": round(setup_ms, 1),
        "compile_cold_ms": round(cold_ms, 2),
        "compile_cached_ms": round(cached_ms, 3),
        "mask_per_token_ms": {
            "mean": round(statistics.fmean(times), 4),
            "p50": round(statistics.median(times), 4),
            "p99": round(sorted(times)[int(0.99 * (len(times) - 1))], 4),
            "tokens": len(times),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stepserve-flags", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args(argv)
    costs = engine_costs()
    port = free_port()
    cmd = stepserve_cmd(port, args.threads, ["--max-num-seqs", str(args.num_prompts),
                                             *args.stepserve_flags])
    arms: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    with tempfile.TemporaryDirectory() as tmp, running(cmd, port) as url:
        load(url, workload(args, False), Path(tmp) / "warm.json", KEYS)  # warm-up, not counted
        for r in range(args.rounds):
            for name in ("unconstrained", "constrained"):
                out = Path(tmp) / f"{name}-{r}.json"
                arms[name].append(one_arm(url, args, name == "constrained", out))
    ratios: dict[str, float | None] = {}
    for key in ("mean_step_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput"):
        per_round = [
            c[key] / u[key] for u, c in zip(arms["unconstrained"], arms["constrained"], strict=True)
            if c.get(key) and u.get(key)
        ]
        ratios[key] = round(statistics.median(per_round), 3) if per_round else None
    print(json.dumps({
        "cpu": cpu_info(),
        "config": vars(args),
        "schema": SCHEMA,
        "grammar_engine": costs,
        "arms": arms,
        "constrained_over_unconstrained": ratios,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
