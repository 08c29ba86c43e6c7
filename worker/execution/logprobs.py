"""Log-probabilities as the API returns them: a token's logprob, its rank and the top
alternatives at its position, for sampled tokens (the sampler) and prompt tokens
(`ModelRunner`'s prompt_logprobs), each row copied to the host once."""

from __future__ import annotations

import torch

from scheduler.output import TokenLogprobs


def token_logprobs(
    logprobs: torch.Tensor, targets: torch.Tensor, counts: list[int], with_rank: bool = False
) -> list[TokenLogprobs]:
    """Row i's logprob of `targets[i]`, its top `counts[i]` alternatives and, `with_rank`,
    the target's rank; one device-to-host copy of each."""
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks: list[int | None] = (
        ((logprobs > chosen).sum(dim=1) + 1).tolist() if with_rank else [None] * len(counts)
    )
    k = max(counts, default=0)
    top_vals: list[list[float]] = [[] for _ in counts]
    top_ids: list[list[int]] = [[] for _ in counts]
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    return [
        TokenLogprobs(logprob=lp, top=tuple(zip(ids[:n], vals[:n], strict=True)), rank=rank)
        for lp, ids, vals, n, rank in zip(
            chosen.squeeze(1).tolist(), top_ids, top_vals, counts, ranks, strict=True
        )
    ]
