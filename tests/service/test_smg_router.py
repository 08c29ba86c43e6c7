"""stepserve replicas behind the real router `smg launch` (SGLang's model gateway, PyPI
`smg`), through the official `openai` client: a mixed load completes; `cache_aware` keeps
multi-turn conversations on the replica that caches their prefix (more prefix-cache hits
than `round_robin` on requests of the same shape); `power_of_two` polls every replica's
load and routes around the one it reads as busy; a replica killed with `kill -9` mid-load
ends its streams with an error, leaves the rotation within a few health-check intervals
and rejoins when restarted on its port; a SIGTERM'd replica answers /health with 503 at
once, so the router stops sending to it while it drains its streams whole and exits 0; and
real text from the default model streams through. Three replicas of the instant stand-in,
paced at 10 ms a step so long streams stay running, keep all but the last case cheap; the
default model gets one replica of its own. Time limits are generous bounds on events, never
speed checks.

smg 1.13 takes a replica for vLLM (by its /version) and reads its load from GET /metrics,
under vLLM's gauge names (`vllm:num_requests_running`, ...); it never asks GET /get_load."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from live_servers import free_port
from smg_fleet import (
    INSTANT_REPLICA,
    REAL_REPLICA,
    Replica,
    Router,
    smg_executable,
    start_router,
    wait_for,
)

SMG = smg_executable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SMG is None, reason="the `smg` router is not installed (pip install -e '.[test]'; "
                                                     "no wheel for this platform means a Rust build)")]

MODEL = "instant"
HITS = "stepserve:prefix_cache_hits_total"
RUNNING = "stepserve:num_requests_running"
# cache_aware as affinity alone: no warm-up share of misses or diverted hits for idle replicas.
AFFINITY = ("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Three InstantRunner replicas, started together; the kill test restarts one in place."""
    log_dir = tmp_path_factory.mktemp("replicas")
    replicas = [Replica(free_port(), INSTANT_REPLICA, log_dir) for _ in range(3)]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(timeout=300)
        yield replicas
    finally:
        for replica in replicas:
            replica.kill()


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Callable[..., Router]]:
    """`router(replicas, policy, *flags)`: an `smg launch` in front; killed at teardown."""
    started: list[Router] = []

    def start(replicas: list[Replica], policy: str, *flags: str) -> Router:
        assert SMG is not None
        started.append(start_router(SMG, replicas, policy, tmp_path, *flags))
        return started[-1]

    yield start
    for each in started:
        each.stop()


def client(server: Router | Replica, cls: type[Any] = openai.OpenAI) -> Any:
    return cls(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def posts(replicas: list[Replica]) -> list[int]:
    """Completed POSTs to the OpenAI routes per replica (its access log)."""
    return [r.access_count("POST", "/v1/completions", "200") + r.access_count("POST", "/v1/chat/completions", "200")
            for r in replicas]


def served(replicas: list[Replica], before: list[int], total: int) -> list[int]:
    """POSTs per replica since `before`, once they add up to `total` (a replica logs a
    request just after its client has the last byte)."""
    wait_for(lambda: sum(posts(replicas)) - sum(before) >= total, 30, f"{total} requests in the access logs")
    return [after - b for after, b in zip(posts(replicas), before, strict=True)]


class StreamSet:
    """`count` long completion streams to a router or a replica, each read on its own
    thread; an error ends a stream, `close` ends the others."""

    def __init__(self, server: Router | Replica, count: int) -> None:
        self.api = client(server)
        self.first = [threading.Event() for _ in range(count)]
        self.errors: dict[int, Exception] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _read(self, i: int) -> None:
        try:
            stream = self.api.completions.create(model=MODEL, prompt=f"long stream {i}", max_tokens=8000,
                                                 stream=True, extra_body={"ignore_eos": True})
            with stream:
                for _ in stream:
                    self.first[i].set()
                    if self.stop.is_set():
                        return
        except Exception as exc:  # what the client raises is what the test inspects
            self.errors[i] = exc
        finally:
            self.first[i].set()

    def wait_running(self, replicas: list[Replica]) -> None:
        """Until every stream has its first chunk and `replicas` run them all."""
        for event in self.first:
            assert event.wait(120), "a stream did not start"
        assert not self.errors, self.errors
        wait_for(lambda: sum(r.metric(RUNNING) for r in replicas) == len(self.threads), 60, "every stream running")

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        self.api.close()


# -- a mixed load ------------------------------------------------------------------------------


async def _one_request(api: openai.AsyncOpenAI, i: int) -> list[str | None]:
    """Request `i` of a mix: completion or chat, streamed or not, n of 1 or 2; the finish
    reason of each choice."""
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "n": 1 + i % 2, "extra_body": {"ignore_eos": True}}
    chat, stream = i % 4 >= 2, i % 8 >= 4
    if chat:
        call = api.chat.completions.create(messages=[{"role": "user", "content": f"question {i}"}], stream=stream, **common)
    else:
        call = api.completions.create(prompt=f"prompt number {i}", stream=stream, **common)
    resp = await call
    if not stream:
        assert resp.usage.completion_tokens == 8 * common["n"]
        return sorted(c.finish_reason for c in resp.choices)
    finished: dict[int, str | None] = {}
    async for chunk in resp:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    return [finished.get(index) for index in range(common["n"])]


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
async def test_a_mixed_load_completes_through_the_router(fleet: list[Replica], router: Any, policy: str) -> None:
    front = router(fleet, policy)
    before = posts(fleet)
    async with client(front, openai.AsyncOpenAI) as api:
        reasons = await asyncio.gather(*(_one_request(api, i) for i in range(24)))
    assert all(r == ["length"] * len(r) for r in reasons), reasons
    per_replica = served(fleet, before, 24)
    assert sum(per_replica) == 24, per_replica  # each request reached exactly one replica, once
    if policy == "round_robin":
        assert per_replica == [8, 8, 8]


# -- cache-aware routing -----------------------------------------------------------------------


def _converse(api: openai.OpenAI, salt: str, conversations: int = 4, turns: int = 4) -> None:
    """Multi-turn chats, each under its own long system prompt, turns interleaved across
    conversations (4 of them over 3 replicas: round robin moves each to another replica
    every turn)."""
    chats = [[{"role": "system", "content": " ".join(
        f"Note {j} of notebook {salt}{c}: item {j * 7 + c} sits on shelf {j % 5}." for j in range(40))}]
        for c in range(conversations)]
    for turn in range(turns):
        for c, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Turn {turn} of chat {c}: which shelf holds item {turn}?"})
            resp = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                               extra_body={"ignore_eos": True})
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})


def _hits(replicas: list[Replica]) -> float:
    return sum(r.metric(HITS) for r in replicas)


def test_cache_aware_keeps_conversations_on_their_cached_prefix(fleet: list[Replica], router: Any) -> None:
    gained = {}
    for policy, salt in (("round_robin", "R"), ("cache_aware", "C")):  # distinct text: no cache carries over
        front = router(fleet, policy, *AFFINITY)
        before = _hits(fleet)
        with client(front) as api:
            _converse(api, salt)
        gained[policy] = _hits(fleet) - before
        front.stop()
    # Cache-aware hits every turn's whole history; round robin only a replica's older copy.
    assert gained["cache_aware"] > 2 * gained["round_robin"] > 0, gained


# -- power of two ------------------------------------------------------------------------------


def test_power_of_two_polls_every_replica_for_its_load(fleet: list[Replica], router: Any) -> None:
    polls = [r.access_count("GET", "/metrics") for r in fleet]
    front = router(fleet, "power_of_two")
    before = posts(fleet)
    with client(front) as api:
        for i in range(12):
            resp = api.completions.create(model=MODEL, prompt=f"p2c {i}", max_tokens=4)
            assert resp.choices[0].finish_reason == "length"
    assert sum(served(fleet, before, 12)) == 12
    # --load-monitor-interval 1: a few polls of each replica come within seconds.
    wait_for(lambda: all(r.access_count("GET", "/metrics", "200") >= n + 3 for r, n in zip(fleet, polls, strict=True)),
             60, "smg to poll each replica's /metrics three times")


BUSY_STREAMS = 16


def test_power_of_two_routes_around_the_replica_it_reads_as_busy(fleet: list[Replica], router: Any) -> None:
    """Sixteen streams sent to one replica directly, past the router: once the router's poll
    reads them, each of its two-way draws prefers the other replica, so none of its
    requests goes to the busy one. Compared by request counts: the default, expected wait,
    may rate a replica with free batch slots as no slower than an idle one. smg adds its own
    dispatches since the last poll to a replica's polled count, so the busy replica runs more
    streams than the router's twelve requests could add to an idle one between two polls."""
    busy, idle = fleet[0], fleet[1:]
    front = router(fleet, "power_of_two", "--power-of-two-load-metric", "requests")
    streams = StreamSet(busy, BUSY_STREAMS)
    try:
        streams.wait_running([busy])
        wait_for(lambda: front.engine_loads().get(busy.url, {}).get("num_running_reqs") == BUSY_STREAMS, 60,
                 "smg to read the busy replica's running requests")
        seen = {url: load["num_running_reqs"] for url, load in front.engine_loads().items()}
        assert seen == {busy.url: BUSY_STREAMS, **{r.url: 0 for r in idle}}, seen
        before = posts(fleet)  # the busy replica logs its streams only when they end
        with client(front) as api:
            for i in range(12):
                assert api.completions.create(model=MODEL, prompt=f"around {i}", max_tokens=4).choices[0].text
        assert busy.metric(RUNNING) == BUSY_STREAMS, "the busy replica's streams ended before the router's requests did"
        assert served(fleet, before, 12)[0] == 0, front.engine_loads()  # all twelve on the idle two
        assert not streams.errors
    finally:
        streams.close()


# -- kill -9 of a replica ----------------------------------------------------------------------


def _kill_mid_load(front: Router, victim: Replica, fleet: list[Replica]) -> None:
    """`kill -9` of `victim` under six streams (two on each replica): its two end with an
    error at the client, the others go on; requests sent at once still succeed; the router
    counts it unhealthy within a few health-check intervals."""
    streams = StreamSet(front, 6)
    try:
        streams.wait_running(fleet)
        on_victim = int(victim.metric(RUNNING))
        assert on_victim == 2  # round robin
        victim.kill()
        with client(front) as api:  # before a health check can have noticed
            for i in range(3):
                assert api.completions.create(model=MODEL, prompt=f"at once {i}", max_tokens=4).choices[0].text
        wait_for(lambda: len(streams.errors) == on_victim, 60, "the killed replica's streams to fail")
        assert all(isinstance(e, openai.APIError) for e in streams.errors.values()), streams.errors
        wait_for(lambda: not front.health()[victim.url], 30, "smg to mark the killed replica unhealthy")
        assert len(streams.errors) == on_victim  # the other streams went on (or ended well)
    finally:
        streams.close()


def test_a_killed_replica_fails_its_streams_leaves_and_rejoins(fleet: list[Replica], router: Any) -> None:
    front = router(fleet, "round_robin")
    victim, survivors = fleet[0], fleet[1:]
    _kill_mid_load(front, victim, fleet)
    wait_for(lambda: sum(r.metric(RUNNING) for r in survivors) == 0, 60, "the closed streams to end")
    sent, before = front.worker_requests(), posts(survivors)
    with client(front) as api:
        for i in range(6):
            assert api.completions.create(model=MODEL, prompt=f"after {i}", max_tokens=4).choices[0].text
    assert served(survivors, before, 6) == [3, 3]
    assert front.worker_requests()[victim.url] == sent[victim.url]  # not even tried
    victim.start()  # the same port
    victim.wait_ready(timeout=300)
    wait_for(lambda: front.health()[victim.url], 30, "smg to count the restarted replica healthy again")
    with client(front) as api:
        for i in range(6):
            assert api.completions.create(model=MODEL, prompt=f"rejoined {i}", max_tokens=4).choices[0].text
    assert served([victim], [0], 2) == [2], victim.log()  # round robin: a third of six


def test_sigterm_drains_a_replica_while_the_router_stops_sending_to_it(fleet: list[Replica], tmp_path: Path,
                                                                       router: Any) -> None:
    """SIGTERM to a replica under load: its /health answers 503 at once, so the router counts
    it unhealthy while it drains; its streams still finish whole; every request sent after
    goes to the other replica; the replica exits 0."""
    draining = Replica(free_port(), (*INSTANT_REPLICA, "--shutdown-timeout", "120"), tmp_path)
    draining.start()
    try:
        draining.wait_ready(timeout=300)
        survivor = fleet[1]
        front = router([survivor, draining], "round_robin")
        api = client(front)
        outcomes: dict[int, tuple[int, str | None]] = {}  # stream -> (chunks, finish_reason)
        started = [threading.Event() for _ in range(4)]

        def read(i: int) -> None:
            chunks, reason = 0, None
            try:
                # 1,500 paced tokens take 15 s or more: the drain outlasts health checks
                for chunk in api.completions.create(model=MODEL, prompt=f"drain {i}", max_tokens=1500, stream=True,
                                                    extra_body={"ignore_eos": True}):
                    started[i].set()
                    chunks += 1
                    reason = chunk.choices[0].finish_reason if chunk.choices else reason
            finally:
                started[i].set()
                outcomes[i] = (chunks, reason)

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(120), "a stream did not start"
        wait_for(lambda: draining.metric(RUNNING) == 2, 60, "two streams on the draining replica")  # round robin
        assert draining.process is not None
        draining.process.send_signal(signal.SIGTERM)
        wait_for(lambda: not front.health()[draining.url], 30, "smg to count the draining replica unhealthy")
        sent, before = front.worker_requests(), posts([survivor])
        with client(front) as fresh:
            for i in range(4):
                assert fresh.completions.create(model=MODEL, prompt=f"meanwhile {i}", max_tokens=4).choices[0].text
        assert served([survivor], before, 4) == [4]
        assert front.worker_requests()[draining.url] == sent[draining.url]
        for thread in threads:
            thread.join(120)
        assert all(reason == "length" for _, reason in outcomes.values()), outcomes  # none cut short
        assert draining.process.wait(120) == 0, draining.log()
        assert draining.access_count("GET", "/health", "503") >= 1, draining.log()  # the router's checks, draining
    finally:
        draining.kill()


# -- the default model -------------------------------------------------------------------------


def test_real_text_streams_through_the_router(tmp_path: Path, router: Any) -> None:
    """One default-model replica (loading it is most of this file's time): greedy text
    streamed through the router in several chunks equals the replica's own answer."""
    replica = Replica(free_port(), REAL_REPLICA, tmp_path)
    replica.start()
    try:
        replica.wait_ready(timeout=480)  # within pytest's 600 s per test
        front = router([replica], "cache_aware")
        messages = [{"role": "user", "content": "Name three colors."}]
        with client(front) as api:
            model = api.models.list().data[0].id
            chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                      stream=True))
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(deltas) > 1 and chunks[-1].choices[0].finish_reason in ("stop", "length")
        with client(replica) as direct:
            solo = direct.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        assert "".join(deltas) == solo.choices[0].message.content and any(ch.isalpha() for ch in "".join(deltas))
    finally:
        replica.kill()
