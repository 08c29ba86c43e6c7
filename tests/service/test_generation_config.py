"""`--generation-config auto|vllm|DIR`: the model's generation_config.json sets the sampling
defaults (and max_new_tokens the default max_tokens) of requests that leave them unset, as
vLLM reads it; a request's own value wins; a bad file is refused before the port is bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.model_files import find_default_model
from scheduler.sampling import SamplingParams
from service.cli.generation_config import load_generation_defaults, read_generation_config
from service.cli.serve import main as serve_main
from service.http.app import create_app
from service.http.chat_protocol import ChatCompletionRequest
from service.http.protocol import CompletionRequest, GenerationDefaults, resolve_max_tokens
from service.http.state import STATE, AppConfig

HF_STYLE = {  # as a Hugging Face model directory ships it, with keys vLLM does not read
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 12,
    "transformers_version": "4.46.0",
}


def model_dir(parent: Path, generation: dict[str, Any] | None = HF_STYLE) -> Path:
    """An HF-style model directory (config.json, and the generation config when given)."""
    directory = parent / "model"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}")
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def test_the_file_s_sampling_keys_become_defaults(tmp_path: Path) -> None:
    defaults = read_generation_config(model_dir(tmp_path) / "generation_config.json")
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20,
                                          repetition_penalty=1.05, max_tokens=12)
    assert defaults.describe() == (
        "temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, max_tokens=12")


def test_auto_vllm_and_a_directory(tmp_path: Path) -> None:
    directory = model_dir(tmp_path)
    auto, source = load_generation_defaults("auto", directory)
    assert auto.temperature == 0.6 and source == str(directory / "generation_config.json")
    assert load_generation_defaults("vllm", directory)[0] == GenerationDefaults()
    gguf_defaults, why = load_generation_defaults("auto", find_default_model())
    assert gguf_defaults == GenerationDefaults() and "GGUF" in why
    bare = model_dir(tmp_path / "bare", generation=None)
    assert load_generation_defaults("auto", bare) == (
        GenerationDefaults(), f"{bare} has no generation_config.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2}')
    assert load_generation_defaults(str(other), find_default_model())[0] == GenerationDefaults(
        temperature=0.2)
    with pytest.raises(ValueError, match="a directory holding generation_config.json"):
        load_generation_defaults(str(tmp_path / "nowhere"), directory)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"temperature": "hot"}', "temperature must be a number, got 'hot'"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"max_new_tokens": true}', "max_new_tokens must be an integer"),
        ('{"top_p": 1.5}', "top_p: top_p must be in (0, 1]"),
        ('{"max_new_tokens": 0}', "max_new_tokens: max_tokens must be at least 1"),
        ("[1]", "expected a JSON object"),
        ("{", "cannot read it"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_and_key(
    tmp_path: Path, content: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError) as exc:
        read_generation_config(tmp_path / "generation_config.json")
    assert words in str(exc.value) and "generation_config.json" in str(exc.value)
    assert serve_main(["--generation-config", str(tmp_path)]) == 2
    assert "stepserve serve: error: argument --generation-config: " in capsys.readouterr().err


def test_defaults_fill_only_what_the_request_leaves_unset() -> None:
    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                  repetition_penalty=1.1, max_tokens=12)
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.0, "top_k": -1})
    params = req.sampling_params(5, defaults)
    assert (params.temperature, params.top_k) == (0.0, -1)  # the request's own
    assert (params.top_p, params.min_p, params.repetition_penalty) == (0.9, 0.05, 1.1)
    plain = req.sampling_params(5)  # no defaults: SamplingParams' own
    assert (plain.top_p, plain.repetition_penalty) == (SamplingParams().top_p, 1.0)
    # max_tokens: the default caps what the context leaves; an explicit value is the request's
    assert resolve_max_tokens(req, 10, 100, defaults.max_tokens) == 12
    assert resolve_max_tokens(req, 95, 100, defaults.max_tokens) == 5
    assert resolve_max_tokens(req, 10, 100) == 16  # completions: OpenAI's default
    asked = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40})
    assert resolve_max_tokens(asked, 10, 100, defaults.max_tokens) == 40


async def test_the_server_applies_its_defaults_to_requests(
    engine_factory: Any, tmp_path: Path
) -> None:
    defaults, _ = load_generation_defaults("auto", model_dir(tmp_path))
    app = create_app(AppConfig(), engine_factory(), defaults)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        state = app[STATE]
        await asyncio.wait_for(state.ready.wait(), 60)
        engine = state.loaded.engine
        seen: list[SamplingParams] = []
        submit = engine.submit

        def record(ids: Any, params: SamplingParams, *args: Any, **kwargs: Any) -> Any:
            seen.append(params)
            return submit(ids, params, *args, **kwargs)

        engine.submit = record
        resp = await client.post("/v1/completions", json={"prompt": "Hello", "ignore_eos": True})
        assert (await resp.json())["usage"]["completion_tokens"] == 12  # max_new_tokens
        resp = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.0,
            "max_tokens": 3, "ignore_eos": True})
        assert (await resp.json())["usage"]["completion_tokens"] == 3
        first, second = seen
        assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty) == (
            0.6, 0.9, 20, 1.05)
        assert (second.temperature, second.top_p) == (0.0, 0.9)
    finally:
        await client.close()
