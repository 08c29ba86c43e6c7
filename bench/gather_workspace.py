"""Decode attention with and without the gather workspace, side by side, printed as JSON.

    python -m bench.gather_workspace [--batch 128] [--context 256] [--steps 5]

Runs SmolLM2-shaped decode attention (30 layers, 9 query / 3 KV heads of 64, fp32, block
16) over a paged KV cache: each step, every layer gathers its requests' K/V blocks and
runs SDPA. `fresh` allocates each gathered K/V tensor anew (what the torch backend did
before `GatherWorkspace`); `workspace` reuses two buffers. Each variant runs in its own
fresh process (`python -m bench.gather_workspace --variant NAME ...`, which prints that
variant's step times), so both start from a cold allocator as a new server does. Reports
the median and first step times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from bench.servers import ROOT, bench_module_cmd
from scheduler.sampling import SamplingParams
from worker.attention.torch_backend import TorchAttention, gather_blocks
from worker.execution.input_batch import InputBatch, RequestState

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def run_variant(variant: str, batch: int, context: int, steps: int, threads: int) -> list[float]:
    """Seconds of each decode step (all layers) for one variant, in this process."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    blocks_per_req = -(-(context + 1) // BLOCK)
    num_blocks = batch * blocks_per_req
    caches = [
        torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).unbind(0) for _ in range(LAYERS)
    ]
    inputs = InputBatch(
        max_model_len=context + 1, block_size=BLOCK, device=torch.device("cpu"), rows=batch
    )
    scheduled = []
    for i in range(batch):
        state = RequestState(
            f"r{i}", [1] * (context + 1), SamplingParams(), None, num_computed_tokens=context
        )
        inputs.add(state)
        inputs.set_blocks(state, list(range(i * blocks_per_req, (i + 1) * blocks_per_req)))
        scheduled.append((state, 1))
    meta = inputs.attention_metadata(inputs.prepare(scheduled))
    attention = TorchAttention()
    attention.set_cache(caches)
    attention.bind(meta)
    if variant == "fresh":
        attention.workspace.gather = (  # type: ignore[method-assign]
            lambda cache, ids, which: gather_blocks(cache, ids)
        )
    q = torch.randn(batch, Q_HEADS, HEAD_DIM)
    k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for layer in range(LAYERS):
            attention.forward(q, k, v, layer)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", choices=["fresh", "workspace"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:  # the child: one variant, its step times as JSON
        print(
            json.dumps(
                run_variant(args.variant, args.batch, args.context, args.steps, args.threads)
            )
        )
        return 0
    results = {}
    for variant in ("fresh", "workspace"):
        out = subprocess.run(
            bench_module_cmd(
                "gather_workspace", "--variant", variant, "--batch", str(args.batch), "--context",
                str(args.context), "--steps", str(args.steps), "--threads", str(args.threads),
            ),
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        times = json.loads(out.stdout)
        results[variant] = {"first_step_ms": round(times[0] * 1e3, 2),
                            "median_step_ms": round(sorted(times)[len(times) // 2] * 1e3, 2)}
    print(
        json.dumps(
            {
                "benchmark": "gather_workspace",
                "batch": args.batch,
                "context": args.context,
                "layers": LAYERS,
                "threads": args.threads,
                "results": results,
                "median_ratio_fresh_over_workspace": round(
                    results["fresh"]["median_step_ms"] / results["workspace"]["median_step_ms"], 3
                ),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
