"""What routers read from a replica: GET /get_load (SGLang's shape), the gauges under vLLM's
names (the endpoint picker's and smg's), the per-request histograms, the process metrics.

In-process apps over the real scheduler and engine, no worker process. The worker is a
stand-in that answers each plan with `TOKEN` for every request it schedules, moving the
engine's clock one step (`STEP_S`) per answer, so times are exact; the test opens its gate
one answer at a time, or leaves it open. The *parked* engine's loop never runs: the test
takes its inbox and builds its plans by hand, so the queue is exactly what it put there.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from service.engine.loop import AsyncEngine
from service.engine.metrics import ServiceMetrics
from service.engine.vllm_names import DASHBOARD_ALIASES, PREFIX, ROUTER_ALIASES
from service.http.state import AppConfig, LoadedEngine, ServiceState

MODEL = "router-test"
VOCAB = 32000
TOKEN = 100  # what the stand-in worker samples, every time (no EOS: requests run to max_tokens)
STEP_S = 0.25  # one answer of the worker, on the engine's clock (exact in binary)
BLOCK = 16
CONFIG = SchedulerConfig(
    max_model_len=1024, num_gpu_blocks=100, block_size=BLOCK, max_num_batched_tokens=512,
    max_num_seqs=2, max_step_ms=0,
)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
_SUFFIXES = ("", "_total", "_info", "_bucket", "_count", "_sum")  # a family's sample names


class GatedWorker:
    """Answers each plan once its gate lets one answer through (`release`), or at once when
    `open`; each answer moves `now`, the engine's clock, by `STEP_S`."""

    def __init__(self, open: bool = False) -> None:
        self.now = 1000.0
        self.open = open
        self._plans: deque[SchedulerOutput] = deque()
        self._gate = asyncio.Semaphore(0)

    def clock(self) -> float:
        return self.now

    def release(self, answers: int = 1) -> None:
        for _ in range(answers):
            self._gate.release()

    def submit(self, plan: SchedulerOutput) -> None:
        self._plans.append(plan)

    async def get_output(self) -> ModelRunnerOutput:
        if self.open:
            await asyncio.sleep(0)
        else:
            await self._gate.acquire()
        plan = self._plans.popleft()
        self.now += STEP_S
        return ModelRunnerOutput(plan.step_id, dict.fromkeys(plan.num_scheduled_tokens, TOKEN))

    async def shutdown(self) -> None:
        pass

    @property
    def is_alive(self) -> bool:
        return True


class ParkedEngine(AsyncEngine):
    """An engine whose loop never runs: the test moves it one loop phase at a time, and
    each phase publishes the scheduler's snapshot as the loop does after a step."""

    def start(self) -> None:
        pass

    def take_inbox(self) -> None:
        """What the loop does first in each iteration: submitted requests to the scheduler."""
        self._apply_inbox()
        self._publish()

    def plan(self) -> SchedulerOutput:
        """Schedule a step (its answer never comes)."""
        plan = self.scheduler.schedule(self.clock())
        self._publish()
        return plan

    def _publish(self) -> None:
        self._stats = self.scheduler.stats()
        assert self.metrics is not None
        self.metrics.observe_stats(self._stats)


def _factory(tokenizer: Any, worker: GatedWorker, parked: bool = False,
             compat: str | None = None) -> Callable[..., Any]:
    async def build() -> LoadedEngine:
        kind = ParkedEngine if parked else AsyncEngine
        engine = kind(Scheduler(CONFIG), worker, tokenizer, metrics=ServiceMetrics(MODEL, compat=compat),
                      clock=worker.clock)
        return LoadedEngine(engine, MODEL, CONFIG.max_model_len, VOCAB)

    return build


def _engine(state: ServiceState) -> AsyncEngine:
    assert state.loaded is not None
    return state.loaded.engine


async def _load(client: TestClient) -> dict[str, Any]:
    resp = await client.get("/get_load")
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert isinstance(body, list) and len(body) == 1  # one data-parallel rank
    return body[0]


def _expect(running: int, waiting: int, tokens: int, kv: float = 0.0) -> dict[str, Any]:
    return {"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
            "num_tokens": tokens, "num_running_reqs": running, "num_swapped_reqs": 0,
            "kv_cache_usage": kv}


async def _samples(client: TestClient) -> Samples:
    text = await (await client.get("/metrics")).text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def _assert_vllm_names_equal_ours(samples: Samples, names: dict[str, tuple[str, ...]]) -> None:
    """Every sample of each family `names` renames is exported under each name, equal."""
    for ours, aliases in names.items():
        own = {(name, labels): v for (name, labels), v in samples.items()
               if name.startswith(PREFIX + ours) and name[len(PREFIX + ours):] in _SUFFIXES}
        assert own, ours
        for alias in aliases:
            renamed = {(alias + name[len(PREFIX + ours):], labels): v for (name, labels), v in own.items()}
            assert {k: samples.get(k) for k in renamed} == renamed, alias


async def _settled(engine: AsyncEngine) -> None:
    for _ in range(1000):
        if not engine.num_unfinished and not engine.scheduler.has_unfinished_requests():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the engine did not settle")


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the engine never got there")


async def test_get_load_reports_the_queue_as_the_engine_holds_it(
    make_factory_client: Callable[..., Any], tokenizer: Any
) -> None:
    prompts = (10, 20, 30, 40, 50)
    async with make_factory_client(_factory(tokenizer, GatedWorker(), parked=True)) as (client, state):
        engine = _engine(state)
        assert isinstance(engine, ParkedEngine)
        assert await _load(client) == _expect(0, 0, 0)
        streams = [engine.submit([TOKEN] * n, SamplingParams(max_tokens=4), f"r{i}")
                   for i, n in enumerate(prompts)]
        # submitted, not yet taken by the loop: waiting all the same (as the 429s count them)
        assert await _load(client) == _expect(0, 5, sum(prompts))
        engine.take_inbox()
        assert await _load(client) == _expect(0, 5, sum(prompts))
        engine.plan()  # FCFS with two seats: the first two run, their prompts in KV
        blocks = -(-prompts[0] // BLOCK) + -(-prompts[1] // BLOCK)
        kv = blocks / CONFIG.num_gpu_blocks
        assert engine.stats.kv_cache_usage == kv
        assert await _load(client) == _expect(2, 3, sum(prompts), kv)
        samples = await _samples(client)
        for name, want in (("num_requests_running", 2), ("num_requests_waiting", 3),
                           ("kv_cache_usage_perc", kv)):
            assert _value(samples, f"stepserve:{name}") == want, name
        assert _value(samples, "vllm:gpu_cache_usage_perc") == kv
        assert _value(samples, "vllm:cache_config_info", block_size=str(BLOCK),
                      num_gpu_blocks=str(CONFIG.num_gpu_blocks)) == 1
        _assert_vllm_names_equal_ours(samples, ROUTER_ALIASES)
        assert not any(name.startswith("vllm:prompt_tokens") for name, _ in samples)  # no compat
        for stream in streams[:2]:
            stream.close()  # aborted: its tokens leave at once, its seat when the loop runs
        assert (await _load(client))["num_tokens"] == sum(prompts[2:])
        for stream in streams[2:]:
            stream.close()
        assert (await _load(client))["num_tokens"] == 0


async def test_get_load_follows_a_busy_engine_token_by_token(
    make_factory_client: Callable[..., Any], tokenizer: Any
) -> None:
    worker = GatedWorker()
    prompt = 40
    async with make_factory_client(_factory(tokenizer, worker)) as (client, state):
        engine = _engine(state)
        stream = engine.submit([TOKEN] * prompt, SamplingParams(max_tokens=100), "busy")
        await _until(lambda: engine.stats.num_running == 1)  # planned; no answer yet
        load = await _load(client)
        assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["num_tokens"] == prompt and load["kv_cache_usage"] > 0
        for generated in (1, 2, 3):
            worker.release()
            delta = await anext(stream)
            assert delta.num_output_tokens == generated
            assert await _load(client) == _expect(1, 0, prompt + generated, engine.stats.kv_cache_usage)
        stream.close()  # aborted: its tokens leave at once, its seat and KV when the loop runs
        assert (await _load(client))["num_tokens"] == 0
        worker.open = True
        worker.release(10)
        await _settled(engine)
        assert await _load(client) == _expect(0, 0, 0)
        # one that runs to its end leaves nothing behind either
        async for _ in engine.submit([TOKEN] * 8, SamplingParams(max_tokens=3), "whole"):
            pass
        await _settled(engine)
        assert await _load(client) == _expect(0, 0, 0)


async def test_a_finished_request_is_counted_in_the_request_histograms(
    make_factory_client: Callable[..., Any], tokenizer: Any
) -> None:
    """One step to the first token and one per token after it: prefill = TPOT = STEP_S,
    decode = (tokens - 1) x STEP_S, and the prompt and output lengths exactly."""
    prompt, tokens = 37, 5
    factory = _factory(tokenizer, GatedWorker(open=True), compat="vllm")
    async with make_factory_client(factory) as (client, state):
        before = await _samples(client)
        resp = await client.post("/v1/completions", json={"prompt": [TOKEN] * prompt, "max_tokens": tokens})
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, tokens)
        await _settled(_engine(state))
        after = await _samples(client)

        def delta(name: str) -> float:
            return _value(after, name) - _value(before, name)

        assert delta("stepserve:request_prompt_tokens_count") == 1
        assert delta("stepserve:request_prompt_tokens_sum") == prompt
        assert delta("stepserve:request_generation_tokens_sum") == tokens
        assert _value(after, "stepserve:request_prompt_tokens_bucket", le="20.0") == 0
        assert _value(after, "stepserve:request_prompt_tokens_bucket", le="50.0") == 1
        assert _value(after, "stepserve:request_generation_tokens_bucket", le="2.0") == 0
        assert _value(after, "stepserve:request_generation_tokens_bucket", le="5.0") == 1
        assert delta("stepserve:request_prefill_time_seconds_sum") == STEP_S
        assert delta("stepserve:request_decode_time_seconds_sum") == (tokens - 1) * STEP_S
        assert delta("stepserve:request_time_per_output_token_seconds_sum") == STEP_S
        assert delta("stepserve:request_time_per_output_token_seconds_count") == 1
        # tokens per step: what the step's prefill and decode tokens add up to, every step
        assert delta("stepserve:iteration_prefill_tokens_sum") == prompt
        assert delta("stepserve:iteration_tokens_total_sum") == (
            delta("stepserve:iteration_prefill_tokens_sum") + delta("stepserve:iteration_decode_tokens_sum")
        )
        assert delta("stepserve:iteration_tokens_total_count") == delta("stepserve:iteration_num_requests_count") > 0
        _assert_vllm_names_equal_ours(after, {**ROUTER_ALIASES, **DASHBOARD_ALIASES})
        assert _value(after, "vllm:request_prompt_tokens_sum") == prompt
        # vLLM's older per-token name is our inter-token latency, not the per-request mean
        assert _value(after, "vllm:time_per_output_token_seconds_count") == _value(
            after, "stepserve:inter_token_latency_seconds_count")


def test_process_metrics_are_exported() -> None:
    samples = {s.name: s.value for family in text_string_to_metric_families(
        ServiceMetrics(MODEL).exposition().decode()) for s in family.samples}
    assert samples["process_resident_memory_bytes"] > 0
    assert "process_cpu_seconds_total" in samples and "process_open_fds" in samples
    assert "python_info" in samples and "python_gc_objects_collected_total" in samples


def test_every_vllm_name_has_its_family() -> None:
    plain, compat = ServiceMetrics(MODEL).metric_names(), ServiceMetrics(MODEL, compat="vllm").metric_names()
    for ours, aliases in ROUTER_ALIASES.items():
        assert PREFIX + ours in plain and set(aliases) <= plain, ours
    for ours, aliases in DASHBOARD_ALIASES.items():
        assert PREFIX + ours in plain and not set(aliases) & plain, ours
        assert set(aliases) <= compat, aliases
    assert "stepserve:time_per_output_token_seconds" not in compat  # renamed: it meant vLLM's ITL
    with pytest.raises(ValueError, match="compat"):
        ServiceMetrics(MODEL, compat="sglang")


@pytest.mark.parametrize("path", ["/get_load", "/metrics"])
async def test_router_paths_stay_open_under_an_api_key(
    make_factory_client: Callable[..., Any], tokenizer: Any, path: str
) -> None:
    async with make_factory_client(_factory(tokenizer, GatedWorker(open=True)), AppConfig(api_key="k")) as (client, _):
        assert (await client.get(path)).status == 200
        assert (await client.get("/v1/models")).status == 401
