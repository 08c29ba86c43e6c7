"""The flags of `stepserve serve`, named after `vllm serve` where the concept is the same.

Defaults suit a laptop CPU: 1 GiB of KV cache, chunked prefill and prefix caching on. Each
help is a line or two; docs/cpu.md explains the CPU knobs. `service.cli.args` reads the
command line before this parser does (underscore spellings, `--config FILE.yaml`).
"""

from __future__ import annotations

import argparse
import re

from scheduler.config import OFFLINE_DEFAULTS, SchedulerConfig
from scheduler.flags import (
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    add_scheduler_args,
)
from service.cli.cpu_scheduling import DEFAULT_ENGINE_CPU_SCHEDULING, ENGINE_CPU_SCHEDULING
from service.cli.stats_log import DEFAULT_INTERVAL_S
from service.cli.version import package_version
from service.engine.vllm_names import COMPAT_MODES
from service.http.state import DEFAULT_MAX_BODY_SIZE
from service.http.tool_calls import TOOL_CALL_PARSERS
from worker.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    GGUF_ACTIVATIONS,
    GGUF_WIDE_STEPS,
    HELPER_CPU_SCHEDULING,
    KV_CACHE_DTYPES,
    LOG_LEVELS,
    QUANTIZATIONS,
)

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


def _port(value: str) -> int:
    port = NON_NEGATIVE_INT(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value!r}")
    return int(port)


def _chat_template(value: str) -> str:
    """A template file or an inline template that compiles; kept as given."""
    from common.chat_template import read_template_option

    try:
        read_template_option(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("chat_template: ")) from None
    return value


def _add_server(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 for all (default %(default)s)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and the key on /dashboard "
                   "(or set STEPSERVE_API_KEY)")
    g.add_argument("--max-waiting-requests", type=NON_NEGATIVE_INT, default=1024,
                   help="answer 429 past this many waiting requests (default %(default)s)")
    g.add_argument("--shutdown-timeout", type=NON_NEGATIVE, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them "
                   "(default %(default)g)")
    g.add_argument("--stream-stall-timeout", type=POSITIVE, default=60.0,
                   help="abort a stream whose open client has read nothing for this many "
                   "seconds, freeing its KV (default %(default)g)")
    g.add_argument("--max-body-size", type=POSITIVE_INT, default=DEFAULT_MAX_BODY_SIZE,
                   help="largest request body in bytes; larger gets 413 (default %(default)s)")
    g.add_argument("--disable-dashboard", action="store_true",
                   help="no live view: GET /dashboard and its record stream answer 404")
    g.add_argument("--enable-debug-endpoints", action="store_true",
                   help="expose GET /debug/kv (KV block accounting), for tests")
    g.add_argument("--disable-access-log", action="store_true",
                   help="no access log (one line per request: method, path, status, bytes, time)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, queues, KV-cache usage)")
    g.add_argument("--metrics-compat", choices=COMPAT_MODES, default=None,
                   help="also export /metrics' counters and histograms under vLLM's names "
                   "(for its dashboards; routers' gauges always are)")
    g.add_argument("--log-stats-interval", type=POSITIVE, default=DEFAULT_INTERVAL_S,
                   help="seconds between stats lines while there is traffic (default %(default)g)")
    _add_process(g, "the server", log_level="info")
    g.add_argument("--engine-sched-policy", dest="engine_cpu_scheduling",
                   choices=ENGINE_CPU_SCHEDULING, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # its name until 0.1


def _add_process(g: argparse._ArgumentGroup, what: str, log_level: str) -> None:
    """The flags of the process itself, the server's or the offline run's."""
    g.add_argument("--engine-cpu-scheduling", choices=ENGINE_CPU_SCHEDULING,
                   default=DEFAULT_ENGINE_CPU_SCHEDULING,
                   help=f"{what} process's CPU policy on Linux: batch (SCHED_BATCH) or normal; "
                   "docs/cpu.md (default %(default)s)")
    g.add_argument("--log-level", default=log_level, choices=LOG_LEVELS,
                   help=f"log level of {what} and its worker (default %(default)s)")
    g.add_argument("--config", metavar="FILE.yaml",
                   help="flags from a YAML file: keys are flag names, values as on the command "
                   "line; the command line wins")
    g.add_argument("--version", action="version", version=package_version())


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and device")
    g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file or Hugging Face Llama-family directory (default: the bundled "
                   "SmolLM2-135M-Instruct)")
    g.add_argument("--model", default=None, help="the model, as the positional MODEL gives it")
    g.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the model's own name)")
    g.add_argument("--chat-template", type=_chat_template, default=None,
                   help="chat template: a Jinja file or the template itself (default: the "
                   "model's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto': parse tool calls out of free output with "
                   "--tool-call-parser (named and 'required' choices need neither)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the tool-call format the model writes (hermes: <tool_call> JSON)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults of unset request fields: auto (the model dir's "
                   "generation_config.json), vllm (none) or a dir holding one")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="activation dtype, and the KV cache's (auto: float32 for a GGUF model on "
                   "the CPU, else as measured at start-up; docs/cpu.md)")
    g.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="weights on the CPU: gguf (a GGUF file's blocks), int8/int4 (lossy), none; "
                   "auto: as measured at start-up (docs/cpu.md)")
    g.add_argument("--gguf-activations", default="auto", choices=GGUF_ACTIVATIONS,
                   help="activations in the gguf products (auto: int8 where the CPU has "
                   "AVX512-VNNI or AVX2, else float32; docs/cpu.md)")
    g.add_argument("--gguf-wide-steps", default="auto", metavar="|".join((*GGUF_WIDE_STEPS, "N")),
                   help="wide gguf steps on a bf16 weight copy (auto: from the width the "
                   "probe finds faster; N: above N tokens) or blocks; docs/cpu.md")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile the forward (by default: compiled ahead of time, cached "
                   "on disk, kept where faster; docs/cpu.md)")
    g.add_argument("--compile-wait", action="store_true",
                   help="build the compiled forward before /health turns 200 (by default the "
                   "eager one serves until it is built)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="logits bitwise the same alone, batched or chunked (the per-token "
                   "attention kernel for every chunk; GGUF on CPU; docs/cpu.md)")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when available), cpu, cuda or cuda:N (default %(default)s)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: flash-attn on CUDA when importable; on the CPU the C++ paged "
                   "kernel where it builds, else torch")
    g.add_argument("--seed", type=int, default=0,
                   help="worker's base random seed (default %(default)s)")
    g.add_argument("--num-threads", type=POSITIVE_INT, default=None,
                   help="worker threads on the CPU (default: all cores; docs/cpu.md, Threads)")
    g.add_argument("--helper-cpu-scheduling", choices=HELPER_CPU_SCHEDULING, default="normal",
                   help="Linux CPU policy of the worker's helper threads: normal, idle (a machine "
                   "to itself only) or auto; docs/cpu.md")
    g.add_argument("--worker-helper-policy", dest="helper_cpu_scheduling",
                   choices=HELPER_CPU_SCHEDULING, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # its name until 0.1
    g.add_argument("--worker-runner", default="worker.execution.model_runner:ModelRunner",
                   help=argparse.SUPPRESS)


def _add_cache(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's element type (auto: float16 for a GGUF model on the C++ "
                   "CPU attention, else --dtype's; int8: CPU only; docs/cpu.md)")
    g.add_argument("--kv-cache-memory", type=_size_arg, default="1GiB",
                   help="KV cache size on the CPU, e.g. 1GiB, 512MiB (default %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + KV on CUDA (default %(default)s)")
    g.add_argument("--swap-space", type=NON_NEGATIVE, default=0.0,
                   help="GiB of host memory for swapped-out blocks (default %(default)g: off)")


def _add_offline(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("offline")
    g.add_argument("--input", "-i", metavar="FILE.jsonl",
                   help="one request per line: an OpenAI batch line (custom_id, method, url, "
                   "body) or a bare completion or chat body; - reads stdin")
    g.add_argument("--output", "-o", metavar="FILE.jsonl",
                   help="one result per line, in the input's order; - writes stdout")
    g.add_argument("--disable-progress-bar", action="store_true",
                   help="no progress bar (it shows only on a terminal anyway)")
    _add_process(g, "the offline run", log_level="warning")
    # What the engine reads of the server's flags: offline, this run is the only client.
    p.set_defaults(max_waiting_requests=None, metrics_compat=None)


def build_parser(offline: bool = False) -> argparse.ArgumentParser:
    """The `stepserve serve` argument parser, or with `offline` `stepserve generate`'s: the
    same model, cache and scheduler flags, with input and output files in place of the
    server's (abbreviated flags are not accepted: they would be ambiguous with the
    underscore spellings and config-file keys)."""
    if offline:
        p = argparse.ArgumentParser(
            prog="stepserve generate",
            usage="%(prog)s --input FILE.jsonl --output FILE.jsonl [MODEL] [options]",
            description="Offline batch inference: OpenAI request bodies in, response bodies "
            "out, in order, through the same engine as `stepserve serve` (no HTTP).",
            allow_abbrev=False,
        )
        _add_offline(p)
    else:
        p = argparse.ArgumentParser(
            prog="stepserve serve",
            usage="%(prog)s [MODEL] [options]",
            description="OpenAI-compatible LLM server with continuous batching (default "
            "model: SmolLM2-135M-Instruct on the CPU).",
            allow_abbrev=False,
        )
        _add_server(p)
    _add_model(p)
    _add_cache(p)
    add_scheduler_args(p, OFFLINE_DEFAULTS if offline else SchedulerConfig())
    return p
