"""Pure decisions the scheduler makes per request: which running request gives way, whether
swapping it beats recomputing it, whether a new token stops a request, and what the engine
is told about it. No state of their own; `Scheduler` applies the results."""

from __future__ import annotations

from scheduler import step_cost
from scheduler.config import SchedulerConfig, VictimPolicy
from scheduler.output import ModelRunnerOutput, RequestOutput
from scheduler.request import Request, RequestStatus


def pick_victim(candidates: list[Request], policy: VictimPolicy) -> Request:
    """"newest": the most recently admitted; "priority": the least urgent, then the youngest."""
    if policy == "priority":
        return max(candidates, key=lambda r: (r.priority, r.arrival_time, r.admit_seq))
    return max(candidates, key=lambda r: r.admit_seq)


def swap_is_cheaper(config: SchedulerConfig, num_tokens: int) -> bool:
    """Swap out now and back in later vs recompute `num_tokens` of KV (preemption "auto"):
    `step_cost.swap_is_cheaper` with the configured copy bandwidth and cost model."""
    return step_cost.swap_is_cheaper(num_tokens, config.kv_bytes_per_token, config.swap_bandwidth,
                                     config.recompute_cost)


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished state `token` (just appended) puts the request in, or None."""
    sp = req.sampling_params
    is_stop_id = token in sp.stop_token_ids
    stops = is_stop_id or (not sp.ignore_eos and token in req.eos_token_ids)
    if stops and req.num_output_tokens >= sp.min_tokens:
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
    )
