"""How `stepserve serve` turns its flags and the worker's handshake into the scheduler's
config: defaults that depend on other settings, and combinations refused before loading."""

from __future__ import annotations

import argparse
import gc

import pytest

from service.cli.checks import worker_config
from service.cli.serve import GC_GEN0_THRESHOLD, freeze_startup_heap, scheduler_config
from service.cli.serve import main as serve_main
from service.cli.serve_args import build_parser
from worker.config import WorkerInfo


def _info(max_model_len: int, num_gpu_blocks: int = 4096) -> WorkerInfo:
    return WorkerInfo(model_name="m", model_path="m.gguf", architecture="LlamaForCausalLM", device="cpu",
                      dtype="float32", attention_backend="torch", vocab_size=100, eos_token_ids=(2,),
                      max_model_len=max_model_len, block_size=16, num_gpu_blocks=num_gpu_blocks,
                      num_cpu_blocks=0, kv_bytes_per_token=1024, num_params=1)


def test_token_budget_defaults_follow_chunked_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --max-num-batched-tokens the budget is 2048, or (chunked prefill off) the whole
    max model length, as in vLLM; an explicit budget that could never fit a prompt is refused
    before the model loads."""
    parser = build_parser()
    assert scheduler_config(parser.parse_args([]), _info(8192)).max_num_batched_tokens == 2048
    unchunked = parser.parse_args(["--no-enable-chunked-prefill"])
    config = scheduler_config(unchunked, _info(8192))
    assert (config.max_num_batched_tokens, config.max_model_len) == (8192, 8192)
    # the KV cache caps max_model_len, and the budget follows the capped value
    assert scheduler_config(unchunked, _info(8192, num_gpu_blocks=256)).max_num_batched_tokens == 4096
    explicit = parser.parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024"])
    assert scheduler_config(explicit, _info(512)).max_num_batched_tokens == 1024
    assert serve_main(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024", "--max-model-len", "4096"]) == 2
    assert ("argument --max-num-batched-tokens: (1024) must be >= --max-model-len (4096)"
            in capsys.readouterr().err)


def test_policy_flags_reach_the_scheduler_config(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["--scheduling-policy", "sjf", "--victim-policy", "least_remaining",
                              "--output-len-predictor", "max_tokens", "--sjf-aging-rate", "5"])
    config = scheduler_config(args, _info(1024))
    assert (config.scheduling_policy, config.victim_policy, config.output_len_predictor, config.sjf_aging_rate) == (
        "sjf", "least_remaining", "max_tokens", 5.0)
    weights = tmp_path / "w.json"  # type: ignore[operator]
    weights.write_text('{"alice": 2, "bob": 0.5}')
    for spec in ("alice=2,bob=0.5", str(weights)):
        args = parser.parse_args(["--scheduling-policy", "fair", "--tenant-weights", spec])
        assert scheduler_config(args, _info(1024)).tenant_weights == (("alice", 2.0), ("bob", 0.5))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tenant-weights", "alice"])
    assert "not TENANT=WEIGHT" in capsys.readouterr().err
    for bad, flag in ((["--scheduling-policy", "fair", "--tenant-weights", "alice=0"], "--tenant-weights"),
                      (["--sjf-aging-rate", "0"], "--sjf-aging-rate")):
        with pytest.raises(SystemExit) as exc:
            serve_main(bad)
        assert exc.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err


def test_aging_and_priority_preemption_flags_reach_the_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    default = scheduler_config(parser.parse_args([]), _info(8192))
    assert (default.aging_period, default.priority_preemption_threshold) == (10.0, None)
    args = parser.parse_args(["--scheduling-policy", "priority", "--aging-period", "2.5",
                              "--priority-preemption-threshold", "3"])
    config = scheduler_config(args, _info(8192))
    assert (config.scheduling_policy, config.aging_period, config.priority_preemption_threshold) == ("priority", 2.5, 3)
    # a threshold without the priority policy is refused before the model loads
    assert serve_main(["--priority-preemption-threshold", "3"]) == 2
    assert ("argument --priority-preemption-threshold: needs --scheduling-policy='priority'"
            in capsys.readouterr().err)
    for bad in (["--aging-period", "0"], ["--stream-stall-timeout", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "must be > 0" in capsys.readouterr().err


def test_help_explains_the_new_flags() -> None:
    text = build_parser().format_help()
    for flag, words in (("--aging-period", "priority level"), ("--priority-preemption-threshold", "preempts"),
                        ("--stream-stall-timeout", "read")):
        assert flag in text
        assert words in " ".join(text.rsplit(flag, 1)[1].split()[:40])  # its help, not the usage line


def test_the_startup_heap_is_frozen_out_of_full_collections() -> None:
    """What start-up allocated is never traversed again; young collections come rarer."""
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    startup = [[i] for i in range(5000)]  # stands in for the tokenizer's objects
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= frozen + len(startup)
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD > threshold[0]
        in_gen2 = {id(o) for o in gc.get_objects(2)}
        assert not in_gen2 & {id(x) for x in startup}  # frozen objects are in no generation
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_each_serve_flag_s_help_is_short() -> None:
    """A line or two each (details live in docs/cpu.md and the docs), the scheduler's flags
    (declared in scheduler/flags.py) included."""
    parser = build_parser()
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        text = action.help % {**vars(action), "prog": parser.prog}
        assert len(text) <= 130, (action.option_strings, len(text), text)


def test_log_level_reaches_the_worker_config() -> None:
    parser = build_parser()
    assert worker_config(parser.parse_args([])).log_level == "info"
    assert worker_config(parser.parse_args(["--log-level", "debug"])).log_level == "debug"
