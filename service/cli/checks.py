"""The checks of `stepserve serve`'s flags that run before the port is bound, without torch:
the scheduler's config, the worker's (built here from the flags: `worker_config`), the model
path and the generation config; argparse itself checks each value's type and range, and the
chat template. Each failure is a `FlagError` that names its flag; the server prints it as
argparse does and exits 2. What only the worker can check (`--device cuda` without CUDA, a
model's own limits) it reports at start-up, named the same way (`worker_flag_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from common.model_files import ModelLoadError, resolve_model_path
from scheduler import flags as scheduler_flags
from scheduler.config import token_budget
from service.cli.generation_config import load_generation_defaults
from service.cli.serve_args import kv_cache_bytes
from service.http.protocol import GenerationDefaults
from worker.config import WorkerConfig, WorkerConfigError

_FLAG = re.compile(r"--[a-z][a-z0-9-]*")
_FIELDS = [f.name for f in dataclasses.fields(WorkerConfig)]
# A field name in a worker message reads as its flag: always when it has an underscore, a
# one-word name (dtype, device, ...) only as `name=value`, since it is a word in prose too.
_FIELD_IN_TEXT = re.compile(
    r"\b("
    + "|".join(sorted((n for n in _FIELDS if "_" in n), key=len, reverse=True))
    + r")\b|\b("
    + "|".join(n for n in _FIELDS if "_" not in n)
    + r")(?==)"
)


class FlagError(Exception):
    """A flag value or combination the server refuses; reads `argument --flag: why`."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class CheckedFlags:
    """What the checks resolved on the way, for the server to use."""

    worker: WorkerConfig
    model_path: Path
    generation_defaults: GenerationDefaults
    generation_source: str  # where the defaults come from, for the start-up log


def check_serve_flags(args: argparse.Namespace) -> CheckedFlags:
    """Every check that can run before the port is bound; raises FlagError."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise FlagError("--enable-auto-tool-choice", "needs --tool-call-parser")
    check_scheduler_flags(args)
    worker = check_worker_flags(args)
    path = check_model(worker)
    try:
        defaults, source = load_generation_defaults(args.generation_config, path)
    except ValueError as exc:
        raise FlagError("--generation-config", str(exc)) from None
    return CheckedFlags(worker, path, defaults, source)


def check_scheduler_flags(args: argparse.Namespace) -> None:
    """The combinations `SchedulerConfig` refuses whatever the model (the KV pool's size and
    the model's length are only known once the worker is up)."""
    try:
        scheduler_flags.from_args(args, max_model_len=args.max_model_len or 1,
                                  num_cpu_blocks=1 if args.swap_space > 0 else 0)
    except ValueError as exc:
        text = scheduler_flags.flag_error(exc)
        match = _FLAG.search(text)
        flag = match.group(0) if match else "--max-num-batched-tokens"
        raise FlagError(flag, _without_leading(text, flag)) from None


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker's settings from the flags (raises WorkerConfigError)."""
    a = vars(args)
    return WorkerConfig(
        model=a["model"],
        dtype=a["dtype"],
        quantization=a["quantization"],
        gguf_activations=a["gguf_activations"],
        gguf_wide_steps=a["gguf_wide_steps"],
        enforce_eager=a["enforce_eager"],
        compile_wait=a["compile_wait"],
        batch_invariant=a["batch_invariant"],
        device=a["device"],
        block_size=a["block_size"],
        kv_cache_dtype=a["kv_cache_dtype"],
        max_model_len=a["max_model_len"],
        # sizes the CUDA profiling forward, which is capped at the model's length anyway
        max_num_batched_tokens=token_budget(
            a["max_num_batched_tokens"], a["enable_chunked_prefill"], a["max_model_len"] or 1 << 31,
            a["default_token_budget"],
        ),
        kv_cache_memory=kv_cache_bytes(a["kv_cache_memory"]),
        gpu_memory_utilization=a["gpu_memory_utilization"],
        swap_space=a["swap_space"],
        attention_backend=a["attention_backend"],
        seed=a["seed"],
        num_threads=a["num_threads"],
        helper_cpu_scheduling=a["helper_cpu_scheduling"],
        log_level=a["log_level"],
    )


def check_worker_flags(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config of these flags, as `WorkerConfig` checks it."""
    try:
        return worker_config(args)
    except WorkerConfigError as exc:
        raise worker_flag_error(exc.field, str(exc)) from None


def check_model(worker: WorkerConfig) -> Path:
    """The model's path: it exists, and it is what the flags need (a GGUF file for gguf)."""
    try:
        path = resolve_model_path(worker.model)
        worker.check_model_path(path)
    except WorkerConfigError as exc:
        raise worker_flag_error(exc.field, str(exc)) from None
    except (ModelLoadError, FileNotFoundError) as exc:
        raise FlagError("--model", str(exc)) from None
    return path


def worker_flag_error(field: str, message: str) -> FlagError:
    """A worker's refusal of `field` with its field names spelled as flags."""
    flag = "--" + field.replace("_", "-")
    message = message.removeprefix(field + " ")  # "x must be ..." under "argument --x:"
    text = _FIELD_IN_TEXT.sub(lambda m: "--" + m.group(0).replace("_", "-"), message)
    return FlagError(flag, text)


def _without_leading(text: str, flag: str) -> str:
    """'--x must be ...' under 'argument --x:' reads 'must be ...'."""
    return text[len(flag) + 1 :] if text.startswith(flag + " ") else text
