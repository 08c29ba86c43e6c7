"""Log-probabilities as the API returns them: a token's logprob, its rank and the top
alternatives at its position, for sampled tokens (the sampler) and prompt tokens
(`ModelRunner`'s prompt_logprobs), each row copied to the host once."""

from __future__ import annotations

import torch

from scheduler.output import TokenLogprobs
from scheduler.sampling import SamplingParams


def token_logprobs(logprobs: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Row i's logprob of `targets[i]`, its rank, and the row's top `k`, one copy each."""
    target = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_vals: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    return [
        TokenLogprobs(logprob=lp, top=tuple(zip(ids, vals, strict=True)), rank=rank)
        for lp, ids, vals, rank in zip(
            chosen.squeeze(1).tolist(), top_ids, top_vals, ranks, strict=True
        )
    ]


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs]:
    """The sampled token's logprob and the top-n alternatives, one device-to-host copy each."""
    chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    max_n = max(p.logprobs or 0 for p in params)
    top_vals: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if max_n > 0:
        vals, ids = logprobs.topk(max_n, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for r, p in enumerate(params):
        n = p.logprobs or 0
        top = tuple(zip(top_ids[r][:n], top_vals[r][:n], strict=True))
        out.append(TokenLogprobs(logprob=chosen[r], top=top))
    return out
