"""The sampler: one batch of logits in, one token per row out (vLLM semantics).

Order of operations, per row::

    raw logits ──▶ logprobs (log-softmax of the raw logits, when asked)
        │
        ▼ bans (-inf): every token outside allowed_token_ids; the last token of each bad
        │   word whose other tokens end the output; EOS and stop token ids while the row
        │   has fewer than min_tokens outputs
        ▼ logit_bias: added to the logits
        ▼ penalties: repetition (prompt + output tokens), frequency and presence (output)
        ▼ grammar (structured outputs): -inf outside the tokens the row's grammar allows
        ├──▶ greedy rows (temperature 0 or top-k 1): argmax
        ▼ random rows: temperature ─▶ min-p ─▶ top-k ─▶ top-p ─▶ exponential race

This is vLLM v1's order. A ban is -inf and a bias finite, so a banned token stays banned
whatever its bias; the bias comes before the penalties, so a repetition penalty scales a
biased logit. The returned logprobs are those of the raw logits: they show neither bans
nor bias (vLLM's default). Bad words match the output tokens only, not the prompt (vLLM).
A row whose bans would leave no token at all (its allowed ids are all bad words, say)
keeps only its allowed_token_ids for that step: the request contradicts itself, and the
allow-list is the one control that says what may be sampled.

Every stage runs only on the rows that use it, and is skipped when no row does: an
all-greedy batch without token controls, penalties or logprobs is a single argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.output import TokenLogprobs
from scheduler.sampling import SamplingParams
from worker.execution.logprobs import token_logprobs
from worker.execution.token_controls import apply_grammar_mask, apply_token_controls

# Below this temperature a row is sampled greedily (dividing by it would overflow).
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row inputs to one `Sampler.sample` call; all lists are indexed like the logits."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per-request generator for seeded rows
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_ids: tuple[int, ...] = ()  # the model's; banned with stop ids under min_tokens
    grammar_allowed: torch.Tensor | None = None  # [rows, vocab] bool: structured outputs


@dataclass
class SamplerOutput:
    """One sampled token per row, with its logprobs when the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row; unseeded rows share one generator seeded by `seed`."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` ([num_rows, vocab], float32) under each row's parameters."""
        params = meta.params
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[want_logprobs].float(), dim=-1) if want_logprobs else None
        )
        raw = logits
        logits = apply_token_controls(logits, meta)
        logits = apply_penalties(logits, meta)
        logits = apply_grammar_mask(logits, raw, meta.grammar_allowed)
        greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
        if len(greedy) == len(params):
            sampled = logits.argmax(dim=-1)
        else:
            sampled = torch.empty(len(params), dtype=torch.long, device=logits.device)
            if greedy:
                sampled[greedy] = logits[greedy].argmax(dim=-1)
            rand = [i for i, p in enumerate(params) if not _is_greedy(p)]
            sampled[rand] = self._sample_random(logits[rand], [params[i] for i in rand],
                                                [meta.generators[i] for i in rand])
        token_ids = sampled.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if raw_logprobs is not None:
            counts = [params[i].logprobs or 0 for i in want_logprobs]
            gathered = token_logprobs(raw_logprobs, sampled[want_logprobs], counts)
            for row, lp in zip(want_logprobs, gathered, strict=True):
                logprobs[row] = lp
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p, then one draw per row."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
            logits = apply_min_p(logits, min_p)
        top_k = None
        if any(p.top_k > 1 for p in params):
            vocab = logits.shape[-1]
            ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
            top_k = torch.tensor(ks, dtype=torch.long, device=device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            # 2.0 for rows without top-p: float rounding of the cumulative sum can never
            # drop their tail tokens.
            ps = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
            top_p = torch.tensor(ps, dtype=logits.dtype, device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
        return self._exponential_race(logits.softmax(dim=-1), generators)

    def _exponential_race(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """argmax(probs / q) with q ~ Exp(1) draws a token with probability probs.

        Seeded rows draw q from their own generator, one vocab-sized draw per step, so
        their tokens do not depend on what else is in the batch.
        """
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            shared = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype,
                                 device=probs.device)
            q[unseeded] = shared.exponential_(generator=self._shared_generator(probs.device))
        for i, gen in enumerate(generators):
            if gen is not None:
                q[i].exponential_(generator=gen)
        # exponential_ may return exactly 0 in float32; a tiny floor keeps 0/0 out.
        return (probs / q.clamp_min_(1e-10)).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._shared[device]


def _is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < _MIN_TEMPERATURE


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, frequency and presence over output.

    Returns `logits` itself when no row has a penalty, else a new tensor.
    """
    rows = [i for i, p in enumerate(meta.params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0]
    if not rows:
        return logits
    logits = logits.clone()
    sub = logits[rows]
    params = [meta.params[i] for i in rows]
    outputs = [meta.output_token_ids[i] for i in rows]
    counts = _token_counts(outputs, sub.shape[1], sub.device)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts > 0
        seen |= _token_counts([meta.prompt_token_ids[i] for i in rows], sub.shape[1],
                              sub.device) > 0
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype,
                           device=sub.device).unsqueeze(1).expand_as(sub)
        rep = torch.where(seen, rep, torch.ones_like(rep))
        sub = torch.where(sub > 0, sub / rep, sub * rep)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=sub.device)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=sub.device)
    sub = sub - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(sub.dtype)
    logits[rows] = sub
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id in each list."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32)
    row_ids = [r for r, toks in enumerate(token_lists) for _ in toks]
    if row_ids:
        flat = [t for toks in token_lists for t in toks]
        counts.index_put_((torch.tensor(row_ids), torch.tensor(flat)),
                          torch.ones(len(flat)), accumulate=True)
    return counts.to(device)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k logits, then its smallest set with probability mass >= top_p.

    `top_k` holds vocab for rows without a limit; `top_p` holds a value above 1 for rows
    without one.
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        assert top_k is not None
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token; the top token always has 0 there, so it stays.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
