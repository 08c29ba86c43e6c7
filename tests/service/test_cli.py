"""`stepserve serve` as a vLLM user types it: the model as a positional argument, underscore
spellings, `--config FILE.yaml`, `--version`, every refused flag named before the port is
bound (exit 2), a flag the worker refuses at start-up named the same way, `--log-level` in
the worker, the access log and the periodic stats line."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from scheduler.stats import SchedulerStats
from service.cli.args import config_argv, normalize_argv, parse_serve_args
from service.cli.checks import worker_config
from service.cli.main import main as stepserve_main
from service.cli.serve import main as serve_main
from service.cli.serve_args import build_parser
from service.cli.stats_log import Totals, read_totals, stats_line
from service.cli.version import package_version
from worker.config import WorkerConfig, WorkerConfigError, refused_field

INSTANT = ("--worker-runner", "worker.execution.instant_runner:InstantRunner",
           "--kv-cache-memory", "64MiB")
REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return parse_serve_args(build_parser(), list(argv))


def exit_message(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Parse `argv`, expecting argparse to refuse it with exit 2; its error line."""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# -- the command line ------------------------------------------------------------------------


def test_the_model_is_positional_or_a_flag_but_not_two_different_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert parse("./m.gguf", "--port", "9").model == "./m.gguf"
    assert parse("--port", "9", "./m.gguf").model == "./m.gguf"
    assert parse("--model", "m.gguf").model == "m.gguf"
    assert parse().model is None  # the default model
    assert parse("m.gguf", "--model", "./m.gguf").model == "m.gguf"  # the same file twice
    line = exit_message(capsys, "a.gguf", "--model", "b.gguf")
    assert line.startswith("stepserve serve: error: argument --model:")
    assert "'a.gguf'" in line and "'b.gguf'" in line


def test_underscore_spellings_are_the_dashed_flags() -> None:
    dashed = parse("--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager")
    for argv in (["--max_num_seqs", "8", "--no_enable_prefix_caching", "--enforce_eager"],
                 ["--max_num_seqs=8", "--no_enable_prefix_caching", "--enforce_eager"]):
        ns = parse(*argv)
        assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.enforce_eager) == (
            dashed.max_num_seqs, dashed.enable_prefix_caching, dashed.enforce_eager) == (
            8, False, True)
    # values keep their underscores; an unknown flag is left for argparse to name as typed
    parser = build_parser()
    assert normalize_argv(parser, ["--served_model_name", "my_model", "--", "--x_y"]) == [
        "--served-model-name", "my_model", "--", "--x_y"]
    assert parse("--served_model_name=my_model").served_model_name == "my_model"


def test_an_unknown_underscore_flag_is_named_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--no_such_flag")
    assert "unrecognized arguments: --no_such_flag" in capsys.readouterr().err


def test_a_config_file_holds_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "max_num_seqs: 4\n"
        "max-model-len: 512\n"
        "enable_prefix_caching: false\n"  # a switch off: --no-enable-prefix-caching
        "enforce_eager: true\n"  # a store_true switch
        "disable_dashboard: false\n"  # its default: nothing to say
        "kv_cache_memory: 256MiB\n"
        "min_prefill_share: 0.25\n"
        "model: file.gguf\n"
    )
    ns = parse("--config", str(config))
    assert (ns.max_num_seqs, ns.max_model_len, ns.enable_prefix_caching, ns.enforce_eager) == (
        4, 512, False, True)
    assert (ns.disable_dashboard, ns.kv_cache_memory, ns.min_prefill_share) == (
        False, "256MiB", 0.25)
    assert ns.model == "file.gguf" and ns.config == config
    # the command line wins: a flag, a switch, and the positional model over the file's
    ns = parse(f"--config={config}", "--max_num_seqs", "6", "--enable-prefix-caching", "cli.gguf")
    assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.model) == (6, True, "cli.gguf")
    assert ns.max_model_len == 512  # from the file still
    assert parse("--config", str(config), "--model", "other.gguf").model == "other.gguf"


def test_config_file_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    for text, words in (
        ("max_num_seqz: 4\n", "unknown key 'max_num_seqz'"),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("enforce_eager: 1\n", "key 'enforce_eager' is a switch: give true or false, got 1"),
        ("port: true\n", "key 'port' takes one value as on the command line, got True"),
        ("max_num_seqs: [1, 2]\n", "key 'max_num_seqs' takes one value"),
        ("- max_num_seqs\n", "expected a mapping of flag names to values"),
        ("max_num_seqs: [\n", "cannot read"),
    ):
        config.write_text(text)
        line = exit_message(capsys, "--config", str(config))
        assert line.startswith("stepserve serve: error: argument --config:"), line
        assert words in line, line
    # a value the flag refuses is named by its flag, and the message says it came from the file
    config.write_text("max_num_seqs: 0\n")
    line = exit_message(capsys, "--config", str(config))
    assert line == (f"stepserve serve --config {config}: error: argument --max-num-seqs: "
                    "must be >= 1, got '0'")
    assert "no such file" in exit_message(capsys, "--config", str(tmp_path / "missing.yaml"))


def test_config_lists_go_to_flags_that_take_several(tmp_path: Path) -> None:
    """No serve flag takes several values today; a parser with one shows the rule."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", nargs="+", type=float)
    parser.add_argument("--name")
    config = tmp_path / "c.yaml"
    config.write_text("rates: [1, 2.5]\nname: x_y\n")
    assert config_argv(parser, config) == ["--rates", "1", "2.5", "--name", "x_y"]
    assert parser.parse_args(config_argv(parser, config)).rates == [1.0, 2.5]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    version = package_version()
    assert version[0].isdigit()
    assert stepserve_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == version
    with pytest.raises(SystemExit) as exc:
        stepserve_main(["serve", "--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == version


def test_a_vllm_users_command_line_serves(tmp_path: Path, start_server: Any) -> None:
    """`stepserve serve ./model.gguf --max_num_seqs 8 --config cfg.yaml`, as typed: the
    positional model, an underscore flag and a config file all reach the running server."""
    from common.model_files import find_default_model

    config = tmp_path / "cfg.yaml"
    config.write_text("served_model_name: from-config\nmax_model_len: 384\nmax_num_seqs: 2\n")
    server = start_server(tmp_path, str(find_default_model()), "--max_num_seqs", "8",
                          "--config", str(config), *INSTANT, "--enable-debug-endpoints")
    with urllib.request.urlopen(f"{server.url}/v1/models") as resp:
        card = json.load(resp)["data"][0]
    assert (card["id"], card["max_model_len"]) == ("from-config", 384)
    # the positional model is what the worker is told to load (the stand-in worker loads none)
    args = parse(str(find_default_model()), "--max_num_seqs", "8", "--config", str(config))
    assert worker_config(args).model == str(find_default_model())
    body = {"model": "from-config", "prompt": "Hello", "max_tokens": 5}
    assert _complete(server.url, body)["usage"]["completion_tokens"] == 5
    # the scheduler's own settings, from the live view's first record: the flag beat the file
    with urllib.request.urlopen(f"{server.url}/dashboard/stream", timeout=30) as stream:
        line = next(raw for raw in stream if raw.startswith(b"data: "))
    hello = json.loads(line[len(b"data: "):])
    assert hello["max_num_seqs"] == 8
    assert server.stop() == 0


# -- refused before the port is bound --------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--model", "/nowhere/m.gguf"], "--model", "no such file or directory"),
        (["--quantization", "gguf", "--dtype", "bfloat16"], "--quantization",
         "--dtype=bfloat16 needs quantization none"),
        (["--quantization", "int4", "--device", "cuda"], "--quantization", "CPU only"),
        (["--batch-invariant", "--attention-backend", "torch"], "--batch-invariant",
         "--attention-backend=torch"),
        (["--attention-backend", "flash_attn", "--device", "cpu"], "--attention-backend",
         "cannot run on --device=cpu"),
        (["--device", "tpu"], "--device", "must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "must be in (0, 1]"),
        (["--priority-preemption-threshold", "2"], "--priority-preemption-threshold",
         "needs --scheduling-policy='priority'"),
        (["--preemption-mode", "swap"], "--preemption-mode", "swap space"),
        (["--generation-config", "/nowhere"], "--generation-config", "auto, vllm or a directory"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice", "needs --tool-call-parser"),
    ],
)
def test_refused_flags_exit_2_naming_the_flag_before_the_port_is_bound(
    argv: list[str], flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:  # had the server tried to listen here, it would exit 1
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert serve_main([*argv, "--port", port, *INSTANT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: stepserve serve [MODEL] [options]\n")
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"stepserve serve: error: argument {flag}: "), line
    assert words in line, line


def test_a_directory_model_is_checked_for_what_the_flags_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve_main([str(tmp_path)]) == 2
    assert "argument --model:" in capsys.readouterr().err  # no config.json
    (tmp_path / "config.json").write_text("{}")
    for argv, flag in ((["--quantization", "gguf"], "--quantization"),
                       (["--batch-invariant"], "--batch-invariant")):
        assert serve_main([str(tmp_path), *argv]) == 2
        assert f"argument {flag}: " in capsys.readouterr().err


def test_flag_checks_import_no_torch() -> None:
    """The server process checks its flags without torch (the worker owns it)."""
    code = (
        "import sys\n"
        "from service.cli.serve import main\n"
        "assert main(['--quantization', 'gguf', '--dtype', 'float16']) == 2\n"
        "assert main(['--model', '/nowhere.gguf']) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_worker_fields_map_to_their_flags() -> None:
    ns = parse("--log-level", "debug", "--num-threads", "3", "--kv-cache-memory", "1MiB")
    config = worker_config(ns)
    assert (config.log_level, config.num_threads, config.kv_cache_memory) == ("debug", 3, 1 << 20)
    # which setting a worker's start-up error refuses
    assert refused_field(WorkerConfigError("device", "x")) == "device"
    assert refused_field(ValueError("max_model_len 9000 exceeds the model's limit 8192")) == (
        "max_model_len")
    assert refused_field(ValueError("batch-invariant mode needs the GGUF kernel")) == (
        "batch_invariant")
    assert refused_field(ValueError("the model's weights are odd")) is None
    assert refused_field(RuntimeError("quantization=gguf is broken")) is None
    with pytest.raises(WorkerConfigError) as exc:
        WorkerConfig(log_level="loud")
    assert exc.value.field == "log_level"


# -- live servers ----------------------------------------------------------------------------


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _wait_for(server: Any, text: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while text not in server.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return text in server.log_path.read_text()


@pytest.mark.slow
def test_access_log_stats_line_and_worker_log_level(tmp_path: Path, start_server: Any) -> None:
    """By default: one access line per request and a stats line while there is traffic, and
    the worker logs at info. `--disable-access-log --disable-log-stats --log-level warning`
    silences all three (the worker's own info lines included)."""
    server = start_server(tmp_path, *INSTANT, "--log-stats-interval", "0.2")
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    assert _complete(server.url, body)["usage"]["completion_tokens"] == 200
    assert _wait_for(server, '"POST /v1/completions HTTP/1.1" 200')
    assert _wait_for(server, "Avg generation throughput:")
    log = server.log_path.read_text()
    stats = next(line for line in log.splitlines() if "Avg generation throughput:" in line)
    for words in ("Avg prompt throughput:", "Running:", "Waiting:", "Swapped:",
                  "KV cache usage:", "Prefix cache hit rate:"):
        assert words in stats
    assert "INFO stepserve.worker: worker ready" in log  # the worker's own line, at info
    assert server.stop() == 0

    quiet_dir = tmp_path / "quiet"
    quiet_dir.mkdir()
    quiet = start_server(quiet_dir, *INSTANT, "--log-stats-interval", "0.2",
                         "--disable-access-log", "--disable-log-stats", "--log-level", "warning")
    assert _complete(quiet.url, body)["usage"]["completion_tokens"] == 200
    time.sleep(1.0)  # five stats periods
    assert quiet.stop() == 0
    log = quiet.log_path.read_text()
    assert "POST /v1/completions" not in log
    assert "throughput" not in log
    assert "worker ready" not in log  # the worker (and the server) log warnings only


@pytest.mark.slow
def test_a_flag_the_worker_refuses_at_start_up_exits_2_with_its_message(tmp_path: Path) -> None:
    """`--device cuda` needs torch to check, so the worker does, after the port is bound;
    the server still exits 2 with the flag named, and no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--device", "cuda:7",
         *INSTANT], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "stepserve serve: error: argument --device: --device=cuda:7, but " in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the stats line --------------------------------------------------------------------------


def _stats(running: int = 0, waiting: int = 0, usage: float = 0.0) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, num_swapped=0,
                          kv_cache_usage=usage, num_free_blocks=0, num_gpu_blocks=1,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                          num_swap_preemptions=0)


def test_stats_line_rates_over_the_interval() -> None:
    before = Totals(10.0, prompt_tokens=100, generation_tokens=50, prefix_queries=100,
                    prefix_hits=0)
    after = Totals(12.0, prompt_tokens=300, generation_tokens=250, prefix_queries=300,
                   prefix_hits=150)
    line = stats_line(before, after, _stats(running=3, waiting=1, usage=0.125))
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
                    "100.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, Swapped: 0 reqs, "
                    "KV cache usage: 12.5%, Prefix cache hit rate: 75.0%")
    # no lookups this interval: the hit rate over the server's life
    idle_lookups = Totals(14.0, 300, 450, 300, 150)
    assert "Prefix cache hit rate: 50.0%" in (stats_line(after, idle_lookups, _stats(1)) or "")
    # nothing happened and nothing is live: no line
    assert stats_line(after, Totals(14.0, 300, 250, 300, 150), _stats()) is None


async def test_stats_totals_follow_a_real_engine(make_client: Any) -> None:
    async with make_client() as (client, state):
        engine = state.loaded.engine
        before = read_totals(engine, 0.0)
        resp = await client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 7,
                                                          "ignore_eos": True})
        usage = (await resp.json())["usage"]
        after = read_totals(engine, 1.0)
        assert after.generation_tokens - before.generation_tokens == 7
        assert after.prompt_tokens - before.prompt_tokens == usage["prompt_tokens"]
        line = stats_line(before, after, engine.stats)
        assert line is not None and "Avg generation throughput: 7.0 tokens/s" in line
