"""Objectives on requests through the HTTP app: the fields `slo_ttft_ms` / `slo_tpot_ms`
and the gateway headers `x-slo-ttft-ms` / `x-slo-tpot-ms` (the field wins), a 400 naming
the field or header for a value that is not a positive number of milliseconds; the honest
429s, `--reject-unmeetable` and the waiting limit, whose `Retry-After` is the predicted
wait; and the goodput metrics judged when a request ends.

Two in-process apps over the real scheduler and engine, no worker process:

- the *ticking* app: a fake worker answers each plan at once and moves the engine's clock
  one step (`STEP_S`) per answer, so a request's first token comes one step after it
  arrives and each later token one step after the one before: TTFT = TPOT = `STEP_S`, by
  construction. It runs the slo policy with a step cost of `STEP_S` a step, so every
  request also gets a first-token forecast;
- the *parked* app: its engine loop never runs, and the test fills the scheduler's queue
  itself, so the forecast's inputs are known and its wait is worked out by hand below.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.slo import SLO, SLOClasses
from scheduler.step_cost import BatchShape
from service.engine.loop import AsyncEngine
from service.engine.metrics import ServiceMetrics
from service.http.state import LoadedEngine, ServiceState

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the module's apps live on one loop

MODEL = "slo-test"
VOCAB = 32000
TOKEN = 100  # what the fake worker samples, every time
PROMPT = [TOKEN] * 8
STEP_S = 0.25  # the ticking app's step, exact in binary
BUDGET = 512  # max_num_batched_tokens of both apps
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
App = tuple[TestClient, ServiceState]


class FakeWorker:
    """Answers each plan with `TOKEN` for every request it schedules (the scheduler keeps
    those that sample), advancing `now`, the engine's clock, by one step per answer."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._plans: deque[SchedulerOutput] = deque()

    def clock(self) -> float:
        return self.now

    def submit(self, plan: SchedulerOutput) -> None:
        self._plans.append(plan)

    async def get_output(self) -> ModelRunnerOutput:
        plan = self._plans.popleft()
        # the step's time passes as the loop asks, before anyone else runs: a request that
        # arrives while the loop waits here arrives after it
        self.now += STEP_S
        await asyncio.sleep(0.001)  # real time: lets readers act (abort) mid-request
        return ModelRunnerOutput(plan.step_id, dict.fromkeys(plan.num_scheduled_tokens, TOKEN))

    async def shutdown(self) -> None:
        pass

    @property
    def is_alive(self) -> bool:
        return True


class RecordingScheduler(Scheduler):
    """The real scheduler, keeping each request it was given and the objectives it came with."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.added: list[tuple[SLO, Request]] = []

    def add_request(self, request: Request) -> None:
        given = request.slo
        super().add_request(request)
        self.added.append((given, request))


class ParkedEngine(AsyncEngine):
    """An engine whose loop never runs: its queue stays as the test fills it."""

    def start(self) -> None:
        pass

    def queue(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._stats = self.scheduler.stats()  # what the waiting limit reads


def _constant_step(shape: BatchShape) -> float:
    return STEP_S


def _ms_step(shape: BatchShape) -> float:
    """The parked app's step cost: 10 ms a step plus 1 ms a token."""
    return 0.010 + 0.001 * shape.num_tokens


TICKING = SchedulerConfig(
    max_model_len=2048, num_gpu_blocks=512, max_num_batched_tokens=BUDGET,
    scheduling_policy="slo", max_step_ms=0, step_cost=_constant_step,
    slo_classes=SLOClasses(classes=(("user:batch", SLO(ttft_s=10.0, cls="user:batch")),)),
)
PARKED = SchedulerConfig(
    max_model_len=1024, num_gpu_blocks=1000, max_num_batched_tokens=BUDGET, max_num_seqs=64,
    max_step_ms=0, reject_unmeetable=True, step_cost=_ms_step,
)
QUEUED, QUEUED_LEN = 8, 512  # the parked app's queue: 8 waiting requests of 512 tokens


def _factory(tokenizer: Any, config: SchedulerConfig, parked: bool) -> Callable[..., Any]:
    async def build() -> LoadedEngine:
        worker = FakeWorker()
        if parked:  # the real clock: the forecast's `now`
            engine = ParkedEngine(RecordingScheduler(config), worker, tokenizer, metrics=ServiceMetrics(MODEL))
        else:
            engine = AsyncEngine(RecordingScheduler(config), worker, tokenizer, metrics=ServiceMetrics(MODEL),
                                 clock=worker.clock)
        return LoadedEngine(engine, MODEL, config.max_model_len, VOCAB)

    return build


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ticking(make_factory_client: Callable[..., Any], tokenizer: Any) -> AsyncIterator[App]:
    async with make_factory_client(_factory(tokenizer, TICKING, parked=False)) as pair:
        yield pair


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def parked(make_factory_client: Callable[..., Any], tokenizer: Any) -> AsyncIterator[App]:
    async with make_factory_client(_factory(tokenizer, PARKED, parked=True)) as (client, state):
        engine = _engine(state)
        assert isinstance(engine, ParkedEngine)
        for i in range(QUEUED):
            engine.queue(Request(f"queued-{i}", [TOKEN] * QUEUED_LEN, SamplingParams(max_tokens=16),
                                 engine.clock()))
        yield client, state


def _engine(state: ServiceState) -> AsyncEngine:
    assert state.loaded is not None
    return state.loaded.engine


def _scheduler(state: ServiceState) -> RecordingScheduler:
    sched = _engine(state).scheduler
    assert isinstance(sched, RecordingScheduler)
    return sched


async def _ok(client: TestClient, path: str, headers: dict[str, str] | None = None,
              **body: Any) -> dict[str, Any]:
    resp = await client.post(path, json={"max_tokens": 2, **body}, headers=headers or {})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _settled(state: ServiceState) -> None:
    engine = _engine(state)
    for _ in range(500):
        if not engine.num_unfinished and not engine.scheduler.has_unfinished_requests():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine did not settle")


# -- the fields and headers ---------------------------------------------------------------


async def test_fields_and_headers_reach_the_request(ticking: App) -> None:
    client, state = ticking
    sched = _scheduler(state)
    cases: list[tuple[dict[str, Any], dict[str, str], SLO]] = [
        ({"slo_ttft_ms": 300, "slo_tpot_ms": 40.5}, {}, SLO(0.3, 0.0405)),
        ({}, {"x-slo-ttft-ms": "250", "X-SLO-TPOT-MS": "1.5e2"}, SLO(0.25, 0.15)),
        # the field wins over the header for the same objective; the other header still counts
        ({"slo_ttft_ms": 300}, {"x-slo-ttft-ms": "50", "x-slo-tpot-ms": "200"}, SLO(0.3, 0.2)),
        ({"slo_ttft_ms": None}, {"x-slo-ttft-ms": "75"}, SLO(0.075)),  # null: unset
        ({"slo_tpot_ms": 20}, {}, SLO(None, 0.02)),
    ]
    for path in (COMPLETIONS, CHAT):
        prompt: dict[str, Any] = (
            {"prompt": PROMPT} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
        )
        for body, headers, want in cases:
            await _ok(client, path, headers, **prompt, **body)
            given, req = sched.added[-1]
            assert given == want, (path, body, headers)
            assert req.slo == SLO(want.ttft_s, want.tpot_s, "request")  # resolved: its own class
    await _ok(client, COMPLETIONS, prompt=PROMPT)
    assert sched.added[-1][0] == SLO() and sched.added[-1][1].slo == SLO()  # none: the default's
    await _ok(client, COMPLETIONS, prompt=PROMPT, user="batch")
    assert sched.added[-1][1].slo == SLO(10.0, None, "user:batch")  # its tenant's class
    await _ok(client, COMPLETIONS, {"x-slo-tpot-ms": "30"}, prompt=[PROMPT, PROMPT[:4]], n=3)
    siblings = sched.added[-6:]
    assert len({r.request_id for _, r in siblings}) == 6
    assert all(given == SLO(None, 0.03) for given, _ in siblings)


INVALID_FIELDS: list[Any] = [0, -5, 0.0, "300", "inf", True, [300], {"ms": 1}, 5e-324]
INVALID_HEADERS = ["0", "-1", "abc", "inf", "nan", "", "1e999", "1_000", "0x10", "300ms"]


async def test_invalid_objectives_are_400s_naming_the_field(ticking: App) -> None:
    client, state = ticking
    sched, engine = _scheduler(state), _engine(state)
    before = len(sched.added)

    async def refused(param: str, path: str = COMPLETIONS, **kwargs: Any) -> None:
        resp = await client.post(path, **kwargs)
        assert resp.status == 400, (kwargs, await resp.text())
        err = (await resp.json())["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (kwargs, err)
        assert param in err["message"], err

    prompt = {"prompt": PROMPT}
    for field in ("slo_ttft_ms", "slo_tpot_ms"):
        for value in INVALID_FIELDS:
            await refused(field, json={**prompt, field: value})
        await refused(field, CHAT, json={"messages": [{"role": "user", "content": "hi"}], field: -1})
        for raw in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):  # Python's json writes these
            body = orjson.dumps(prompt)[:-1] + b', "' + field.encode() + b'": ' + raw + b"}"
            await refused(field, data=body, headers={"Content-Type": "application/json"})
    for header in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
        for value in INVALID_HEADERS:
            await refused(header, json=prompt, headers={header: value})
    # a valid field does not excuse a bad header for the other objective
    await refused("x-slo-tpot-ms", json={**prompt, "slo_ttft_ms": 100}, headers={"x-slo-tpot-ms": "0"})
    assert len(sched.added) == before  # nothing reached the scheduler
    assert engine.num_unfinished == 0 and not sched.has_unfinished_requests()
    await _ok(client, COMPLETIONS, {"x-slo-ttft-ms": "oops"}, prompt=PROMPT, slo_ttft_ms=10)  # the field wins


async def test_the_openai_client_sends_them(ticking: App) -> None:
    client, state = ticking
    sched = _scheduler(state)
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                 extra_body={"slo_ttft_ms": 300}, extra_headers={"x-slo-tpot-ms": "200"})
    assert sched.added[-1][0] == SLO(0.3, 0.2)
    await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      extra_body={"slo_tpot_ms": 50})
    assert sched.added[-1][0] == SLO(None, 0.05)
    with pytest.raises(openai.BadRequestError) as bad:
        await api.completions.create(model=MODEL, prompt=PROMPT, extra_body={"slo_ttft_ms": -1})
    assert bad.value.param == "slo_ttft_ms"
    await api.close()


# -- goodput ------------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _metrics(client: TestClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return _samples(await (await client.get("/metrics")).text())


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset({"model_name": MODEL, **labels}.items())


def _slo(cls: str, objective: str, outcome: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return _key("stepserve:slo_requests_total", **{"class": cls, "objective": objective, "outcome": outcome})


def _tokens(cls: str, outcome: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return _key("stepserve:slo_tokens_total", **{"class": cls, "outcome": outcome})


async def test_goodput_counts_met_and_missed_objectives(ticking: App) -> None:
    """Every request here takes one step to its first token and one step per token after
    it: TTFT = TPOT = STEP_S = 250 ms. Objectives of 300 ms are met, of 200 ms missed."""
    client, state = ticking
    await _settled(state)
    before = await _metrics(client)
    tokens = 5
    ttft = STEP_S  # the first plan's answer
    tpot = (tokens - 1) * STEP_S / (tokens - 1)  # one answer per token after the first
    assert ttft * 1e3 == tpot * 1e3 == 250
    requests: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({"slo_ttft_ms": 300, "slo_tpot_ms": 300}, {}),  # both met
        ({"slo_ttft_ms": 200}, {}),  # ttft missed
        ({}, {"x-slo-tpot-ms": "200", "x-slo-ttft-ms": "300"}),  # tpot missed
        ({"user": "batch"}, {}),  # the class's ttft of 10 s: met
        ({}, {}),  # no objective: counted nowhere
    ]
    for body, headers in requests:
        out = await _ok(client, COMPLETIONS, headers, prompt=PROMPT, **{**body, "max_tokens": tokens})
        assert out["usage"]["completion_tokens"] == tokens
    after = await _metrics(client)
    want = {
        _slo("request", "ttft", "met"): 2, _slo("request", "ttft", "missed"): 1,
        _slo("request", "tpot", "met"): 1, _slo("request", "tpot", "missed"): 1,
        _slo("request", "both", "met"): 1, _slo("request", "both", "missed"): 2,
        _tokens("request", "met"): tokens, _tokens("request", "missed"): 2 * tokens,
        _slo("user:batch", "ttft", "met"): 1, _slo("user:batch", "both", "met"): 1,
        _tokens("user:batch", "met"): tokens,
    }
    slo_keys = {k for k in after if k[0] in ("stepserve:slo_requests_total", "stepserve:slo_tokens_total")}
    assert set(want) <= slo_keys
    for key in slo_keys:
        assert after[key] - before.get(key, 0.0) == want.get(key, 0), key
    # every class's series exist from the start, at zero until a request of it ends
    assert _slo("default", "both", "met") in before and _tokens("user:batch", "missed") in before
    # the first-token forecast of each (an empty queue and nothing running: its prompt in
    # one step, no plan in flight ahead of it) against its measured TTFT: exact
    predicted = STEP_S
    assert ttft - predicted == 0.0
    count = _key("stepserve:ttft_forecast_error_seconds_count")
    assert after[count] - before[count] == len(requests)
    exact = _key("stepserve:ttft_forecast_error_seconds_bucket", le="0.0")
    early = _key("stepserve:ttft_forecast_error_seconds_bucket", le="-0.01")
    assert after[exact] - before[exact] == len(requests) and after[early] == before[early]
    error = _key("stepserve:ttft_forecast_abs_error_seconds_sum")
    assert after[error] - before[error] == pytest.approx(0.0)


async def test_an_aborted_request_is_not_met(ticking: App) -> None:
    client, state = ticking
    await _settled(state)
    before = await _metrics(client)
    resp = await client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1500, "stream": True,
                                                "slo_ttft_ms": 300, "slo_tpot_ms": 300})
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")  # its first token came in time
    resp.close()
    await _settled(state)
    after = await _metrics(client)

    def delta(key: tuple[str, frozenset[tuple[str, str]]]) -> float:
        return after[key] - before[key]

    assert delta(_key("stepserve:request_success_total", finished_reason="abort")) == 1
    assert delta(_slo("request", "ttft", "met")) == 1  # met before the abort: it happened
    assert delta(_slo("request", "tpot", "missed")) == 1 and delta(_slo("request", "tpot", "met")) == 0
    assert delta(_slo("request", "both", "missed")) == 1 and delta(_slo("request", "both", "met")) == 0
    assert 1 <= delta(_tokens("request", "missed")) < 1500 and delta(_tokens("request", "met")) == 0


async def test_judging_aborts_and_single_tokens() -> None:
    """`observe_objectives` alone: an abort before the first token misses its TTFT; a request
    of one output token has no TPOT to miss."""
    metrics = ServiceMetrics(MODEL)
    metrics.observe_objectives(SLO(1.0, 0.1), arrival=0.0, first_token=None, finished=0.5,
                               num_output=0, aborted=True)
    metrics.observe_objectives(SLO(1.0, 0.1), arrival=0.0, first_token=0.5, finished=0.5,
                               num_output=1, aborted=False, predicted_ttft=0.75)
    got = _samples(metrics.exposition().decode())
    assert got[_slo("default", "ttft", "missed")] == 1 and got[_slo("default", "tpot", "missed")] == 1
    assert got[_slo("default", "ttft", "met")] == 1 and got[_slo("default", "tpot", "met")] == 1
    assert got[_slo("default", "both", "met")] == 1 and got[_slo("default", "both", "missed")] == 1
    assert got[_tokens("default", "met")] == 1 and _tokens("default", "missed") not in got  # no tokens
    assert got[_key("stepserve:ttft_forecast_error_seconds_bucket", le="-0.25")] == 1
    assert got[_key("stepserve:ttft_forecast_error_seconds_bucket", le="-0.5")] == 0
    assert got[_key("stepserve:ttft_forecast_abs_error_seconds_sum")] == 0.25
    assert got[_key("stepserve:ttft_forecast_error_seconds_count")] == 1  # the abort had no first token


# -- 429s with a predicted Retry-After ----------------------------------------------------
#
# The parked app's queue: QUEUED requests of QUEUED_LEN prompt tokens, nothing running, KV
# and seats to spare. Nothing decodes, so a step computes a whole budget's chunk of the
# prefills ahead (and its own) and costs 10 ms + BUDGET x 1 ms, a last shorter chunk its
# own shorter step; nothing runs, so no plan is in flight ahead of a new request.

STEP = 0.010 + 0.001 * BUDGET  # 0.522 s


def _rejected(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], reason: str) -> float:
    return samples[_key("stepserve:request_rejected_total", reason=reason)]


async def test_reject_unmeetable_answers_429_with_the_predicted_wait(parked: App) -> None:
    client, state = parked
    engine, sched = _engine(state), _scheduler(state)
    waiting = len(sched.waiting)
    own = 64
    assert QUEUED * QUEUED_LEN % BUDGET == 0  # the queue's prefills fill 8 whole steps
    first_token = QUEUED * QUEUED_LEN // BUDGET * STEP + (0.010 + 0.001 * own)  # 4.250 s
    objective_ms = 1000
    retry = math.ceil(first_token - objective_ms / 1e3)  # 3.250 s -> 4
    assert retry == 4
    before = await _metrics(client)
    for headers, body in (({}, {"slo_ttft_ms": objective_ms}), ({"x-slo-ttft-ms": str(objective_ms)}, {"n": 2})):
        resp = await client.post(COMPLETIONS, json={"prompt": [TOKEN] * own, **body}, headers=headers)
        assert resp.status == 429, await resp.text()
        assert resp.headers["Retry-After"] == str(retry)
        err = (await resp.json())["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "slo_unmeetable"
        assert f"({objective_ms} ms" in err["message"] and f"{first_token * 1e3:.0f} ms" in err["message"]
    after = await _metrics(client)
    assert _rejected(after, "slo_unmeetable") - _rejected(before, "slo_unmeetable") == 2
    assert _rejected(after, "queue_full") == _rejected(before, "queue_full")
    # nothing was queued or left behind
    assert engine.num_unfinished == 0 and len(sched.waiting) == waiting == len(sched.added) == QUEUED
    # one it could meet, or one without a TTFT objective, passes the check (the loop is parked:
    # asked directly, not submitted)
    params = SamplingParams(max_tokens=16)
    engine.check_objectives([TOKEN] * own, params, slo=SLO(ttft_s=first_token + 0.01))
    engine.check_objectives([TOKEN] * own, params, slo=SLO(tpot_s=0.001))
    engine.check_objectives([TOKEN] * own, params)
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError) as limited:
        await api.completions.create(model=MODEL, prompt=[TOKEN] * own, extra_body={"slo_ttft_ms": objective_ms})
    assert limited.value.response.headers["retry-after"] == str(retry)
    assert limited.value.code == "slo_unmeetable"
    await api.close()


async def test_the_waiting_limit_429_carries_the_predicted_wait(parked: App) -> None:
    client, state = parked
    engine, sched = _engine(state), _scheduler(state)
    n = 3
    engine.max_waiting_requests = QUEUED  # full: n more must wait for n to leave
    before = await _metrics(client)
    try:
        resp = await client.post(COMPLETIONS, json={"prompt": PROMPT, "n": n})
    finally:
        engine.max_waiting_requests = None
    assert resp.status == 429, await resp.text()
    leave = n * QUEUED_LEN // BUDGET * STEP  # the first n prefills, a step each: 1.566 s
    assert resp.headers["Retry-After"] == str(math.ceil(leave)) == "2"
    err = (await resp.json())["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    after = await _metrics(client)
    assert _rejected(after, "queue_full") - _rejected(before, "queue_full") == 1
    assert engine.num_unfinished == 0 and len(sched.waiting) == len(sched.added) == QUEUED
