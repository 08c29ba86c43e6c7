"""Deployments of several replicas (Docker and Kubernetes can't run here): every YAML file parses;
every metric that deploy/ reads (Grafana queries, the endpoint picker's engine config) is on a
live replica's /metrics; every `stepserve serve` flag in compose and Kubernetes commands is in
its --help, every smg flag in `smg launch --help`; probes poll /health; and the compose profile
`replicas` names three replicas that smg routes to and Prometheus scrapes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.cli.serve_args import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
REPLICAS = ("stepserve-1", "stepserve-2", "stepserve-3")
INSTANT = ("--worker-runner", "worker.execution.instant_runner:InstantRunner", "--kv-cache-memory", "512MiB")
METRIC = re.compile(r"\b(?:stepserve|vllm):[a-z0-9_]+")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def _smg() -> str | None:
    """The `smg` command beside this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


def _yaml_files() -> list[Path]:
    return [REPO / "docker-compose.yml", *sorted(DEPLOY.rglob("*.yaml")), *sorted(DEPLOY.rglob("*.yml"))]


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def _k8s() -> list[dict[str, Any]]:
    """Every object of deploy/k8s (the kustomization is not one)."""
    docs = [doc for path in sorted(K8S.glob("*.yaml")) for doc in _docs(path)]
    return [doc for doc in docs if doc["kind"] != "Kustomization"]


def _containers(kind: str = "Deployment") -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in _k8s():
        if doc["kind"] == kind:
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc["metadata"]["name"], container


def _command(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _commands(program: list[str]) -> list[list[str]]:
    """Every compose and Kubernetes command line that starts with `program`, e.g. ["smg", "launch"]."""
    found = [s["command"] for s in _compose().values() if isinstance(s.get("command"), list)]
    found += [_command(c) for _, c in _containers()]
    return [cmd for cmd in found if cmd[: len(program)] == program]


def _strings(node: Any) -> Iterator[str]:
    """Every string value of a parsed YAML document (comments are not values), but image names and
    scrape targets, which read like metric names (`stepserve:cpu`, `stepserve:8000`)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            if key not in ("image", "targets"):
                yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _epp_engines() -> list[dict[str, Any]]:
    (config_map,) = (d for d in _docs(K8S / "inferencepool.yaml") if d["kind"] == "ConfigMap")
    (text,) = config_map["data"].values()
    config = yaml.safe_load(text)
    (extractor,) = (p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    return extractor["parameters"]["engineConfigs"]


def _referenced_metrics() -> set[str]:
    dash = json.loads((DEPLOY / "grafana/dashboards/stepserve.json").read_text())
    texts = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    texts += [v["query"]["query"] for v in dash["templating"]["list"]]
    texts += [s for path in _yaml_files() for doc in _docs(path) for s in _strings(doc)]
    return {m for text in texts for m in METRIC.findall(text)}


# -- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_parses(path: Path) -> None:
    assert _docs(path), f"{path} is empty"


def test_dashboard_json_and_variables() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/stepserve.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"model_name", "instance"}
    for name, var in variables.items():
        assert re.fullmatch(rf"label_values\((stepserve:[a-z_]+)(\{{.*\}})?, {name}\)", var["query"]["query"])
        assert var["includeAll"] and var["multi"]
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for use in re.findall(r"stepserve:[a-z0-9_]+(\{[^}]*\})?", target["expr"]):
                assert '$model_name' in use and '$instance' in use, (panel["title"], target["expr"])


def test_k8s_objects_are_complete() -> None:
    kinds = [doc["kind"] for doc in _k8s()]
    assert {"Deployment", "Service", "InferencePool", "ConfigMap", "HTTPRoute"} <= set(kinds)
    for doc in _k8s():
        assert doc["apiVersion"] and doc["metadata"]["name"]
    (pool,) = (d for d in _k8s() if d["kind"] == "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (replicas,) = (d for d in _k8s() if d["kind"] == "Deployment" and d["metadata"]["name"] == "stepserve")
    assert pool["spec"]["selector"]["matchLabels"] == replicas["spec"]["selector"]["matchLabels"]
    (epp,) = (d for d in _k8s() if d["kind"] == "Deployment" and d["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"])
    assert "--config-file" in _command(epp["spec"]["template"]["spec"]["containers"][0])
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


def test_router_image_pins_smg() -> None:
    text = (DEPLOY / "router/Dockerfile").read_text()
    assert re.search(r"ARG SMG_VERSION=1\.13\.\d+", text) and '"smg==${SMG_VERSION}"' in text
    assert _compose()["router"]["build"]["context"] == "deploy/router"


# -- probes and shutdown ----------------------------------------------------------------------


def test_replica_probes_poll_health_and_grace_covers_the_drain() -> None:
    (container,) = (c for name, c in _containers() if name == "stepserve")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # the model loads first
    args = _command(container)
    drain = float(args[args.index("--shutdown-timeout") + 1])
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    (replicas,) = (d for d in _k8s() if d["kind"] == "Deployment" and d["metadata"]["name"] == "stepserve")
    grace = replicas["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop + drain < grace
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace  # never cuts a drain short


def test_compose_replicas_poll_health_and_outlast_the_drain() -> None:
    services = _compose()
    for name in REPLICAS:
        service = services[name]
        assert any("/health" in part for part in service["healthcheck"]["test"])
        command = service["command"]
        drain = float(command[command.index("--shutdown-timeout") + 1])
        assert float(service["stop_grace_period"].rstrip("s")) > drain


def test_router_health_checks_use_health() -> None:
    for cmd in _commands(["smg", "launch"]):
        assert cmd[cmd.index("--health-check-endpoint") + 1] == "/health"


# -- the compose profile ----------------------------------------------------------------------


def test_compose_replicas_profile_routes_and_scrapes_every_replica() -> None:
    services = _compose()
    profiled = {name for name, s in services.items() if "replicas" in s.get("profiles", [])}
    assert set(REPLICAS) | {"router"} == profiled
    assert len({services[name]["command"][0] for name in REPLICAS}) == 1
    for name in REPLICAS:
        assert services[name]["command"][:2] == ["stepserve", "serve"]
        assert "ports" not in services[name]  # reached through the router only
    router = services["router"]["command"]
    urls = router[router.index("--worker-urls") + 1:]
    urls = urls[: next((i for i, u in enumerate(urls) if u.startswith("--")), len(urls))]
    assert urls == [f"http://{name}:8000" for name in REPLICAS]
    assert set(services["router"]["depends_on"]) == set(REPLICAS)
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for sc in jobs["stepserve"]["static_configs"] for t in sc["targets"]}
    assert {f"{name}:8000" for name in REPLICAS} <= targets
    metrics_port = router[router.index("--prometheus-port") + 1]
    assert [t for sc in jobs["smg"]["static_configs"] for t in sc["targets"]] == [f"router:{metrics_port}"]


def test_default_services_are_unchanged() -> None:
    services = _compose()
    assert "profiles" not in services["stepserve"]
    assert services["stepserve"]["ports"] == ["8000:8000"]
    assert {"prometheus", "grafana"} <= {n for n, s in services.items() if "profiles" not in s}


# -- flags ------------------------------------------------------------------------------------


def test_serve_flags_exist() -> None:
    known = {s for a in build_parser()._actions for s in a.option_strings}
    commands = _commands(["stepserve", "serve"])
    assert len(commands) >= 3 + 1 + 1  # compose: default, gpu, three replicas; k8s: one
    for cmd in commands:
        assert set(FLAG.findall(" ".join(cmd))) - known == set(), cmd
        build_parser().parse_args(cmd[2:])  # and the values parse


def test_smg_flags_exist() -> None:
    smg = _smg()
    if smg is None:
        pytest.skip("smg is not installed, so its flags can't be checked (pip install 'smg==1.13.*')")
    help_text = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True, timeout=120,
                               check=True).stdout
    known = set(FLAG.findall(help_text))
    policies = re.findall(r"--policy \{([a-z_,]+)\}", help_text)[0].split(",")
    commands = _commands(["smg", "launch"])
    assert len(commands) == 2  # compose and k8s
    for cmd in commands:
        assert set(FLAG.findall(" ".join(cmd))) - known == set(), cmd
        assert cmd[cmd.index("--policy") + 1] in policies


def test_epp_engine_config_names_replica_metrics() -> None:
    (engine,) = _epp_engines()
    assert engine["loraSpec"] == ""  # stepserve has no LoRA
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert METRIC.fullmatch(engine[key]), key


# -- metrics against a live replica -----------------------------------------------------------


@pytest.mark.slow
def test_every_referenced_metric_is_on_a_live_replica(tmp_path: Path,
                                                       start_server: Callable[..., Any]) -> None:
    """Grafana's queries and variables, the EPP's engine config, every metric name in deploy/'s
    YAML values, and the EPP's and smg's built-in vLLM names, on an instant replica's /metrics."""
    server = start_server(tmp_path, *INSTANT)
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        page = resp.read().decode()
    exported = set(re.findall(r"^([\w:]+)(?:\{| )", page, re.MULTILINE))
    exported |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported}
    builtin = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"}
    referenced = _referenced_metrics()
    assert {m for e in _epp_engines() for m in METRIC.findall(json.dumps(e))} <= referenced
    assert (referenced | builtin) - exported == set()
    info = re.search(r'^stepserve:cache_config_info\{([^}]*)\}', page, re.MULTILINE)
    assert info and "block_size=" in info[1] and "num_gpu_blocks=" in info[1]  # labels the EPP reads
    assert re.search(r'^stepserve:num_requests_running\{[^}]*model_name="', page, re.MULTILINE)


def test_images_build_from_a_local_base_and_prometheus_from_debian() -> None:
    """The build arguments that let every image build from a Debian base made locally
    (deploy/README.md, "Without a registry of images"), defaults unchanged elsewhere."""
    for dockerfile, default in (("Dockerfile", "python:3.11-slim"), ("deploy/router/Dockerfile", "python:3.11-slim"),
                                ("deploy/prometheus/Dockerfile", "debian:bookworm-slim")):
        text = (REPO / dockerfile).read_text()
        assert f"ARG BASE_IMAGE={default}" in text and "FROM ${BASE_IMAGE}" in text, dockerfile
    assert "ARG TORCH_FIND_LINKS=\n" in (REPO / "Dockerfile").read_text()
    local = yaml.safe_load((DEPLOY / "compose.local.yml").read_text())["services"]
    assert set(local) == {"prometheus"}
    assert (REPO / local["prometheus"]["build"]["context"] / "Dockerfile").is_file()
    assert (DEPLOY / "local-base" / "build.sh").stat().st_mode & 0o111
