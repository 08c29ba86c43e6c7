"""The sampler's token controls: logit_bias, allowed_token_ids and bad words, on greedy and
random rows, mixed with plain rows, across steps, with the other filters, and end to end
through the real scheduler and model runner."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from sched_driver import drive
from tiny_models import make_tiny_hf_model
from torch.overrides import TorchFunctionMode
from worker_modes import REFERENCE

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from worker.config import WorkerConfig
from worker.execution.model_runner import ModelRunner
from worker.execution.sampler import Sampler, SamplingMetadata
from worker.execution.token_controls import apply_token_controls

VOCAB = 12
# Raw logits with a clear order: token 0 most likely, then 1, 2, ...
RANKED = torch.linspace(3.0, -3.0, VOCAB)
GREEDY = SamplingParams(temperature=0.0)


def meta(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    outputs: list[list[int]] | None = None,
    eos: tuple[int, ...] = (),
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators or [None] * n,
        prompt_token_ids=[[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        eos_token_ids=eos,
    )


def one(row: torch.Tensor, params: SamplingParams, output: list[int] | None = None) -> int:
    out = Sampler(seed=0).sample(row.unsqueeze(0), meta([params], outputs=[output or []]))
    return out.token_ids[0]


def draw(row: torch.Tensor, params: SamplingParams, n: int = 3000) -> Counter[int]:
    """`n` random draws from the same logits row, all in one batch."""
    out = Sampler(seed=1).sample(row.repeat(n, 1), meta([params] * n))
    return Counter(out.token_ids)


def chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    n = sum(counts.values())
    expected = {t: n * p for t, p in enumerate(probs.tolist()) if p > 0}
    assert set(counts) <= set(expected), f"sampled a token of probability 0: {counts}"
    return sum((counts.get(t, 0) - e) ** 2 / e for t, e in expected.items())


class OpRecorder(TorchFunctionMode):
    """Records the name of every torch function and tensor method called while active;
    attribute reads (`.shape`, `.device`) touch no data and are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", repr(func))
        if name != "__get__":
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


# ---- logit_bias ---------------------------------------------------------------------------


def test_bias_of_plus_100_forces_and_minus_100_bans_on_greedy_rows() -> None:
    assert one(RANKED, GREEDY) == 0
    assert one(RANKED, SamplingParams(temperature=0.0, logit_bias=[(7, 100.0)])) == 7
    assert one(RANKED, SamplingParams(temperature=0.0, logit_bias=[(0, -100.0)])) == 1
    # a small bias is added, not a ban or a force: 1.0 lifts token 1 past token 0's lead
    lead = float(RANKED[0] - RANKED[1])
    assert one(RANKED, SamplingParams(temperature=0.0, logit_bias=[(1, lead + 0.1)])) == 1
    assert one(RANKED, SamplingParams(temperature=0.0, logit_bias=[(1, lead - 0.1)])) == 0


def test_bias_of_plus_100_forces_and_minus_100_bans_on_random_rows() -> None:
    flat = torch.zeros(VOCAB)
    assert set(draw(flat, SamplingParams(logit_bias=[(5, 100.0)]))) == {5}
    banned = draw(flat, SamplingParams(logit_bias=[(5, -100.0), (6, -100.0)]))
    assert 5 not in banned and 6 not in banned and len(banned) == VOCAB - 2


def test_random_rows_sample_the_softmax_of_the_biased_logits() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    bias = [(4, 2.0), (0, -1.0)]
    counts = draw(logits, SamplingParams(logit_bias=bias), n=20000)
    biased = logits + torch.tensor([-1.0, 0.0, 0.0, 0.0, 2.0])
    assert chi_square(counts, biased.softmax(dim=0)) < 18.47  # p = 0.001, 4 dof


def test_bias_comes_before_the_repetition_penalty() -> None:
    # token 1 (seen in the prompt) at 2.0 + bias 2.0 = 4.0, halved by the penalty to 2.0,
    # loses to token 0 at 2.5; penalising first (1.0 + 2.0 = 3.0) would have picked it.
    logits = torch.tensor([[2.5, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias=[(1, 2.0)])
    m = meta([params])
    m.prompt_token_ids = [[1]]
    assert Sampler().sample(logits, m).token_ids == [0]


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias=[(9, 100.0)],
                            allowed_token_ids=[3, 9])
    out = Sampler().sample(RANKED.unsqueeze(0), meta([params]))
    raw = torch.log_softmax(RANKED, dim=0)
    lp = out.logprobs[0]
    assert out.token_ids == [9] and lp is not None
    assert lp.logprob == pytest.approx(float(raw[9]), abs=1e-5)
    assert [t for t, _ in lp.top] == [0, 1]


# ---- allowed_token_ids --------------------------------------------------------------------


def test_allowed_ids_pick_the_best_allowed_token_on_greedy_rows() -> None:
    assert one(RANKED, SamplingParams(temperature=0.0, allowed_token_ids=[4, 9, 6])) == 4
    assert one(RANKED, SamplingParams(temperature=0.0, allowed_token_ids=[11])) == 11


def test_allowed_ids_on_random_rows_renormalise_over_the_allowed_set() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5, 2.0])
    allowed = [1, 2, 4]
    counts = draw(logits, SamplingParams(allowed_token_ids=allowed), n=20000)
    probs = torch.zeros(6)
    probs[allowed] = logits[allowed].softmax(dim=0)
    assert chi_square(counts, probs) < 13.82  # p = 0.001, 2 dof


def test_allowed_ids_come_before_top_k_and_top_p() -> None:
    allowed = [2, 5, 8, 11]
    # top-k 2 keeps the two best *allowed* tokens, not the two best overall (0 and 1)
    assert set(draw(RANKED, SamplingParams(allowed_token_ids=allowed, top_k=2))) == {2, 5}
    # among the allowed, token 2 holds most of the mass: a small top-p keeps only it
    assert set(draw(RANKED, SamplingParams(allowed_token_ids=allowed, top_p=0.5))) == {2}
    assert set(draw(RANKED, SamplingParams(allowed_token_ids=allowed, top_k=3, top_p=0.999))) \
        == {2, 5, 8}


def test_bias_cannot_lift_a_token_outside_the_allowed_set() -> None:
    params = SamplingParams(allowed_token_ids=[3, 4], logit_bias=[(0, 100.0), (4, 1.0)])
    assert set(draw(torch.zeros(VOCAB), params)) == {3, 4}


# ---- bad words ----------------------------------------------------------------------------


def test_a_one_token_bad_word_is_always_banned() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[0], [1]])
    assert one(RANKED, params) == 2
    assert one(RANKED, params, output=[5, 6, 7]) == 2
    assert 0 not in draw(torch.zeros(VOCAB), SamplingParams(bad_words_token_ids=[[0]]))


def test_a_multi_token_bad_word_bans_its_last_token_only_after_the_rest() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5, 0]])
    assert one(RANKED, params) == 0  # nothing generated yet
    assert one(RANKED, params, output=[4]) == 0  # only part of the prefix
    assert one(RANKED, params, output=[5, 4]) == 0  # the prefix in the wrong order
    assert one(RANKED, params, output=[9, 4, 5]) == 1  # the output ends with 4, 5: 0 banned
    assert one(RANKED, params, output=[4, 5, 9]) == 0  # the prefix not at the end


def greedy_run(params: SamplingParams, steps: int, step_logits: list[torch.Tensor]) -> list[int]:
    """Greedy tokens of one request over `steps`, each step's logits from `step_logits`."""
    sampler = Sampler()
    output: list[int] = []
    for step in range(steps):
        row = step_logits[step % len(step_logits)]
        output.append(sampler.sample(row.unsqueeze(0), meta([params], outputs=[output]))
                      .token_ids[0])
    return output


def test_bad_words_follow_the_output_across_steps() -> None:
    # The model wants 3, 3, 3, ...; the bad word "3 3" forces something else after every 3.
    wants_3 = torch.zeros(VOCAB)
    wants_3[3], wants_3[7] = 5.0, 4.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 3]])
    assert greedy_run(params, 6, [wants_3]) == [3, 7, 3, 7, 3, 7]
    # The model cycles 1, 2, 3; the word "1 2 3" bans 3 after "1 2", the word "2 4" then
    # bans 4 (the second best) after 2, so 5 comes instead.
    cycle = []
    for best in (1, 2, 3):
        row = torch.zeros(VOCAB)
        row[best], row[4], row[5] = 5.0, 4.0, 3.0
        cycle.append(row)
    assert greedy_run(SamplingParams(temperature=0.0), 6, cycle) == [1, 2, 3, 1, 2, 3]
    words = SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2, 3], [2, 4]])
    assert greedy_run(words, 6, cycle) == [1, 2, 5, 1, 2, 5]


def test_bad_words_match_the_output_not_the_prompt() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[6, 0]])
    m = meta([params])
    m.prompt_token_ids = [[1, 2, 6]]
    assert Sampler().sample(RANKED.unsqueeze(0), m).token_ids == [0]


def test_bias_cannot_lift_a_bad_word() -> None:
    params = SamplingParams(bad_words_token_ids=[[2]], logit_bias=[(2, 100.0)])
    assert 2 not in draw(torch.zeros(VOCAB), params)


# ---- how the controls meet min_tokens ------------------------------------------------------


def test_min_tokens_bans_eos_inside_the_allowed_set() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4,
                            allowed_token_ids=[0, 3, 5])
    m = meta([params, params], outputs=[[3], [3, 3]], eos=(0,))
    assert Sampler().sample(RANKED.repeat(2, 1), m).token_ids == [3, 0]


def test_bans_that_would_leave_nothing_keep_the_allowed_set() -> None:
    # allowed ids that are all bad words, and EOS as the only allowed token under
    # min_tokens: each row contradicts itself, and samples from its allowed ids.
    contradictions = [
        SamplingParams(temperature=0.0, allowed_token_ids=[4, 6], bad_words_token_ids=[[4], [6]]),
        SamplingParams(allowed_token_ids=[4, 6], bad_words_token_ids=[[4], [6]]),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5, allowed_token_ids=[0]),
    ]
    m = meta(contradictions, outputs=[[], [], [1]], eos=(0,))
    tokens = Sampler(seed=0).sample(RANKED.repeat(3, 1), m).token_ids
    assert tokens[0] == 4 and tokens[1] in (4, 6) and tokens[2] == 0


def test_a_token_id_past_the_vocabulary_names_its_field() -> None:
    cases = {
        "logit_bias": SamplingParams(logit_bias=[(VOCAB, 1.0)]),
        "allowed_token_ids": SamplingParams(allowed_token_ids=[1, VOCAB + 3]),
        "bad_words": SamplingParams(bad_words_token_ids=[[VOCAB, 1]]),
    }
    for name, params in cases.items():
        with pytest.raises(ValueError, match=f"^{name}: token id"):
            Sampler().sample(RANKED.unsqueeze(0), meta([params]))


# ---- batches: mixed rows, seeds, the fast path --------------------------------------------

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logit_bias=[(3, 2.5), (0, -100.0)]),
    SamplingParams(seed=11, allowed_token_ids=[1, 2, 3, 5, 8], top_k=3),
    SamplingParams(seed=12, bad_words_token_ids=[[0], [2, 1], [1, 1, 1]]),
    SamplingParams(seed=13),
    SamplingParams(seed=14, temperature=0.8, top_p=0.9, logit_bias=[(9, 1.5)],
                   allowed_token_ids=list(range(6, 12)), bad_words_token_ids=[[9, 9]]),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[0, 0]], repetition_penalty=1.3),
]


def run_rows(rows: list[int], steps: int) -> dict[int, list[int]]:
    """Tokens of the MIXED requests at `rows`, batched together, over `steps` steps; each
    request's logits at a step depend only on the request and the step."""
    params = [MIXED[r] for r in rows]
    gens: list[torch.Generator | None] = [
        torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
    ]
    outputs: list[list[int]] = [[] for _ in rows]
    sampler = Sampler(seed=0)
    for step in range(steps):
        logits = torch.stack([
            torch.randn(VOCAB, generator=torch.Generator().manual_seed(100 * r + step))
            for r in rows
        ])
        m = meta(params, gens, outputs=[list(o) for o in outputs])
        for out, token in zip(outputs, sampler.sample(logits, m).token_ids, strict=True):
            out.append(token)
    return dict(zip(rows, outputs, strict=True))


def test_rows_with_and_without_controls_sample_as_they_would_alone() -> None:
    # every row is greedy or seeded, so its tokens must not depend on its neighbours
    alone = {r: run_rows([r], 12)[r] for r in range(len(MIXED))}
    assert run_rows(list(range(len(MIXED))), 12) == alone
    assert run_rows([5, 0, 3], 12) == {r: alone[r] for r in (5, 0, 3)}
    # and the controls did act: no banned token was ever sampled
    assert 0 not in alone[1] and 0 not in alone[3]
    assert set(alone[2]) <= {1, 2, 3, 5, 8} and set(alone[5]) <= set(range(6, 12))
    assert not contains(alone[3], [2, 1]) and not contains(alone[3], [1, 1, 1])
    assert not contains(alone[6], [0, 0]) and not contains(alone[5], [9, 9])


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens)))


def test_seeded_rows_with_controls_repeat_and_seeds_differ() -> None:
    assert run_rows([2, 3, 5], 10) == run_rows([2, 3, 5], 10)
    other = SamplingParams(seed=99, allowed_token_ids=[1, 2, 3, 5, 8], top_k=3)
    flat = [torch.zeros(VOCAB)] * 10
    tokens: dict[int | None, list[int]] = {}
    for params in (MIXED[2], other):
        gen = torch.Generator().manual_seed(params.seed or 0)
        sampler = Sampler()
        tokens[params.seed] = [
            sampler.sample(row.unsqueeze(0), meta([params], [gen])).token_ids[0] for row in flat
        ]
    assert tokens[11] != tokens[99]


def test_an_all_greedy_batch_without_controls_is_one_argmax() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    plain = meta([GREEDY] * 5, outputs=[[1, 2]] * 5)
    with OpRecorder() as rec:
        out = Sampler().sample(logits, plain)
    assert rec.ops == ["argmax", "tolist"]
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    # one row with a control leaves the fast path (the spy can see a difference)
    biased = meta([GREEDY] * 4 + [SamplingParams(temperature=0.0, logit_bias=[(0, 1.0)])])
    with OpRecorder() as rec:
        Sampler().sample(logits, biased)
    assert "clone" in rec.ops and len(rec.ops) > 2


def test_rows_without_controls_skip_the_control_stage() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(top_k=3), SamplingParams(presence_penalty=1.0, min_tokens=2),
              SamplingParams(temperature=0.0, seed=4)]
    m = meta(params, outputs=[[1], [2, 3], []])
    with OpRecorder() as rec:
        same = apply_token_controls(logits, m)
    assert same is logits and rec.ops == []


# ---- end to end: the real scheduler and model runner ----------------------------------------

PROMPT = [(5 * j) % 250 + 3 for j in range(11)]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    target: Path = tmp_path_factory.mktemp("tiny") / "llama"
    make_tiny_hf_model().save_pretrained(target)
    cfg = WorkerConfig(model=str(target), block_size=4, kv_cache_memory=512 * 4 * 64,
                       **REFERENCE)
    return ModelRunner(cfg)


def generate(
    runner: ModelRunner, params: list[SamplingParams], overlap: bool = False
) -> list[list[int]]:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, num_gpu_blocks=40, block_size=4,
                                      max_model_len=64))
    reqs = [Request(f"r{i}", list(PROMPT), p, arrival_time=float(i))
            for i, p in enumerate(params)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, runner, overlap=overlap)
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("overlap", [False, True], ids=["one_plan", "two_plans_in_flight"])
def test_controls_reach_the_output_through_scheduler_and_runner(
    runner: ModelRunner, overlap: bool
) -> None:
    base: dict[str, Any] = dict(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, **base)
    [ref] = generate(runner, [plain])
    forced = next(t for t in range(40, 255) if t not in ref)
    controlled = [
        SamplingParams(temperature=0.0, logit_bias=[(forced, 100.0)], **base),
        SamplingParams(seed=3, logit_bias=[(forced, 100.0)], **base),
        SamplingParams(temperature=0.0, bad_words_token_ids=[ref[:2]], **base),
        SamplingParams(seed=5, allowed_token_ids=[forced, forced + 1], **base),
    ]
    outs = generate(runner, [plain, *controlled], overlap=overlap)
    assert outs[0] == ref  # the plain request, batched with controlled ones, is unchanged
    assert outs[1] == [forced] * NEW_TOKENS and outs[2] == [forced] * NEW_TOKENS
    # the bad word "ref[0] ref[1]" lets the first token through and bans the second
    assert outs[3][0] == ref[0] and outs[3][1] != ref[1]
    assert set(outs[4]) <= {forced, forced + 1}
