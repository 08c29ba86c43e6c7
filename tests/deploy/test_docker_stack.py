"""The Docker deployment, started for real: the images build from a Debian base made here
(deploy/local-base/build.sh; no registry of images is needed), docker-compose's `replicas`
profile runs three stepserve replicas behind SGLang's model gateway (smg) with Prometheus
(Debian's package, deploy/compose.local.yml) scraping them, requests go through the router
with the official `openai` client, Prometheus' query API returns what it scraped, and
`docker-compose stop` (SIGTERM) drains the streams in flight before every container exits 0.

It needs root, Debian's `docker.io`, `docker-compose` and `debootstrap` (CI installs them)
and skips, saying why, where no Docker daemon runs or can be started. Torch's CPU wheel is
fetched by this interpreter's pip (from wherever pip finds it: a local folder or PyTorch's
index) and served to the image build on loopback, as deploy/README.md does by hand.

One replica runs the default model (float32, eager, one thread: no kernel probe and no
compile, so the stack is up in seconds on two cores); the other two run the instant stand-in
at a model's pace (tests/support/standin_runners.py, mounted into their containers), which
keeps streams in flight long enough to stop the stack under them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from live_servers import free_port
from smg_fleet import http_json, http_text, wait_for

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "stepserve-base:bookworm"
PROJECT = "stepserve-docker-test"
REPLICAS = ("stepserve-1", "stepserve-2", "stepserve-3")
SERVICES = (*REPLICAS, "router", "prometheus")
ROUTER = "http://127.0.0.1:30000"  # docker-compose.yml publishes the router's port here
PROMETHEUS = "http://127.0.0.1:9090"
# The drain limit is generous: the real replica (float32, eager, one thread, on two cores shared with
# the whole stack) decodes 400 tokens in 10-40 s, and a stream cut at the limit fails the drain test.
SERVE = ["stepserve", "serve", "--host", "0.0.0.0", "--port", "8000", "--shutdown-timeout", "150"]
STANDINS = "/opt/standins"  # where tests/support is mounted in the stand-in replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _run(cmd: list[str], what: str, timeout: float = 900, **kwargs: Any) -> str:
    """Run `cmd`; its output, or an AssertionError naming `what` with the output's tail."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}")
    return proc.stdout


def _daemon_answers() -> bool:
    return subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=30).returncode == 0


@contextlib.contextmanager
def _docker_daemon(log_dir: Path) -> Iterator[None]:
    """A Docker daemon for the duration: the running one, else `dockerd` started (as root) and
    stopped afterwards. Skips where there is neither."""
    if shutil.which("docker") is None:
        pytest.skip("no `docker` command (Debian's docker.io): the Docker deployment cannot be started here")
    if _daemon_answers():
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip("no Docker daemon runs and none can be started here (needs root and Debian's docker.io)")
    log_path = log_dir / "dockerd.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _daemon_answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"dockerd could not start here:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        yield
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


@contextlib.contextmanager
def _torch_wheel_on_loopback(folder: Path) -> Iterator[str]:
    """Torch's CPU wheel, fetched by this interpreter's pip into `folder` and served there over
    HTTP on loopback: a --find-links URL for the image build."""
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(folder),
          "--extra-index-url", "https://download.pytorch.org/whl/cpu", "--retries", "1", "--timeout", "15",
          "torch==2.13.0+cpu"], "fetching torch's CPU wheel")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: "torch-2.13.0" in http_text(f"http://127.0.0.1:{port}/", timeout=2), 30,
                 "the wheel folder's HTTP server")
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.terminate()
        server.wait()


def _build_images(work: Path) -> None:
    """The base (once per daemon), then the three images the stack runs, as deploy/README.md
    says under "Without a registry of images"."""
    if not _image_exists(BASE_IMAGE):
        if shutil.which("debootstrap") is None:
            pytest.skip(f"no {BASE_IMAGE} image and no debootstrap (Debian's package) to build it")
        _run(["bash", str(REPO / "deploy/local-base/build.sh"), BASE_IMAGE], "building the Debian base")
    base = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    wheels = work / "wheels"
    wheels.mkdir()
    with _torch_wheel_on_loopback(wheels) as find_links:
        _run(["docker", "build", "-q", "--network", "host", "-t", "stepserve:cpu", *base,
              "--build-arg", f"TORCH_FIND_LINKS={find_links}", str(REPO)], "building stepserve:cpu")
    _run(["docker", "build", "-q", "--network", "host", "-t", "stepserve-router:smg-1.13.0", *base,
          str(REPO / "deploy/router")], "building the router's image")
    _run(["docker", "build", "-q", "--network", "host", "-t", "stepserve-prometheus:debian", *base,
          str(REPO / "deploy/prometheus")], "building Prometheus' image")


def _override() -> dict[str, Any]:
    """The test's compose override: the replicas as described in the module docstring, and
    nothing restarted behind the test's back."""
    real = [*SERVE, "--dtype", "float32", "--quantization", "none", "--enforce-eager", "--num-threads", "1",
            "--kv-cache-memory", "128MiB", "--max-num-seqs", "4"]
    standin = [*SERVE, "--worker-runner", "standin_runners:PacedInstantRunner", "--kv-cache-memory", "256MiB"]
    services: dict[str, Any] = {"stepserve-1": {"command": real, "restart": "no"}}
    for name in REPLICAS[1:]:
        services[name] = {"command": standin, "restart": "no", "environment": {"PYTHONPATH": STANDINS},
                          "volumes": [f"{REPO / 'tests/support'}:{STANDINS}:ro"]}
    services["router"] = {"restart": "no"}
    return {"version": "3.8", "services": services}


@dataclass
class Stack:
    """The running compose project."""

    compose: list[str]

    def run(self, *args: str, what: str, timeout: float = 300) -> str:
        return _run([*self.compose, *args], what, timeout=timeout, cwd=REPO)

    def logs(self) -> str:
        proc = subprocess.run([*self.compose, "logs", "--no-color", "--tail", "40"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=REPO, timeout=60)
        return proc.stdout[-6000:]

    def exit_codes(self) -> dict[str, int]:
        """Each service's container: its exit code (-1 while it runs)."""
        codes = {}
        for service in SERVICES:
            cid = self.run("ps", "-q", service, what=f"finding {service}'s container").strip()
            state = json.loads(_run(["docker", "inspect", "-f", "{{json .State}}", cid], f"inspecting {service}"))
            codes[service] = -1 if state["Running"] else int(state["ExitCode"])
        return codes


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("docker")
    compose_cmd = shutil.which("docker-compose")
    if compose_cmd is None:
        pytest.skip("no `docker-compose` (Debian's package): the compose stack cannot be started here")
    with _docker_daemon(work):
        _build_images(work)
        override = work / "compose.test.yml"
        override.write_text(json.dumps(_override()))  # JSON is YAML
        stack = Stack([compose_cmd, "-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "deploy/compose.local.yml"),
                       "-f", str(override), "-p", PROJECT, "--profile", "replicas"])
        try:
            stack.run("up", "-d", "--no-build", "--no-deps", *SERVICES, what="starting the stack")
            try:
                wait_for(lambda: http_json(ROUTER + "/readiness", timeout=5)[0] == 200, 300,
                         "the router to find its three replicas healthy", poll=1)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{stack.logs()}") from exc
            yield stack
        finally:
            subprocess.run([*stack.compose, "down", "-v", "--remove-orphans", "-t", "5"], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=300)


def _client() -> Any:
    from openai import OpenAI

    return OpenAI(base_url=ROUTER + "/v1", api_key="unused", max_retries=0, timeout=120)


def _model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def test_completions_and_streamed_chat_go_through_the_router(stack: Stack) -> None:
    client = _client()
    model = _model(client)
    for i in range(6):
        completion = client.completions.create(model=model, prompt=f"Question {i}: what is a queue?", max_tokens=8)
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert completion.usage.completion_tokens > 0 and completion.choices[0].text
    for i in range(3):
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Say hello number {i}."}], max_tokens=16, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
            in (["length"], ["stop"])
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def _query(expr: str) -> list[dict[str, Any]]:
    status, body = http_json(f"{PROMETHEUS}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert status == 200 and body["status"] == "success", body
    return list(body["data"]["result"])


def test_prometheus_scrapes_every_replica_and_counts_what_they_served(stack: Stack) -> None:
    client = _client()
    model = _model(client)
    for i in range(4):
        client.completions.create(model=model, prompt=f"Counted request {i}.", max_tokens=4)

    def scraped() -> bool:
        up = {r["metric"]["instance"]: r["value"][1] for r in _query('up{job="stepserve"}')}
        served = _query('sum by (instance) (stepserve:request_success_total{job="stepserve"})')
        return (all(up.get(f"{name}:8000") == "1" for name in REPLICAS)
                and {r["metric"]["instance"] for r in served} >= {f"{name}:8000" for name in REPLICAS}
                and sum(float(r["value"][1]) for r in served) >= 4)

    wait_for(scraped, 90, "Prometheus to scrape the three replicas and their finished requests", poll=1)
    assert _query('up{job="smg"}')[0]["value"][1] == "1"  # the router's own metrics are scraped too


def test_sigterm_drains_streams_in_flight_and_every_container_exits_0(stack: Stack) -> None:
    client = _client()
    model = _model(client)
    max_tokens = 400  # about 4 s on a stand-in replica: in flight when the stop arrives
    started = threading.Barrier(6 + 1, timeout=120)
    results: dict[int, tuple[str | None, int]] = {}
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            finish, tokens = None, 0
            chunks = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell story number {i}."}], max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for n, chunk in enumerate(chunks):
                if n == 0:
                    started.wait()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results[i] = (finish, tokens)
        except BaseException as exc:  # reported below, with the containers' logs
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a stream failed: reported below
        started.wait()  # every stream has its first chunk
    stack.run("stop", "-t", "170", *REPLICAS, what="stopping the replicas", timeout=240)
    for thread in threads:
        thread.join(timeout=240)
    assert not errors, f"{errors!r}\n{stack.logs()}"
    assert results == {i: ("length", max_tokens) for i in range(6)}, stack.logs()
    stack.run("stop", "-t", "30", "router", "prometheus", what="stopping the router and Prometheus", timeout=120)
    assert stack.exit_codes() == dict.fromkeys(SERVICES, 0), stack.logs()
