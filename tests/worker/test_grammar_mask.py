"""Structured outputs in the worker: the real scheduler drives the default model, and every
constrained output follows its grammar — for JSON schemas hypothesis draws, greedy and
sampled, beside unconstrained requests in the same steps, with two plans in flight and a KV
pool so small that requests are preempted and recomputed (or swapped) mid-output.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sched_driver import drive

from common.grammar import Constraint
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from worker.execution.token_controls import apply_grammar_mask

pytestmark = pytest.mark.slow

PROMPT_TEXTS = ["Describe a user as JSON:", "Here is the record:", "Output:"]


def _scalar() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 10)),
        st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 50}, st.integers(-20, 20)),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["red", "green", "blue", "cyan"]), min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
    )


def _schema(depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    leaf = _scalar()
    value = leaf if depth >= 1 else st.one_of(
        leaf,
        _scalar().map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
        st.deferred(lambda: _schema(depth + 1)),
    )
    return st.dictionaries(st.sampled_from(["id", "name", "tags", "ok", "level", "inner"]), value, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}
        )
    )


def _run(runner: Any, requests: list[Request], overlap: bool = True, **cfg: Any) -> Scheduler:
    base: dict[str, Any] = dict(max_num_batched_tokens=64, num_gpu_blocks=400, block_size=16, max_model_len=1024)
    base.update(cfg)
    sched = Scheduler(SchedulerConfig(**base))
    for r in requests:
        sched.add_request(r)
    drive(sched, runner, overlap=overlap)
    return sched


def _request(runner: Any, req_id: str, prompt: list[int], grammar: str | None, **params: Any) -> Request:
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 80), grammar=grammar, **params)
    return Request(req_id, prompt, sp, arrival_time=0.0, eos_token_ids=runner.info.eos_token_ids)


def _check_follows(runner: Any, grammar: str, schema: dict[str, Any], req: Request) -> bool:
    """A finished output validates; one cut by max_tokens is a prefix the grammar accepts.
    Returns whether it finished."""
    eos = set(runner.info.eos_token_ids)
    out = req.output_token_ids
    matcher = runner.grammars.compiler().matcher(grammar)
    assert matcher.consume_tokens(out), f"output leaves the grammar: {out}"
    if out and out[-1] in eos:
        assert req.finish_reason == "stop"
        text = runner_text(out[:-1])
        jsonschema.validate(json.loads(text), schema)
        return True
    assert req.finish_reason == "length"
    return False


_TOKENIZER: Any = None


def runner_text(ids: list[int]) -> str:
    return str(_TOKENIZER.decode(ids))


@pytest.fixture(scope="module", autouse=True)
def _tokenizer(smol_tokenizer: Any) -> None:
    global _TOKENIZER
    _TOKENIZER = smol_tokenizer


def _mixed_run(runner: Any, tokenizer: Any, schema: dict[str, Any], sampled: bool, tight: str) -> tuple[Scheduler, list[Request]]:
    """Three constrained requests and an unconstrained one in the same steps; `tight`: a KV
    pool of 6 blocks of 16 that the unconstrained one alone nearly fills."""
    grammar = Constraint("json", schema).grammar_text()
    params: dict[str, Any] = {"temperature": 0.9, "seed": 7} if sampled else {"temperature": 0.0}
    prompts = [tokenizer.encode(t) for t in PROMPT_TEXTS]
    reqs = [_request(runner, f"c{i}", p, grammar, **params) for i, p in enumerate(prompts)]
    reqs.append(_request(runner, "free", prompts[0], None, max_tokens=70, temperature=0.0, ignore_eos=True))
    cfg: dict[str, Any] = {}
    if tight != "none":
        cfg = {"num_gpu_blocks": 6, "max_num_batched_tokens": 32, "preemption_mode": tight, "num_cpu_blocks": 64}
    sched = _run(runner, reqs, **cfg)
    for r in reqs[:-1]:
        _check_follows(runner, grammar, schema, r)
    return sched, reqs


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, phases=[Phase.generate])
@given(schema=_schema(), sampled=st.booleans(), tight=st.sampled_from(["none", "recompute", "swap"]))
def test_constrained_outputs_follow_their_schema(smol_runner: Any, smol_tokenizer: Any, schema: dict[str, Any], sampled: bool, tight: str) -> None:
    _mixed_run(smol_runner, smol_tokenizer, schema, sampled, tight)


LONG = {"type": "object", "additionalProperties": False, "required": ["name", "scores", "level"], "properties": {
    "name": {"type": "string", "minLength": 4, "maxLength": 10},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 4, "maxItems": 4},
    "level": {"enum": ["low", "high"]}}}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_mid_output_the_grammar_resumes_where_it_stood(smol_runner: Any, smol_tokenizer: Any, mode: str) -> None:
    sched, reqs = _mixed_run(smol_runner, smol_tokenizer, LONG, sampled=False, tight=mode)
    assert sched.num_preemptions > 0
    assert sum(_check_follows(smol_runner, Constraint("json", LONG).grammar_text(), LONG, r) for r in reqs[:-1]) >= 1


def test_greedy_json_completes_and_leaves_other_rows_alone(smol_runner: Any, smol_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = Constraint("json", schema).grammar_text()
    prompt = smol_tokenizer.encode(PROMPT_TEXTS[0])
    free_alone = _request(smol_runner, "alone", prompt, None, max_tokens=30, temperature=0.0, ignore_eos=True)
    _run(smol_runner, [free_alone])
    constrained = _request(smol_runner, "json", prompt, grammar, temperature=0.0)
    free = _request(smol_runner, "free", prompt, None, max_tokens=30, temperature=0.0, ignore_eos=True)
    _run(smol_runner, [constrained, free])
    assert _check_follows(smol_runner, grammar, schema, constrained)
    assert free.output_token_ids == free_alone.output_token_ids
    assert free.output_token_ids != constrained.output_token_ids[: len(free.output_token_ids)]


@pytest.mark.parametrize("constraint", [
    Constraint("choice", ["yes", "no", "maybe"]),
    Constraint("regex", r"[0-9]{3}-[0-9]{4}"),
    Constraint("grammar", 'root ::= "(" [a-z]+ ")"'),  # GBNF
    Constraint("grammar", 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,3}/'),  # Lark
])
def test_other_constraints_end_with_stop(smol_runner: Any, smol_tokenizer: Any, constraint: Constraint) -> None:
    grammar = constraint.grammar_text()
    req = _request(smol_runner, "r", smol_tokenizer.encode("Answer:"), grammar, temperature=0.0, max_tokens=40)
    _run(smol_runner, [req])
    assert req.finish_reason == "stop" and req.output_token_ids[-1] in smol_runner.info.eos_token_ids
    text = runner_text(req.output_token_ids[:-1])
    if constraint.format == "choice":
        assert text in constraint.spec
    elif constraint.format == "regex":
        assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
    assert smol_runner.grammars.compiler().matcher(grammar).consume_tokens(req.output_token_ids)


def test_min_tokens_cannot_push_a_finished_grammar_off_its_end(smol_runner: Any, smol_tokenizer: Any) -> None:
    """min_tokens bans EOS, the only token a finished choice allows: the grammar wins, and
    its EOS ends the request."""
    grammar = Constraint("choice", ["yes", "no"]).grammar_text()
    req = _request(smol_runner, "r", smol_tokenizer.encode("Answer:"), grammar, temperature=0.0, max_tokens=10, min_tokens=6)
    _run(smol_runner, [req])
    assert runner_text(req.output_token_ids[:-1]) in ("yes", "no")
    assert req.finish_reason == "stop"


def test_grammar_mask_falls_back_to_the_grammar_alone() -> None:
    raw = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    controlled = raw.clone()
    controlled[0, 1] = float("-inf")  # another control banned the only token row 0's grammar allows
    allowed = torch.tensor([[False, True, False, False], [True, False, True, False]])
    out = apply_grammar_mask(controlled, raw, allowed)
    assert out[0].tolist() == [float("-inf"), 2.0, float("-inf"), float("-inf")]
    assert out[1].tolist() == [1.0, float("-inf"), 3.0, float("-inf")]
    assert apply_grammar_mask(controlled, raw, None) is controlled


def test_prepare_compiles_in_the_background_once(smol_tokenizer: Any) -> None:
    from common.grammar import GrammarCompiler, tokenizer_json
    from worker.execution.grammar_masks import GrammarMasks
    from worker.execution.input_batch import RequestState

    built: list[GrammarCompiler] = []

    def make() -> GrammarCompiler:
        built.append(GrammarCompiler(lambda: tokenizer_json(smol_tokenizer.backend_tokenizer), 49152, 2))
        return built[0]

    masks = GrammarMasks(make)
    grammar = Constraint("regex", "[ab]{3}").grammar_text()
    masks.prepare(grammar)
    masks.prepare(grammar)  # a second request with the same grammar: no second compile
    state = RequestState("r", [1, 2], SamplingParams(grammar=grammar), None)
    allowed = masks.bitmask([state, RequestState("free", [1], SamplingParams(), None)], 49152)
    assert allowed is not None and len(built) == 1 and built[0].compiles == 1
    a, b = smol_tokenizer.encode("a", add_special_tokens=False)[0], smol_tokenizer.encode("b", add_special_tokens=False)[0]
    assert allowed[0, a] and allowed[0, b] and int(allowed[0].sum()) < 100
    assert bool(allowed[1].all())
    masks.advance([state], [a])
    assert state.matcher is not None and not state.matcher.is_error()
