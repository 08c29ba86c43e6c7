"""Scheduler basics: validation, chunking, stops, aborts, overlap (two plans in flight)."""

from __future__ import annotations

import pytest
from sched_driver import EOS, MirrorWorker, drive, make_request

from scheduler import (
    ModelRunnerOutput,
    Request,
    SamplingParams,
    SamplingParamsError,
    Scheduler,
    SchedulerConfig,
)


def _sched(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(max_num_batched_tokens=64, num_gpu_blocks=64, block_size=16, max_model_len=512)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"preemption_mode": "swap"}, "num_cpu_blocks"),
        ({"preemption_mode": "drop", "num_cpu_blocks": 4}, "preemption_mode"),
        ({"aging_period": 0}, "aging_period"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 256, "max_model_len": 512}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": 8, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096}, "long_prefill_token_threshold"),
        ({"priority_preemption_threshold": 2}, "priority_preemption_threshold"),
        ({"victim_policy": "oldest"}, "victim_policy"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(SamplingParamsError, match=param) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_add_request_rejects_duplicates_and_misfits() -> None:
    s = _sched(num_gpu_blocks=8, max_model_len=512)
    s.add_request(make_request("a", 10, 5))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("a", 10, 5))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("b", 500, 100))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("c", 200, 10))
    with pytest.raises(ValueError, match="at least one token"):
        Request("d", [], SamplingParams(), 0.0)
    assert list(s.requests) == ["a"]
    s.check_integrity()


def test_long_prefill_threshold_caps_chunks() -> None:
    s = _sched(long_prefill_token_threshold=24)
    s.add_request(make_request("a", 100, 2))
    chunks: list[int] = []
    drive(s, MirrorWorker(16, 64), on_step=lambda i, p: chunks.append(p.num_scheduled_tokens.get("a", 0)))
    assert chunks == [24, 24, 24, 24, 4, 1, 0]  # the last plan only reports "a" finished


def test_no_chunking_waits_for_budget() -> None:
    s = _sched(enable_chunked_prefill=False, max_num_batched_tokens=512)
    s.add_request(make_request("a", 400, 3))
    s.add_request(make_request("b", 200, 3))
    plan = s.schedule(now=0)
    assert plan.num_scheduled_tokens == {"a": 400}  # b would not fit whole: head-of-line wait


def _eos_at(rid_pos: dict[str, int]) -> MirrorWorker:
    """Worker whose request emits EOS at the given output position (1-based)."""

    def tok(rid: str, pos: int) -> int:
        return EOS if rid_pos.get(rid) == pos else 1000 + pos

    return MirrorWorker(16, 64, next_token=tok)


def test_stop_conditions() -> None:
    s = _sched()
    s.add_request(make_request("eos", 10, 50, ignore_eos=False))
    s.add_request(make_request("ignore", 10, 6, ignore_eos=True))
    s.add_request(make_request("min", 10, 50, ignore_eos=False, min_tokens=8))
    s.add_request(make_request("stopid", 10, 50, stop_token_ids=[1014]))
    reqs = dict(s.requests)
    # output k of a 10-token prompt is sampled when the sequence holds 10 + k - 1 tokens
    drive(s, _eos_at({"eos": 12, "ignore": 11, "min": 12}))
    assert (reqs["eos"].num_output_tokens, reqs["eos"].finish_reason) == (3, "stop")
    assert reqs["eos"].output_token_ids[-1] == EOS and reqs["eos"].stop_token_id is None
    assert (reqs["ignore"].num_output_tokens, reqs["ignore"].finish_reason) == (6, "length")
    assert reqs["min"].num_output_tokens == 50  # its only EOS came before min_tokens
    assert (reqs["stopid"].num_output_tokens, reqs["stopid"].finish_reason) == (5, "stop")
    assert reqs["stopid"].stop_token_id == 1014


def test_max_model_len_stops() -> None:
    s = _sched(max_model_len=40)
    r = make_request("a", 30, 10)
    s.add_request(r)
    drive(s, MirrorWorker(16, 64))
    assert r.num_tokens == 40 and r.finish_reason == "length"


@pytest.mark.parametrize("where", ["waiting", "running", "mid_prefill", "preempted", "swapped"])
def test_abort_frees_everything(where: str) -> None:
    kw: dict[str, object] = {"num_gpu_blocks": 6, "max_num_batched_tokens": 32, "max_model_len": 96}
    if where == "swapped":
        kw |= {"preemption_mode": "swap", "num_cpu_blocks": 8}
    s = _sched(**kw)
    w = MirrorWorker(16, 6)
    s.add_request(make_request("old", 16, 64))
    s.add_request(make_request("x", 40 if where == "mid_prefill" else 16, 48))
    target = {"waiting": "WAITING", "running": "RUNNING", "mid_prefill": "RUNNING"}.get(where)
    for _ in range(200):
        x = s.requests["x"]
        if where in ("waiting", "mid_prefill") and x.status.name == (target or "") and (
            where == "waiting" or 0 < x.num_computed_tokens < x.num_prompt_tokens
        ):
            break
        if where == "running" and x.status.name == "RUNNING" and x.num_output_tokens > 2:
            break
        if where in ("preempted", "swapped") and x.status.name == where.upper():
            break
        plan = s.schedule(now=0)
        s.update_from_output(plan, w.execute(plan), now=0)
    else:
        raise AssertionError(f"never reached {where}")
    was_known = where != "waiting"
    s.abort("x")
    s.abort("no-such-request")
    s.check_integrity()
    plan = s.schedule(now=1)
    assert ("x" in plan.aborted_req_ids) == was_known
    assert "x" not in plan.num_scheduled_tokens
    s.update_from_output(plan, w.execute(plan), now=1)
    drive(s, w)
    assert s.num_free_blocks == 6 and len(s.kv.host_free) == s.config.num_cpu_blocks


def test_overlap_decode_is_planned_before_its_token_arrives() -> None:
    s = _sched()
    w = MirrorWorker(16, 64)
    s.add_request(make_request("a", 8, 5))
    p0 = s.schedule(now=0)
    o0 = w.execute(p0)
    p1 = s.schedule(now=0)  # output 0 not applied yet
    assert p1.num_scheduled_tokens == {"a": 1}
    o1 = w.execute(p1)
    outs0 = s.update_from_output(p0, o0, now=0)
    outs1 = s.update_from_output(p1, o1, now=0)
    assert [o.new_token_ids for o in outs0 + outs1] == [(o0.sampled_token_ids["a"],), (o1.sampled_token_ids["a"],)]


def test_overlap_discards_token_after_finish_and_frees_blocks() -> None:
    s = _sched()
    w = _eos_at({"a": 8})  # first output is EOS
    r = make_request("a", 8, 5, ignore_eos=False)
    s.add_request(r)
    p0 = s.schedule(now=0)
    o0 = w.execute(p0)
    p1 = s.schedule(now=0)
    o1 = w.execute(p1)
    assert "a" in o1.sampled_token_ids  # the worker did compute an extra token
    outs = s.update_from_output(p0, o0, now=0)
    assert outs[0].finished and outs[0].finish_reason == "stop"
    assert s.num_free_blocks == 64  # freed at once, while plan 1 is still in flight
    assert s.update_from_output(p1, o1, now=0) == []  # the extra token is discarded
    p2 = s.schedule(now=0)
    assert p2.finished_req_ids == {"a"} and p2.is_empty
    assert r.output_token_ids == [EOS]


def test_overlap_does_not_overshoot_max_tokens() -> None:
    s = _sched()
    w = MirrorWorker(16, 64)
    r = make_request("a", 8, 1)
    s.add_request(r)
    p0 = s.schedule(now=0)
    p1 = s.schedule(now=0)
    assert p1.is_empty  # its only token is in flight
    s.update_from_output(p0, w.execute(p0))
    s.update_from_output(p1, w.execute(p1))
    assert r.num_output_tokens == 1 and not s.has_unfinished_requests()


def test_worker_error_aborts_the_step_requests() -> None:
    s = _sched()
    s.add_request(make_request("a", 8, 5))
    plan = s.schedule(now=0)
    outs = s.update_from_output(plan, ModelRunnerOutput(plan.step_id, {}, error="boom"))
    assert outs[0].finished and outs[0].finish_reason == "abort"
    assert s.num_free_blocks == 64 and not s.has_unfinished_requests()


def test_stats_snapshot() -> None:
    s = _sched(enable_prefix_caching=True)
    prompt = list(range(100, 140))
    s.add_request(make_request("a", 40, 4, prompt=prompt))
    s.add_request(make_request("b", 40, 4, prompt=prompt))
    s.schedule(now=0)
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.step_num_reqs) == (2, 0, 2)
    assert st.step_prefill_tokens == 40 + 8 and st.step_decode_tokens == 0
    assert st.prefix_cache_queries == 80 and st.prefix_cache_hits == 32
    assert st.kv_cache_usage == pytest.approx(4 / 64)  # 2 shared blocks + a tail block each
