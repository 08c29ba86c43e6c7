"""The sampler: greedy, filters, penalties, seeds, the sampled distribution and logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from scheduler.sampling import SamplingParams
from worker.execution.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

# probs 0.5, 0.3, 0.15, 0.05
FOUR = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def meta(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators or [None] * n,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
    )


def draw(row: torch.Tensor, params: SamplingParams, n: int = 4000, seed: int = 0) -> Counter[int]:
    """Sample `n` times from the same logits row in one batch."""
    out = Sampler(seed=seed).sample(row.repeat(n, 1), meta([params] * n))
    return Counter(out.token_ids)


def chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    n = sum(counts.values())
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs.tolist()))


def test_greedy_is_argmax_even_next_to_random_rows() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0.0)
    out = Sampler(seed=0).sample(logits, meta([greedy] * 6))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    mixed = [greedy, SamplingParams(), greedy, SamplingParams(top_p=0.5), greedy, greedy]
    out = Sampler(seed=0).sample(logits, meta(mixed))
    for i in (0, 2, 4, 5):
        assert out.token_ids[i] == int(logits[i].argmax())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=1e-7)],
    ids=["top_k=1", "tiny top_p", "tiny temperature"],
)
def test_settings_that_leave_one_token_are_greedy(params: SamplingParams) -> None:
    logits = torch.randn(200, 30, generator=torch.Generator().manual_seed(2))
    out = Sampler(seed=3).sample(logits, meta([params] * 200))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_the_k_most_likely_and_samples_in_proportion() -> None:
    counts = draw(FOUR, SamplingParams(top_k=2))
    assert set(counts) == {0, 1}
    assert chi_square(counts, torch.tensor([0.625, 0.375])) < 10.83  # p = 0.001, 1 dof


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # 0.5 < 0.7, so token 1 is needed; 0.5 + 0.3 >= 0.7, so token 2 is not.
    counts = draw(FOUR, SamplingParams(top_p=0.7))
    assert set(counts) == {0, 1}
    assert chi_square(counts, torch.tensor([0.625, 0.375])) < 10.83


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    # threshold 0.5 * 0.5 = 0.25: tokens 0 (0.5) and 1 (0.3) stay.
    filtered = apply_min_p(FOUR.unsqueeze(0), torch.tensor([0.5]))
    assert torch.isinf(filtered[0, 2:]).all() and torch.isfinite(filtered[0, :2]).all()
    assert set(draw(FOUR, SamplingParams(min_p=0.5))) == {0, 1}


def test_disabled_top_k_and_top_p_change_nothing() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(4))
    ks = torch.tensor([10, 10, 10])
    assert torch.equal(apply_top_k_top_p(logits, ks, None), logits)
    assert torch.equal(apply_top_k_top_p(logits, ks, torch.tensor([2.0, 2.0, 2.0])), logits)
    for params in (SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_k=99)):
        assert set(draw(FOUR, params, n=2000)) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_matches_the_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    counts = draw(logits, SamplingParams(temperature=temperature), n=20000)
    assert chi_square(counts, torch.softmax(logits / temperature, dim=0)) < 18.47  # p = 0.001


def test_seeded_rows_sample_the_softmax_too() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 4000
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(s) for s in range(n)]
    params = [SamplingParams(seed=s) for s in range(n)]
    out = Sampler().sample(logits.repeat(n, 1), meta(params, gens))
    assert chi_square(Counter(out.token_ids), torch.softmax(logits, dim=0)) < 18.47


def seeded_tokens(batch_logits: list[torch.Tensor], row: int, others: int, steps: int) -> list[int]:
    """Tokens of one seed-7 request sampled at `row` of a batch with `others` other rows."""
    gen = torch.Generator().manual_seed(7)
    other_params = [SamplingParams(seed=100 + i) if i % 2 else SamplingParams(top_k=5)
                    for i in range(others)]
    other_gens = [torch.Generator().manual_seed(100 + i) if i % 2 else None
                  for i in range(others)]
    params = other_params[:row] + [SamplingParams(seed=7)] + other_params[row:]
    gens = other_gens[:row] + [gen] + other_gens[row:]
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        noise = torch.randn(others, 100, generator=torch.Generator().manual_seed(step + 50 * row))
        logits = torch.cat([noise[:row], batch_logits[step].unsqueeze(0), noise[row:]])
        tokens.append(sampler.sample(logits, meta(params, gens)).token_ids[row])
    return tokens


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch() -> None:
    steps = [torch.randn(100, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    alone = seeded_tokens(steps, row=0, others=0, steps=8)
    assert seeded_tokens(steps, row=0, others=5, steps=8) == alone
    assert seeded_tokens(steps, row=3, others=6, steps=8) == alone
    assert seeded_tokens(steps, row=2, others=2, steps=8) == alone
    flat = torch.zeros(100)
    assert seeded_tokens([flat] * 8, row=0, others=0, steps=8) != [alone[0]] * 8


def test_greedy_rows_leave_their_generator_untouched() -> None:
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    Sampler().sample(torch.randn(1, 20), meta([SamplingParams(temperature=0.0, seed=5)], [gen]))
    assert torch.equal(gen.get_state(), before)


def test_penalties_change_exactly_the_right_logits() -> None:
    row = torch.tensor([2.0, 2.0, -2.0, -2.0, 1.0, 1.0])
    rep = SamplingParams(repetition_penalty=2.0)
    freq_pres = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.stack([row, row, row])
    m = meta([rep, freq_pres, SamplingParams()], prompts=[[0, 2]] * 3, outputs=[[4, 3, 3]] * 3)
    out = apply_penalties(logits, m)
    # repetition: seen tokens 0, 2 (prompt), 3, 4 (output); positive / 2, negative * 2
    assert out[0].tolist() == [1.0, 2.0, -4.0, -4.0, 0.5, 1.0]
    # frequency counts output tokens only (3 twice, 4 once); presence once per output token
    assert out[1].tolist() == [2.0, 2.0, -2.0, -3.25, 0.25, 1.0]
    assert torch.equal(out[2], row)
    assert torch.equal(logits[0], row)  # the input is not modified


def test_greedy_sampling_sees_the_penalties() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler().sample(logits, meta([params], outputs=[[0]]))
    assert out.token_ids == [1]


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=10, logprobs=5),
    ]
    out = Sampler(seed=0).sample(logits, meta(params, prompts=[[1, 2, 3]] * 4))
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row, n in ((0, 3), (1, 0), (3, 5)):
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.logprob == pytest.approx(float(expected[row, out.token_ids[row]]), abs=1e-5)
        top_vals, top_ids = expected[row].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_vals.tolist(), abs=1e-5)


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    from worker.execution.sampler import Sampler, SamplingMetadata

    logits = torch.zeros(3, 8)
    logits[:, 2] = 10.0  # EOS is by far the most likely token
    logits[:, 5] = 9.0  # then a stop token id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, ignore_eos=True),
    ]
    meta = SamplingMetadata(params, [None] * 3, [[1]] * 3, [[7], [7, 7, 7], [7]], eos_token_ids=(2,))
    out = Sampler(seed=0).sample(logits, meta)
    # row 0: under min_tokens, EOS and 5 banned; row 1: reached, EOS wins;
    # row 2: ignore_eos means EOS is no stop token, so it is not banned
    assert out.token_ids[1] == 2 and out.token_ids[2] == 2
    assert out.token_ids[0] not in (2, 5)
