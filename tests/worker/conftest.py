"""Shared fixtures for the worker's model-side tests: tiny random HF models saved to disk,
the default SmolLM2 runner (loaded once per session), and `PlanDriver`, which builds step
plans by hand the way the scheduler would (block allocation, chunking, preemption, swap)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_hf_model
from worker_modes import REFERENCE

from scheduler.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from scheduler.sampling import SamplingParams
from worker.config import WorkerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)




@pytest.fixture
def tiny_hf_dir(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    """Factory: save a tiny model as an HF dir (config.json + safetensors); returns (dir, model)."""

    def build(kind: str = "llama", **overrides: Any) -> tuple[Path, Any]:
        model = make_tiny_hf_model(kind, **overrides)
        target = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}"
        model.save_pretrained(target)
        return target, model

    return build


@dataclass
class DriverRequest:
    """The driver's (scheduler-like) view of one request."""

    req_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    state: str = "new"  # new | running | preempted | swapped | done
    pending: int = 0  # samples in flight (overlap: counted before their token is known)

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.outputs) + self.pending


class PlanDriver:
    """Builds and executes hand-made plans: every live request computes up to `chunk` tokens
    a step (prefill) or one (decode); `preempt` / `swap` act before a step's plan."""

    def __init__(self, runner: Any, chunk: int | None = None, overlap: bool = False) -> None:
        self.runner = runner
        self.chunk = chunk
        self.overlap = overlap  # finish one plan late, as the engine's overlap does
        self.block_size = runner.info.block_size
        self.free = list(range(runner.info.num_gpu_blocks))
        self.host_free = list(range(runner.info.num_cpu_blocks))
        self.reqs: dict[str, DriverRequest] = {}
        self.step_id = 0
        self.to_finish: set[str] = set()
        self.to_abort: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.reqs[req_id] = DriverRequest(req_id, list(prompt), params)

    def step(self, preempt: tuple[str, ...] = (), swap: tuple[str, ...] = (), abort: tuple[str, ...] = ()) -> ModelRunnerOutput:
        preempted, swap_out = self._preempt(preempt, swap)
        for req_id in abort:
            self._release(self.reqs[req_id], "done")
            self.to_abort.add(req_id)
        new, cached, counts, swap_in = self._schedule(skip=set(preempt) | set(swap))
        plan = SchedulerOutput(
            step_id=self.step_id, scheduled_new_reqs=tuple(new), scheduled_cached_reqs=tuple(cached),
            num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
            preempted_req_ids=frozenset(preempted), finished_req_ids=frozenset(self.to_finish),
            aborted_req_ids=frozenset(self.to_abort), swap_out=tuple(swap_out), swap_in=tuple(swap_in),
        )
        self.to_finish, self.to_abort = set(), set()
        self.step_id += 1
        out = self.runner.execute(plan)
        assert out.error is None, out.error
        self._receive(out, counts)
        return out

    def run(self, max_tokens: int = 32, **first_step: Any) -> dict[str, list[int]]:
        """Step until every request has `max_tokens` outputs; then finish them all."""
        # with overlap the engine learns a request is done one plan late: it computes one
        # extra token, which is discarded
        limit = max_tokens + int(self.overlap)
        self.step(**first_step)
        while any(r.state != "done" for r in self.reqs.values()):
            for r in self.reqs.values():
                if r.state == "running" and len(r.outputs) >= limit:
                    self._release(r, "done")
                    self.to_finish.add(r.req_id)
            if any(r.state != "done" for r in self.reqs.values()):
                self.step()
        self.close()
        return {r.req_id: r.outputs[:max_tokens] for r in self.reqs.values()}

    def close(self) -> None:
        """Send the pending finish/abort ids in an empty plan."""
        self.to_finish |= {r.req_id for r in self.reqs.values() if r.state != "done"}
        for r in self.reqs.values():
            self._release(r, "done")
        self.step()

    def _preempt(self, preempt: tuple[str, ...], swap: tuple[str, ...]) -> tuple[set[str], list[tuple[int, int]]]:
        swap_out: list[tuple[int, int]] = []
        for req_id in swap:
            r = self.reqs[req_id]
            r.host_blocks = [self.host_free.pop() for _ in r.blocks]
            swap_out += list(zip(r.blocks, r.host_blocks, strict=True))
            self._release(r, "swapped")
        for req_id in preempt:
            r = self.reqs[req_id]
            self._release(r, "preempted")
            r.computed = 0
        return set(preempt) | set(swap), swap_out

    def _release(self, r: DriverRequest, state: str) -> None:
        self.free += r.blocks
        r.blocks = []
        r.state = state

    def _schedule(self, skip: set[str]) -> tuple[list[NewRequestData], list[CachedRequestData], dict[str, int], list[tuple[int, int]]]:
        new, cached, counts, swap_in = [], [], {}, []
        for r in self.reqs.values():
            if r.state == "done" or r.req_id in skip:
                continue
            n = min(self.chunk or r.known, r.known - r.computed)
            resumed = r.state in ("preempted", "swapped")
            if r.state == "swapped":
                r.blocks = [self.free.pop(0) for _ in r.host_blocks]
                swap_in += list(zip(r.host_blocks, r.blocks, strict=True))
                self.host_free += r.host_blocks
                r.host_blocks = []
            grow = [self.free.pop(0) for _ in range(-(-(r.computed + n) // self.block_size) - len(r.blocks))]
            r.blocks += grow
            if r.state == "new":
                new.append(NewRequestData(r.req_id, tuple(r.prompt), r.params, tuple(r.blocks), r.computed))
            else:
                cached.append(CachedRequestData(r.req_id, tuple(r.blocks if resumed else grow), r.computed, resumed))
            r.state = "running"
            counts[r.req_id] = n
            r.computed += n
            r.pending += int(r.computed == r.known)
        return new, cached, counts, swap_in

    def _receive(self, out: ModelRunnerOutput, counts: dict[str, int]) -> None:
        for req_id in counts:
            r = self.reqs[req_id]
            if req_id in out.sampled_token_ids:
                assert r.pending == 1, f"{req_id} sampled without reaching its end"
                r.pending = 0
                r.outputs.append(out.sampled_token_ids[req_id])
            else:
                assert r.pending == 0, f"{req_id} reached its end but did not sample"


@pytest.fixture(scope="session")
def plan_driver() -> type[PlanDriver]:
    """The `PlanDriver` class (test files cannot import the conftest)."""
    return PlanDriver


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private model cache dir (tokenizer cache) for the session."""
    path = tmp_path_factory.mktemp("model-cache")
    old = os.environ.get("STEPSERVE_MODEL_CACHE")
    os.environ["STEPSERVE_MODEL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("STEPSERVE_MODEL_CACHE", None)
    else:
        os.environ["STEPSERVE_MODEL_CACHE"] = old


@pytest.fixture(scope="session")
def smol_tokenizer(model_cache: Path) -> Any:
    from common.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def smol_runner_session() -> Iterator[Any]:
    """The default model on CPU with one torch thread: the suite shares two cores with other
    processes, and oversubscribed BLAS threads spin (4x slower measured); restored after."""
    from worker.execution.model_runner import ModelRunner

    threads = torch.get_num_threads()
    config = WorkerConfig(device="cpu", kv_cache_memory=96 << 20, swap_space=0.03, max_model_len=1024, num_threads=1,
                          **REFERENCE)
    yield ModelRunner(config)
    torch.set_num_threads(threads)


@pytest.fixture
def smol_runner(smol_runner_session: Any) -> Iterator[Any]:
    """The shared default-model runner; a test must leave it holding no request."""
    yield smol_runner_session
    assert smol_runner_session.requests == {}, "test left requests in the shared runner"
    assert smol_runner_session.batch.num_active == 0
