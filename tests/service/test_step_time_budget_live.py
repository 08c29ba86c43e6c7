"""Live on a tiny random model: /metrics shows the step-cost model (predicted against
measured, the relative error, the target and the step's limit), and `--max-step-ms 0` keeps
prefill chunks at the token budget next to a decoding stream, where a tiny target cuts them
to one block and `--min-prefill-share` lifts the limit above it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny random Llama with the default tokenizer's vocabulary, saved as an HF dir."""
    target = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    make_tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=1024).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _metrics(server: Any) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("" if "le" not in s.labels else f"[{s.labels['le']}]")
            out[key] = s.value
    return out


async def _long_prompt_next_to_a_stream(url: str) -> None:
    """A stream decodes while a 300-token prompt prefills (budget 64 tokens a step)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = await client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=500, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
    events = aiter(stream)
    await anext(events)  # decoding now
    done = await client.completions.create(model="tiny-llama", prompt="hello " * 300, max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason == "length"
    await anext(events)  # the stream was still decoding through the whole prefill
    await stream.close()


@pytest.mark.parametrize(("max_step_ms", "share", "capped"), [("0", "0", False), ("0.001", "0", True), ("0.001", "0.9", None)])
def test_time_budget_live(tmp_path: Path, start_server: Any, tiny_model_dir: Path, max_step_ms: str, share: str,
                          capped: bool | None) -> None:
    server = start_server(tmp_path, "--model", str(tiny_model_dir), "--max-num-batched-tokens", "64",
                          "--max-step-ms", max_step_ms, "--min-prefill-share", share, "--num-threads", "1")
    asyncio.run(_long_prompt_next_to_a_stream(server.url))
    m = _metrics(server)
    target = float(max_step_ms) / 1e3
    assert m["stepserve:step_time_target_seconds"] == target
    # every executed step was predicted when planned and measured when done
    assert m["stepserve:step_time_predicted_seconds_count"] == m["stepserve:model_execute_time_seconds_count"] >= 5
    assert m["stepserve:step_time_last_predicted_seconds"] > 0 and m["stepserve:step_time_last_measured_seconds"] > 0
    assert 0 <= m["stepserve:step_time_relative_error"] < 10
    assert m["stepserve:step_cost_coefficient"] >= 0
    # prefill steps of 17..64 tokens: the budget's chunks (63 next to the decode), or none when cut
    mid_chunks = m["stepserve:iteration_prefill_tokens_bucket[64.0]"] - m["stepserve:iteration_prefill_tokens_bucket[16.0]"]
    if capped is None:
        # a 1 us target under the decode's own time: the share sets the limit, 10x the decode's
        assert m["stepserve:step_time_limit_seconds"] > 100 * target
    else:
        assert m["stepserve:step_time_limit_seconds"] == target
        if capped:
            assert m["stepserve:step_prefill_time_capped_total"] > 0 and mid_chunks == 0
        else:
            assert m["stepserve:step_prefill_time_capped_total"] == 0 and mid_chunks >= 4
    assert server.stop() == 0
