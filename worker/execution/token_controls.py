"""Token controls, the sampler's first stage: the bans (every token outside
allowed_token_ids; the last token of each bad word whose other tokens end the output; EOS and
stop ids while a row has fewer than min_tokens outputs) and then logit_bias, on the rows that
use them; and the last stage before the draw, the structured-output grammar's mask. The
order and the rule for a row whose bans leave nothing are the sampler's
(`worker.execution.sampler`'s docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scheduler.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.execution.sampler import SamplingMetadata


def apply_token_controls(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bans (allowed_token_ids, bad words, min_tokens), then logit_bias, on the rows that use
    them. Returns `logits` itself when no row uses any, else a new tensor."""
    vocab = logits.shape[-1]
    allowed_rows: list[int] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, p in enumerate(meta.params):
        if p.allowed_token_ids is not None or p.bad_words_token_ids or p.logit_bias:
            _check_vocab(p, vocab)
        if p.allowed_token_ids is not None:
            allowed_rows.append(i)
        banned = _banned_ids(p, meta.output_token_ids[i], meta.eos_token_ids)
        if banned and not _bans_leave_nothing(p, banned, vocab):
            ban_rows += [i] * len(banned)
            ban_cols += banned
        for token, bias in p.logit_bias:
            bias_rows.append(i)
            bias_cols.append(token)
            bias_vals.append(bias)
    if not (allowed_rows or ban_rows or bias_rows):
        return logits
    logits = logits.clone()
    if allowed_rows:
        _keep_only_allowed(logits, allowed_rows, meta.params)
    if ban_rows:
        logits[ban_rows, ban_cols] = float("-inf")
    if bias_rows:
        device = logits.device
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device))
        logits.index_put_(index, torch.tensor(bias_vals, dtype=logits.dtype, device=device),
                          accumulate=True)
    return logits


def _banned_ids(
    params: SamplingParams, output: list[int], eos_token_ids: tuple[int, ...]
) -> set[int]:
    """Token ids banned at this step: bad words' last tokens, and stop ids under min_tokens."""
    banned = {word[-1] for word in params.bad_words_token_ids if _ends_with(output, word[:-1])}
    if params.min_tokens and len(output) < params.min_tokens:
        banned |= set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= set(eos_token_ids)
    return banned


def _ends_with(output: list[int], prefix: tuple[int, ...]) -> bool:
    n = len(prefix)
    return n == 0 or (n <= len(output) and tuple(output[-n:]) == prefix)


def _bans_leave_nothing(params: SamplingParams, banned: set[int], vocab: int) -> bool:
    allowed = params.allowed_token_ids
    if allowed is not None:
        return banned.issuperset(allowed)
    return len(banned) >= vocab


def _keep_only_allowed(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams]
) -> None:
    """Set every logit outside its row's allowed_token_ids to -inf, in place."""
    device = logits.device
    local = [r for r, i in enumerate(rows) for _ in params[i].allowed_token_ids or ()]
    cols = [t for i in rows for t in params[i].allowed_token_ids or ()]
    index = (torch.tensor(local, device=device), torch.tensor(cols, device=device))
    sub = logits[rows]
    kept = torch.full_like(sub, float("-inf"))
    kept[index] = sub[index]
    logits[rows] = kept


def _check_vocab(params: SamplingParams, vocab: int) -> None:
    """A token id past the logits would index out of bounds; name the field instead."""
    fields = (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words", [t for word in params.bad_words_token_ids for t in word]),
    )
    for name, ids in fields:
        if ids and max(ids) >= vocab:
            raise ValueError(f"{name}: token id {max(ids)} is outside the vocabulary ({vocab})")


def apply_grammar_mask(
    logits: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    """-inf outside each row's grammar. A row that the other controls and the grammar
    together leave without a token (min_tokens banning the end a finished grammar needs)
    is masked from its raw logits by the grammar alone: the output must follow it."""
    if allowed is None:
        return logits
    allowed = allowed.to(logits.device)
    masked = logits.masked_fill(~allowed, float("-inf"))
    empty = torch.isinf(masked).all(dim=-1) & allowed.any(dim=-1)
    if bool(empty.any()):
        masked[empty] = raw[empty].masked_fill(~allowed[empty], float("-inf"))
    return masked
