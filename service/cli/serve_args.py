"""The flags of `stepserve serve`, named after `vllm serve` where the concept is the same.

Defaults suit a laptop CPU: 1 GiB of KV cache, chunked prefill and prefix caching on.
"""

from __future__ import annotations

import argparse
import re

from scheduler.flags import POSITIVE, add_scheduler_args
from service.cli.cpu_scheduling import DEFAULT_ENGINE_CPU_SCHEDULING, ENGINE_CPU_SCHEDULING
from service.http.state import DEFAULT_MAX_BODY_SIZE
from worker.config import HELPER_CPU_SCHEDULING

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1 << 30, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def kv_cache_bytes(value: str) -> int:
    """'1GiB', '512MiB', '2G' or a plain number of GiB -> bytes."""
    match = _SIZE.match(value)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (examples: 1GiB, 512MiB, 0.5)")
    unit = (match.group(2) or "").lower()[:1]
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {value!r}")
    return size


def _size_arg(value: str) -> str:
    kv_cache_bytes(value)  # validate early; the string is kept for the help's sake
    return value


def _add_server(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (0.0.0.0 for all; default %(default)s)",
    )
    g.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and the key on /dashboard (or set STEPSERVE_API_KEY)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 429 with Retry-After past this many waiting requests (default %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before aborting them (default %(default)s)",
    )
    g.add_argument(
        "--stream-stall-timeout",
        type=POSITIVE,
        default=60.0,
        help="abort a streaming request whose client has read nothing for this many seconds while its "
        "socket stays open (the server's write buffer stays full), freeing its KV (default %(default)s)",
    )
    g.add_argument(
        "--max-body-size",
        type=int,
        default=DEFAULT_MAX_BODY_SIZE,
        help="largest request body in bytes; larger gets 413 (default %(default)s)",
    )
    g.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="no live view: GET /dashboard and its record stream answer 404",
    )
    g.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="expose GET /debug/kv (KV block accounting), for tests",
    )
    g.add_argument(
        "--engine-cpu-scheduling",
        choices=ENGINE_CPU_SCHEDULING,
        default=DEFAULT_ENGINE_CPU_SCHEDULING,
        help="CPU scheduling policy of the server process (Linux): 'batch' (SCHED_BATCH: its threads do "
        "not preempt the worker's compute threads when an output wakes them; measured faster per "
        "token, README: Threads) or 'normal' (SCHED_OTHER). The worker process always runs "
        "SCHED_OTHER. (default %(default)s)",
    )
    g.add_argument(
        "--engine-sched-policy",
        dest="engine_cpu_scheduling",
        choices=ENGINE_CPU_SCHEDULING,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )  # its name until 0.1
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default %(default)s)",
    )


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and device")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face Llama-family directory (default: the bundled SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name in the API (default: the model's own name)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activation dtype, and the KV cache's unless --kv-cache-dtype says otherwise (auto: bfloat16 on CUDA; on CPU float32 for a GGUF model, whose "
        "bfloat16 forms fail the accuracy gate, else bfloat16 only where a start-up probe measures "
        "its matmuls faster than float32's)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "int8", "int4"],
        help="weight form on CPU. gguf: a GGUF file's Q4_0/Q4_1/Q8_0 blocks, through stepserve's C++ "
        "kernels (the same weights as dequantizing; activations: see --gguf-activations); "
        "int8/int4: torch's weight-only kernels, bfloat16 activations (any model; lossy); none: "
        "dense. auto: gguf for a GGUF file where the probe measures it faster than dense float32",
    )
    g.add_argument(
        "--gguf-activations",
        default="auto",
        choices=["auto", "int8", "float32"],
        help="activations in the gguf products. int8: each block of 32 quantized to two int8 levels "
        "(~15 bits of the block's range; llama.cpp keeps 8), integer dot products over the blocks "
        "re-laid in tiles at load, 2-4x faster products (bench/RESULTS.md), outputs within ~5e-5 "
        "of their scale; float32: the blocks as stored times float32 activations. auto "
        "(default): int8 where the CPU has AVX512-VNNI, else float32",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eagerly (no torch.compile); by default the forward is compiled at start-up "
        "where a C++ compiler is found and kept where it measures faster",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bitwise batch invariance: a request's logits are the same alone, batched, chunked, "
        "preempted or swapped (every attention through the C++ kernel; long prefills ~20%% "
        "slower). Needs quantization gguf and the C++ CPU attention; both gguf products are "
        "batch-invariant by themselves. Without it greedy outputs agree in practice but logits "
        "may differ in the last bits once a chunk exceeds 16 tokens (SDPA blocks by size); the "
        "reference mode (--dtype float32 --quantization none --enforce-eager, equal to "
        "transformers) is not bitwise invariant either (dense BLAS blocks by batch size)",
    )
    g.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:N]")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "flash_attn"],
        help="attention kernels (auto: flash-attn on CUDA when importable; on CPU the C++ paged kernel "
        "built at first start-up where a compiler is found, else the portable torch path)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="worker's base random seed (default %(default)s)"
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="worker threads on CPU (default: see README, Threads)",
    )
    g.add_argument(
        "--helper-cpu-scheduling",
        choices=HELPER_CPU_SCHEDULING,
        default="normal",
        help="scheduling policy of the worker's intra-op helper threads (Linux). idle: SCHED_IDLE, so the "
        "engine woken by an output runs on a helper's core at once instead of at the next kernel tick "
        "(smoother one-stream token gaps); only on a machine the server has to itself, since a busy "
        "neighbour starves an idle-policy helper and every step waits for it. auto: idle, put back "
        "to normal within ~10 ms whenever a helper is starved, for a hold that grows while it recurs "
        "(README, Threads)",
    )
    g.add_argument(
        "--worker-helper-policy",
        dest="helper_cpu_scheduling",
        choices=HELPER_CPU_SCHEDULING,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )  # its name until 0.1
    g.add_argument(
        "--worker-runner",
        default="worker.execution.model_runner:ModelRunner",
        help=argparse.SUPPRESS,
    )


def _add_cache(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the KV cache's element type (vLLM's flag; llama.cpp: --cache-type-k/-v). auto: float16 "
        "where the C++ CPU attention serves a GGUF model (half the bytes a long decode reads, "
        "twice the tokens in --kv-cache-memory; within the accuracy gate, bench/RESULTS.md), "
        "else the model's dtype (the reference mode stays float32). On CUDA: the model's dtype only",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=_size_arg,
        default="1GiB",
        help="KV cache size on CPU, e.g. 1GiB, 512MiB (default %(default)s)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights + KV on CUDA (default %(default)s)",
    )
    g.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of host memory for swapped-out blocks (default %(default)s: swap off)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `stepserve serve` argument parser."""
    p = argparse.ArgumentParser(
        prog="stepserve serve",
        description="OpenAI-compatible LLM server with continuous batching (default model: SmolLM2-135M-Instruct on the CPU).",
    )
    _add_server(p)
    _add_model(p)
    _add_cache(p)
    add_scheduler_args(p)
    return p
