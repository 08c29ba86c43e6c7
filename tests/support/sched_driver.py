"""Shared drivers for tests that run the real scheduler: request factory and a mirror of the worker.

`MirrorWorker` applies plans exactly as the real worker does (token lists kept per request,
preempted requests keep their state, finished/aborted ones are dropped) and checks every
plan against what it knows, so scheduler tests also test the plan protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerOutput

EOS = 2


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    arrival: float = 0.0,
    priority: int = 0,
    prompt: list[int] | None = None,
    tenant: str | None = None,
    **params: object,
) -> Request:
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(max_tokens=max_tokens, priority=priority, **params)  # type: ignore[arg-type]
    tokens = prompt if prompt is not None else [100 + (hash((rid, i)) % 1000) for i in range(prompt_len)]
    req = Request(rid, tokens, sp, arrival_time=arrival, eos_token_ids=(EOS,))
    if tenant is not None:
        req.tenant = tenant
    return req


@dataclass
class _State:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    active: bool = True
    prefix_hashes: list[int] = field(default_factory=list)  # [i]: identity of tokens[: i + 1]

    def prefix_hash(self, pos: int) -> int:
        while len(self.prefix_hashes) <= pos:
            i = len(self.prefix_hashes)
            self.prefix_hashes.append(hash((self.prefix_hashes[-1] if i else 0, self.tokens[i])))
        return self.prefix_hashes[pos]


class MirrorWorker:
    """A model-free worker: tokens come from `next_token(req_id, position)`."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        next_token: Callable[[str, int], int] | None = None,
        verify_kv: bool = True,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.next_token = next_token or (lambda rid, pos: 1000 + (hash((rid, pos)) % 5000))
        self.verify_kv = verify_kv
        self.reqs: dict[str, _State] = {}
        # What each KV slot holds: the identity of the token prefix whose last token wrote it.
        # Attention at position p is right only if every slot it reads holds that request's
        # own prefix, so this checks prefix sharing, swaps and recompute end to end.
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}

    def _slot(self, st: _State, pos: int) -> int:
        return st.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _copy_blocks(self, pairs: tuple[tuple[int, int], ...], src: dict[int, int], dst: dict[int, int]) -> None:
        for a, b in pairs:
            for off in range(self.block_size):
                if a * self.block_size + off in src:
                    dst[b * self.block_size + off] = src[a * self.block_size + off]
                else:
                    dst.pop(b * self.block_size + off, None)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for rid in plan.finished_req_ids | plan.aborted_req_ids:
            self.reqs.pop(rid, None)
        for rid in plan.preempted_req_ids:
            st = self.reqs[rid]
            st.active, st.blocks = False, []
        for new in plan.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            self.reqs[new.req_id] = _State(list(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in plan.scheduled_cached_reqs:
            st = self.reqs[cached.req_id]
            if cached.resumed_from_preemption:
                st.blocks, st.active, st.computed = list(cached.new_block_ids), True, cached.num_computed_tokens
            else:
                assert st.active, f"{cached.req_id} scheduled while preempted, without resume"
                st.blocks.extend(cached.new_block_ids)
            assert st.computed == cached.num_computed_tokens, f"{cached.req_id}: computed mismatch"
        self._copy_blocks(plan.swap_out, self.device, self.host)
        self._copy_blocks(plan.swap_in, self.host, self.device)
        sampled: dict[str, int] = {}
        slots: set[int] = set()
        for rid, n in plan.num_scheduled_tokens.items():  # write all new KV first, as a layer does
            st = self.reqs[rid]
            end = st.computed + n
            assert end <= len(st.tokens), f"{rid}: computes past its known tokens"
            assert len(st.blocks) * self.block_size >= end, f"{rid}: block table too short"
            for pos in range(st.computed, end):
                slot = self._slot(st, pos)
                assert slot not in slots, "two tokens write one KV slot in a step"
                slots.add(slot)
                self.device[slot] = st.prefix_hash(pos)
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.reqs[rid]
            end = st.computed + n
            if self.verify_kv:
                for pos in range(end):
                    assert self.device.get(self._slot(st, pos)) == st.prefix_hash(pos), (
                        f"{rid}: stale KV at position {pos}"
                    )
            st.computed = end
            if end == len(st.tokens):
                tok = self.next_token(rid, end)
                st.tokens.append(tok)
                sampled[rid] = tok
        return ModelRunnerOutput(step_id=plan.step_id, sampled_token_ids=sampled)


def drive(
    sched: Scheduler,
    worker: MirrorWorker,
    max_steps: int = 100_000,
    check: bool = True,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    overlap: bool = False,
) -> int:
    """Run plan/execute/update until nothing is left; returns the number of steps.

    With `overlap`, plan N+1 is made and executed before output N is applied, as the
    engine loop does (two plans in flight)."""
    steps = 0
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    while sched.needs_plan() or pending:
        assert steps < max_steps, "did not finish (livelock?)"
        if sched.needs_plan():
            plan = sched.schedule(now=float(steps))
            if on_step:
                on_step(steps, plan)
            pending.append((plan, worker.execute(plan)))
        if not overlap or len(pending) == 2 or not sched.has_unfinished_requests():
            done_plan, out = pending.pop(0)
            sched.update_from_output(done_plan, out, now=float(steps))
        if check:
            sched.check_integrity()
        steps += 1
    return steps

