"""`--generation-config auto|vllm|PATH`, as vLLM reads it: the sampling defaults of a model's
generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens) for the requests that leave those fields unset.

auto: the model directory's file (a GGUF file has none); vllm: no file, `SamplingParams`'
defaults; PATH: a directory holding generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduler.sampling import SamplingParamsError
from service.http.protocol import GenerationDefaults

FILE_NAME = "generation_config.json"
# generation_config.json's names -> GenerationDefaults' (vLLM reads the same keys)
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(choice: str, model_path: Path) -> tuple[GenerationDefaults, str]:
    """The defaults `choice` selects for the model at `model_path`, and where they come from
    or why there are none (for the start-up log). Raises ValueError naming the file for a bad
    file or value."""
    if choice == "vllm":
        return GenerationDefaults(), "--generation-config vllm"
    if choice == "auto":
        if not model_path.is_dir():
            return GenerationDefaults(), f"a GGUF file has no {FILE_NAME}"
        directory = model_path
        if not (directory / FILE_NAME).is_file():
            return GenerationDefaults(), f"{directory} has no {FILE_NAME}"
    else:
        directory = Path(choice).expanduser()
        if not (directory / FILE_NAME).is_file():
            raise ValueError(
                f"expected auto, vllm or a directory holding {FILE_NAME}, got {choice!r}"
            )
    return read_generation_config(directory / FILE_NAME), str(directory / FILE_NAME)


def read_generation_config(path: Path) -> GenerationDefaults:
    """The sampling defaults in one generation_config.json (other keys are ignored, as vLLM
    does: do_sample, bos/eos ids, ...)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    values: dict[str, Any] = {}
    for key, name in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        integral = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
            kind = "an integer" if integral else "a number"
            raise ValueError(f"{path}: {key} must be {kind}, got {value!r}")
        values[name] = value
    try:
        return GenerationDefaults(**values)
    except SamplingParamsError as exc:
        key = next(k for k, name in _KEYS.items() if name == exc.param)
        raise ValueError(f"{path}: {key}: {exc}") from None
