"""`stepserve serve` and `stepserve simulate` offer the same scheduler flags, with the same
defaults and the same validation, and both build their `SchedulerConfig` from them the same
way (`scheduler.flags`); every default is the config's own (an offline run's, the offline
config's)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from loadgen.sim.cli import _run_parser
from scheduler.config import OFFLINE_DEFAULTS, SchedulerConfig
from scheduler.flags import FLAG_FIELDS, flag_error, from_args
from service.cli.checks import worker_config
from service.cli.serve_args import build_parser

SCHEDULER_GROUP = "scheduler"


def _scheduler_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    group = next(g for g in parser._action_groups if g.title == SCHEDULER_GROUP)
    return {a.dest: a for a in group._group_actions}


def test_both_commands_declare_the_same_scheduler_flags() -> None:
    serve, simulate = _scheduler_actions(build_parser()), _scheduler_actions(_run_parser("simulate"))
    assert serve.keys() == simulate.keys()
    for dest, action in serve.items():
        other = simulate[dest]
        assert action.option_strings == other.option_strings, dest
        assert (action.default, action.choices, action.type) == (other.default, other.choices, other.type), dest


def test_every_flag_default_is_the_configs_default() -> None:
    defaults = SchedulerConfig()
    actions = _scheduler_actions(build_parser())
    assert set(FLAG_FIELDS) <= actions.keys()
    for name in FLAG_FIELDS:
        assert actions[name].default == getattr(defaults, name), name
    # resolved at run time: the token budget from chunked prefill and the context length
    assert actions["max_num_batched_tokens"].default is None and actions["max_model_len"].default is None


@pytest.mark.parametrize("argv", [
    ["--max-num-seqs", "0"], ["--max-step-ms", "-1"], ["--max-step-ms", "nan"], ["--min-prefill-share", "1"],
    ["--aging-period", "0"], ["--sjf-aging-rate", "inf"], ["--priority-preemption-threshold", "0"],
    ["--block-size", "x"], ["--scheduling-policy", "lifo"], ["--victim-policy", "oldest"],
    ["--tenant-weights", "alice=0"], ["--tenant-weights", "alice=1,alice=2"], ["--long-prefill-token-threshold", "-1"],
])
def test_both_commands_refuse_the_same_values_naming_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for parser in (build_parser(), _run_parser("simulate")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2
        assert f"argument {argv[0]}" in capsys.readouterr().err


def test_a_config_built_from_the_flags_carries_each_of_them() -> None:
    argv = ["--max-num-seqs", "7", "--max-step-ms", "90", "--min-prefill-share", "0.25", "--block-size", "8",
            "--no-enable-prefix-caching", "--scheduling-policy", "priority", "--aging-period", "3",
            "--priority-preemption-threshold", "2", "--victim-policy", "largest_kv", "--tenant-weights", "a=2"]
    for parser in (build_parser(), _run_parser("simulate")):
        config = from_args(parser.parse_args(argv), max_model_len=512, num_gpu_blocks=64)
        assert (config.max_num_seqs, config.max_step_ms, config.min_prefill_share, config.block_size) == (7, 90, 0.25, 8)
        assert not config.enable_prefix_caching and config.scheduling_policy == "priority"
        assert (config.aging_period, config.priority_preemption_threshold) == (3, 2)
        assert config.victim_policy == "largest_kv" and config.tenant_weights == (("a", 2.0),)
        assert config.max_num_batched_tokens == 2048 and config.max_model_len == 512


def test_a_bad_combination_is_reported_with_flag_names() -> None:
    ns = build_parser().parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "64"])
    with pytest.raises(ValueError) as exc:
        from_args(ns, max_model_len=128)
    message = flag_error(exc.value)
    assert "--max-num-batched-tokens (64) must be >= --max-model-len (128)" in message
    assert "--enable-chunked-prefill" in message


def test_field_names_and_flag_dests_agree() -> None:
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert set(FLAG_FIELDS) <= names


def test_an_offline_run_takes_the_offline_defaults_and_the_flags_still_win() -> None:
    offline = build_parser(offline=True)
    actions = _scheduler_actions(offline)
    for name in FLAG_FIELDS:
        assert actions[name].default == getattr(OFFLINE_DEFAULTS, name), name
    config = from_args(offline.parse_args([]), max_model_len=512)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.max_step_ms) == (4096, 256, 0.0)
    assert worker_config(offline.parse_args([])).max_num_batched_tokens == 4096
    given = offline.parse_args(["--max-num-batched-tokens", "1024", "--max-num-seqs", "8", "--max-step-ms", "120"])
    config = from_args(given, max_model_len=512)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.max_step_ms) == (1024, 8, 120.0)
    assert worker_config(given).max_num_batched_tokens == 1024
    # without chunked prefill a whole prompt of the context length still fits a step
    unchunked = offline.parse_args(["--no-enable-chunked-prefill"])
    assert from_args(unchunked, max_model_len=8192).max_num_batched_tokens == 8192
    # the server's defaults are not touched by the offline parser's
    served = from_args(build_parser().parse_args([]), max_model_len=512)
    assert (served.max_num_batched_tokens, served.max_num_seqs, served.max_step_ms) == (2048, 128, 150.0)
