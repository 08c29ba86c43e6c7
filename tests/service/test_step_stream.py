"""The live step-record stream: bounded per-subscriber buffers that fold dropped steps into
gaps, an engine that finishes everything while subscribers never read, the SSE endpoint's
content, and its access rules (API key, login cookie, --disable-dashboard)."""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from record_schema import check_step, full
from sched_driver import MirrorWorker, make_request

from scheduler import Scheduler, SchedulerConfig
from scheduler.slo import SLO
from scheduler.step_records import empty_record
from service.engine.step_record_hub import StepRecordHub
from service.http.dashboard_routes import COOKIE, cookie_token
from service.http.state import AppConfig

pytestmark = pytest.mark.asyncio
MODEL = "instant"


def _taken(sub: Any) -> list[dict[str, Any]]:
    """The events a subscription hands its stream handler, parsed."""
    blocks = b"".join(sub.take()).split(b"\n\n")
    return [orjson.loads(b[len(b"data: "):]) for b in blocks if b]


def _record(step: int, **fields: Any) -> dict[str, Any]:
    return empty_record(step) | {"t": float(step), "kv": [0, 0, 4]} | fields


async def test_a_full_buffer_folds_the_oldest_records_into_a_gap() -> None:
    hub = StepRecordHub(Scheduler(SchedulerConfig(num_gpu_blocks=4)), buffer_records=3)
    sub = hub.subscribe()
    for i in range(10):
        hub.publish(_record(i, tokens=2, first=[f"r{i}"] if i < 2 else [], finished=[[f"r{i}", "length"]]))
    assert len(sub.buffer) == 3 and sub.dropped == 7
    events = _taken(sub)
    gap, *steps = events
    assert gap["type"] == "gap" and (gap["from_step"], gap["to_step"], gap["steps"]) == (0, 6, 7)
    assert gap["tokens"] == 14 and gap["first"] == ["r0", "r1"]
    assert [f[0] for f in gap["finished"]] == [f"r{i}" for i in range(7)]  # lifecycle survives
    assert [s["step"] for s in steps] == [7, 8, 9]
    assert not inspect.iscoroutinefunction(hub.publish) and not inspect.iscoroutinefunction(sub.push)


async def test_a_viewer_joining_mid_run_gets_every_running_request_named() -> None:
    """Short keys: the hello's `state.requests` names what runs already; later records use
    those keys, and requests admitted later come with their id in `new`."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64))
    worker = MirrorWorker(4, 64)
    for i in range(3):
        sched.add_request(make_request(f"cmpl-early-{i}", 6, 20))

    def step(hub: StepRecordHub, t: float) -> None:
        plan = sched.schedule(t)
        hub.on_plan(plan, t)
        out = worker.execute(plan)
        hub.on_output(plan, out, sched.update_from_output(plan, out, t), t)

    hub = StepRecordHub(sched, clock=lambda: 0.0)
    for k in range(3):  # nobody listens yet: nothing recorded
        step(hub, float(k))
    sub = hub.subscribe()
    state = hub.hello()["state"]
    named = dict(state["requests"])
    assert sorted(named.values()) == [f"cmpl-early-{i}" for i in range(3)]
    assert set(state["blocks"]["tables"]) == set(named)  # the map speaks in keys too
    sched.add_request(make_request("cmpl-late", 6, 5))
    for k in range(3, 8):
        step(hub, float(k))
    records = [full(e) for e in _taken(sub)]
    late = [n for r in records for n in r["new"]]
    assert [(n[4], n[0] not in named) for n in late] == [("cmpl-late", True)]
    keys = {k for r in records for k in r["decode"] + [p[0] for p in r["prefill"]]}
    assert keys == set(named) | {late[0][0]}


async def test_without_subscribers_no_record_is_built(make_client: Callable[..., Any]) -> None:
    async with make_client() as (client, state):
        hub = state.loaded.engine.step_records
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "ignore_eos": True}
        assert (await client.post("/v1/completions", json=body)).status == 200
        assert hub.published == 0 and hub.recorder._pending == {} and hub._submitted == {}
        sub = hub.subscribe()
        assert (await client.post("/v1/completions", json=body)).status == 200
        await asyncio.sleep(0.05)
        assert hub.published >= 20 and len(sub.buffer) == hub.published
        assert hub.recorder._keys == {} and hub.recorder._decoding == set()  # the finished request is forgotten
        hub.unsubscribe(sub)
        assert not hub.subscribers


async def test_engine_finishes_while_five_subscribers_never_read(make_client: Callable[..., Any]) -> None:
    async with make_client() as (client, state):
        engine = state.loaded.engine
        hub = engine.step_records
        hub.buffer_records = 16
        subs = [hub.subscribe() for _ in range(5)]
        plans = 0
        submit = engine.worker.submit

        def counting_submit(plan: Any) -> None:
            nonlocal plans
            plans += 1
            submit(plan)

        engine.worker.submit = counting_submit
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 40, "ignore_eos": True}
        resps = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(24)))
        assert [r.status for r in resps] == [200] * 24
        await asyncio.sleep(0.05)  # the last plan's output
        assert plans > 40 and hub.published == plans
        for sub in subs:  # every record reached every buffer; the oldest were folded, none lost
            assert len(sub.buffer) == 16 and sub.dropped == plans - 16
            events = [full(e) for e in _taken(sub)]
            finished = [f[0] for e in events for f in e["finished"]]
            assert len(finished) == 24 == len(set(finished))
            assert sum(e["tokens"] for e in events) == 24 * 40
        for sub in subs:
            hub.unsubscribe(sub)


async def _read_events(resp: Any, count: int = 0, until: Callable[[list[Any]], bool] | None = None) -> list[Any]:
    """Events from an SSE response until `count` arrived or `until(events)` holds."""
    events: list[dict[str, Any]] = []
    buf = b""
    async with asyncio.timeout(60):
        while not (until(events) if until else len(events) >= count):
            chunk = await resp.content.readany()
            assert chunk, "stream ended early"
            buf += chunk
            *blocks, buf = buf.split(b"\n\n")
            events += [orjson.loads(b[len(b"data: "):]) for b in blocks if b.startswith(b"data: ")]
    return events


async def test_stream_sends_hello_then_step_records_without_text(make_client: Callable[..., Any]) -> None:
    async with make_client() as (client, state):
        resp = await client.get("/dashboard/stream")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        (hello,) = await _read_events(resp, 1)
        assert hello["type"] == "hello" and hello["model"] == MODEL
        n = hello["num_blocks"]
        assert hello["state"]["kv"] == [0, 0, n] and hello["token_budget"] > 0
        assert hello["time_target_ms"] is None
        body = {"model": MODEL, "prompt": "zebra giraffe okapi", "max_tokens": 30, "ignore_eos": True}
        job = asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))
        events = await _read_events(resp, until=lambda ev: sum(len(full(e)["finished"]) for e in ev) == 4)
        assert [r.status for r in await job] == [200] * 4
        steps = [check_step(e, n) for e in events if e["type"] == "step"]
        assert len(steps) >= 20
        assert {r[0] for s in steps for r in s["new"]} and any(s["decode"] for s in steps)
        assert all("zebra" not in orjson.dumps(e).decode() for e in events)
        # requests are named by short keys; each key's `new` entry gives the request's id
        names = {key: rid for s in steps for key, _, _, _, rid in s["new"]}
        assert len(names) == 4 and all(rid.startswith("cmpl-") and len(key) < 4 for key, rid in names.items())
        named = {k for s in steps for k in s["decode"] + s["first"] + [f[0] for f in s["finished"]]}
        assert named == set(names)
        assert sorted(f[1] for s in steps for f in s["finished"]) == ["length"] * 4
        resp.close()


async def test_stalled_sse_readers_never_stop_the_engine(make_client: Callable[..., Any]) -> None:
    async with make_client() as (client, state):
        hub = state.loaded.engine.step_records
        hub.buffer_records = 4
        port = client.server.port
        readers = []
        for _ in range(5):  # real connections that read nothing, not even the headers
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /dashboard/stream HTTP/1.1\r\nHost: x\r\n\r\n")
            readers.append(sock)
        for _ in range(100):
            if len(hub.subscribers) == 5:
                break
            await asyncio.sleep(0.02)
        assert len(hub.subscribers) == 5
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        resps = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(16)))
        texts = await asyncio.gather(*(r.text() for r in resps))
        assert all(t.rstrip().endswith("data: [DONE]") for t in texts)
        assert hub.published > 200 and all(s.dropped > 0 for s in hub.subscribers)
        for sock in readers:
            sock.close()


@pytest.fixture
def keyed() -> AppConfig:
    return AppConfig(api_key="s3cret", enable_debug_endpoints=True)


async def test_without_the_key_every_dashboard_route_is_401(make_client: Callable[..., Any], keyed: AppConfig) -> None:
    async with make_client(config=keyed) as (client, _):
        page = await client.get("/dashboard")
        assert page.status == 401 and 'name="key"' in await page.text()
        for path in ("/dashboard/stream", "/dashboard/static/main.js"):
            resp = await client.get(path)
            assert resp.status == 401, path
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        wrong = await client.get("/dashboard/stream", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401
        bad_cookie = await client.get("/dashboard/stream", cookies={COOKIE: cookie_token("other")})
        assert bad_cookie.status == 401
        bad_login = await client.post("/dashboard/login", data={"key": "nope"}, allow_redirects=False)
        assert bad_login.status == 401 and "not right" in await bad_login.text()


async def test_login_cookie_or_bearer_opens_the_dashboard(make_client: Callable[..., Any], keyed: AppConfig) -> None:
    async with make_client(config=keyed) as (client, _):
        bearer = await client.get("/dashboard/stream", headers={"Authorization": "Bearer s3cret"})
        assert bearer.status == 200 and (await _read_events(bearer, 1))[0]["type"] == "hello"
        bearer.close()
        login = await client.post("/dashboard/login", data={"key": "s3cret"}, allow_redirects=False)
        assert login.status == 303 and login.headers["Location"] == "/dashboard"
        cookie = login.cookies[COOKIE]
        assert cookie.value == cookie_token("s3cret") and "s3cret" not in cookie.value
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/dashboard"
        jar = {COOKIE: cookie.value}
        page = await client.get("/dashboard", cookies=jar)
        assert page.status == 200 and "main.js" in await page.text()
        assert (await client.get("/dashboard/static/main.js", cookies=jar)).status == 200
        stream = await client.get("/dashboard/stream", cookies=jar)
        assert stream.status == 200
        stream.close()


async def test_static_files_are_only_the_packaged_ones(make_client: Callable[..., Any]) -> None:
    async with make_client() as (client, _):
        ok = await client.get("/dashboard/static/dashboard.css")
        assert ok.status == 200 and ok.headers["Content-Type"].startswith("text/css")
        assert (await client.get("/dashboard/static/nothing.js")).status == 404
        assert (await client.get("/dashboard/static/..%2Fapp.py")).status == 404


async def test_disable_dashboard_removes_every_route(make_client: Callable[..., Any]) -> None:
    async with make_client(config=AppConfig(enable_dashboard=False)) as (client, state):
        for path in ("/dashboard", "/dashboard/stream", "/dashboard/static/main.js"):
            assert (await client.get(path)).status == 404, path
        assert (await client.post("/dashboard/login", data={"key": "x"})).status == 404
        assert not state.loaded.engine.step_records.subscribers


async def test_viewers_in_step_share_one_encoding_and_a_lagging_one_gets_its_own() -> None:
    hub = StepRecordHub(Scheduler(SchedulerConfig(num_gpu_blocks=4)), buffer_records=8)
    a, b, c = hub.subscribe(), hub.subscribe(), hub.subscribe()
    for i in range(3):
        hub.publish(_record(i, tokens=1))
    first = a.take()
    assert b.take()[0] is first[0]  # the same bytes object: joined once
    for i in range(3, 5):
        hub.publish(_record(i, tokens=1))
    assert [e["step"] for e in _taken(a)] == [3, 4]
    assert [e["step"] for e in _taken(c)] == [0, 1, 2, 3, 4]  # c never read: all five, its own join
    assert [e["step"] for e in _taken(b)] == [3, 4]
    for i in range(5, 20):  # b falls behind: a gap first, then what its buffer held
        hub.publish(_record(i, tokens=1))
    gap, *rest = _taken(b)
    assert gap["type"] == "gap" and gap["steps"] == 7 and [e["step"] for e in rest] == list(range(12, 20))


async def test_keys_of_requests_that_leave_unscheduled_are_swept() -> None:
    """A hello names waiting requests; those aborted before any plan never reach a record's
    `aborted` list, so the recorder must not keep their keys for the stream's whole life."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1))
    worker = MirrorWorker(4, 64)
    hub = StepRecordHub(sched, clock=lambda: 0.0)
    sub = hub.subscribe()
    sched.add_request(make_request("cmpl-runner", 6, 100))
    for round_ in range(4):
        for i in range(200):
            sched.add_request(make_request(f"cmpl-q{round_}-{i}", 6, 5))
        hub.hello()  # a viewer connects: every waiting request gets a key
        for i in range(200):
            sched.abort(f"cmpl-q{round_}-{i}")
        plan = sched.schedule(float(round_))
        hub.on_plan(plan, float(round_))
        out = worker.execute(plan)
        hub.on_output(plan, out, sched.update_from_output(plan, out, float(round_)), float(round_))
    assert len(hub.recorder._keys) <= 2 * len(sched.requests) + 256
    assert "cmpl-runner" in hub.recorder._keys
    sub.take()


async def test_requests_waiting_for_a_grammar_show_in_the_records() -> None:
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64))
    worker = MirrorWorker(4, 64)
    sched.add_request(make_request("r", 6, 4))
    hub = StepRecordHub(sched, clock=lambda: 0.0)
    sub = hub.subscribe()
    waiting = [0]
    hub.grammar_waiting = lambda: waiting[0]
    for t in range(2):
        waiting[0] = 2 * t
        plan = sched.schedule(float(t))
        hub.on_plan(plan, float(t))
        out = worker.execute(plan)
        hub.on_output(plan, out, sched.update_from_output(plan, out, float(t)), float(t))
    first, second = _taken(sub)
    assert "waiting_for_grammar" not in first  # compacted away at 0
    assert check_step(second, 64)["waiting_for_grammar"] == 2


async def test_lost_deadlines_survive_gaps_and_name_a_request_still_waiting() -> None:
    """A request that loses its TTFT deadline while it waits is named first by its `lost`
    entry (with its id, as a `new` entry would); a gap keeps lost deadlines, not slack."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1))
    worker = MirrorWorker(4, 64)
    hub = StepRecordHub(sched, clock=lambda: 0.0, buffer_records=2)
    sub = hub.subscribe()
    runner = make_request("cmpl-runner", 6, 8)
    runner.slo = SLO(tpot_s=0.5)
    waiter = make_request("cmpl-waiter", 6, 2)
    waiter.slo = SLO(ttft_s=2.0)
    sched.add_request(runner)
    sched.add_request(waiter)
    for t in range(12):
        plan = sched.schedule(float(t))
        hub.on_plan(plan, float(t))
        out = worker.execute(plan)
        hub.on_output(plan, out, sched.update_from_output(plan, out, t + 0.9), t + 0.9)
    gap, *steps = _taken(sub)
    assert gap["type"] == "gap" and len(steps) == 2
    assert "slack" not in gap
    lost = {e[1]: e for e in gap["lost"]}
    assert lost["ttft"] == ["1", "ttft", 2.0, "cmpl-waiter"]  # named first here, before admission
    assert lost["tpot"][:3] == ["0", "tpot", 1.4]  # the runner's 2nd token (first at 0.9) came at 1.9
    (admitted,) = [n for n in gap["new"] if n[0] == "1"]
    assert admitted[4:] == ["cmpl-waiter", {"ttft_ms": 2000.0, "class": "request"}]  # its own
