"""Finishing: whether a newly sampled token stops its request, and what the engine is told
about a request after a step. `stop_status` records the stop token on the request it stops;
nothing else here changes state."""

from __future__ import annotations

from scheduler.output import ModelRunnerOutput, RequestOutput
from scheduler.request import Request, RequestStatus


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished state `token` (just appended) puts the request in, or None. Sets
    `req.stop_token_id` when a stop token id (not EOS) ends it. The EOS that ends a
    structured output's grammar stops it under min_tokens too: nothing may follow it."""
    sp = req.sampling_params
    is_stop_id = token in sp.stop_token_ids
    is_eos = not sp.ignore_eos and token in req.eos_token_ids
    grammar_done = is_eos and sp.grammar is not None
    if (is_stop_id or is_eos) and (req.num_output_tokens >= sp.min_tokens or grammar_done):
        req.stop_token_id = token if is_stop_id else None  # EOS is no "stop_reason" (vLLM)
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def request_output(req: Request, token: int | None, out: ModelRunnerOutput) -> RequestOutput:
    """What the engine learns about `req` from one step (token None: it was aborted)."""
    lp = out.logprobs.get(req.request_id) if token is not None else None
    finished = req.is_finished
    return RequestOutput(
        req.request_id,
        (token,) if token is not None else (),
        finished,
        req.finish_reason if finished else None,
        req.stop_token_id,
        (lp,) if lp is not None else (),
        len(req.prompt_token_ids),
        len(req.output_token_ids),
        req.metrics.num_cached_prompt_tokens,
        out.prompt_logprobs.get(req.request_id, ()) if token is not None else (),
    )
