"""Worker step benchmark: decode and prefill throughput of `ModelRunner` next to this
machine's measured matmul rate and memory bandwidth (the rooflines), printed as JSON.

    python -m bench.worker_step                        # default SmolLM2 GGUF on this CPU
    python -m bench.worker_step --dtype bfloat16 --compare-dtypes
    python -m bench.worker_step --model-shape llama-3.1-8b --random-weights --dtype bfloat16
    python -m bench.worker_step --breakdown            # where a step's time goes, phase by phase
    python -m bench.worker_step --batches 1 16 --chunks 256 --context 96 --compare-activations
    python -m bench.worker_step --batches 1 64 --chunks 256 --context 400 --compare-kv-cache
    python -m bench.worker_step --kv-cache-dtype int8 --context 400 --compare-kv-cache float16
    python -m bench.worker_step --batches 1 --chunks 256 1024 --chunk-context 0 \
        --compare-chunk-attention

Decode roofline per step: the larger of (weight bytes + KV bytes read) / copy bandwidth and
2 * matmul params (LM head included) * batch / matmul rate. Prefill roofline: 2 * matmul
params (no embedding, no head) * tokens / matmul rate; attention FLOPs are left out. The
fractions are roofline time / measured time; the machine rates are measured in the same run,
on square 1024 matmuls on CPU, so a model's larger matmuls can beat them (fraction > 1).

`--breakdown` adds, per decode batch (and one prefill chunk), the wall time of each phase
of `ModelRunner.execute` (plan application, input preparation, attention metadata, forward,
logits, sampler, advance), the eager forward's operators grouped by the torch profiler into
matmuls / attention / KV writes and gathers / other ops (self time, profiler overhead
included), and the IPC round trip of a plan through the worker process (measured with the
instant runner behind the same pipe, so only pickling and the pipe count).

Every step shape is timed once per round, over `--repeat` rounds, and its median kept.
`steps` lists every measured shape (also those at the extra `--context` / `--chunk-context`
values), which is what `stepserve simulate calibrate` fits a hardware profile to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.arith import cdiv
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.sampling import SamplingParams
from worker.config import KV_CACHE_DTYPES, WorkerConfig, WorkerInfo
from worker.execution.model_runner import ModelRunner, resolve_device, resolve_dtype
from worker.model.config import ModelConfig
from worker.model.loader import expected_shapes

LLAMA_31_8B = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    attention_bias=False,
    eos_token_ids=(128001,),
)
MODEL_SHAPES = {"llama-3.1-8b": LLAMA_31_8B}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of `fn`, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def timed(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up."""
    fn()
    return median([time_once(fn, device) for _ in range(repeat)])


def machine_rates(
    device: torch.device, dtypes: tuple[str, ...] = ("float32", "bfloat16")
) -> dict[str, float]:
    """Measured dense matmul FLOP/s (per dtype) and copy bandwidth (bytes/s)."""
    n = 4096 if device.type == "cuda" else 1024
    rates: dict[str, float] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        rates[f"matmul_flops_{name}"] = 2 * n**3 / timed(lambda a=a, b=b: a @ b, device, 5)
    elems = (1 << 30 if device.type == "cuda" else 1 << 27) // 4
    src = torch.ones(elems, device=device)
    dst = torch.empty_like(src)
    rates["copy_bandwidth_bytes"] = 2 * src.nbytes / timed(lambda: dst.copy_(src), device, 5)
    return rates


def random_weights(
    config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, shape in expected_shapes(config).items():
        tensor = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            out[name] = tensor.fill_(1.0)
        else:
            out[name] = tensor.normal_(0.0, 0.02, generator=gen)
    return out


class Bench:
    """Drives one runner with hand-built plans (the bench's own tiny scheduler)."""

    def __init__(self, runner: ModelRunner, info: WorkerInfo | None = None) -> None:
        """`info`: plan for a worker other than `runner` (the worker process's)."""
        self.runner = runner
        info = info or runner.info
        self.bs = info.block_size
        self.free = list(range(info.num_gpu_blocks))
        self.step_id = 0
        self.live: dict[str, list[int]] = {}  # req id -> blocks
        self.computed: dict[str, int] = {}

    def plan(
        self,
        new: dict[str, list[int]],
        run: dict[str, int],
        finished: frozenset[str] = frozenset(),
        first_chunk: int | None = None,
    ) -> SchedulerOutput:
        """New requests compute their whole prompt (or its first `first_chunk` tokens);
        each running request in `run` computes that many more tokens."""
        new_reqs, cached, counts = [], [], {}
        for rid, prompt in new.items():
            self.live[rid] = self._take(len(prompt))
            self.computed[rid] = 0
            new_reqs.append(NewRequestData(rid, tuple(prompt), GREEDY, tuple(self.live[rid]), 0))
            counts[rid] = min(len(prompt), first_chunk or len(prompt))
        for rid, n in run.items():
            grow = self._take(self.computed[rid] + n - len(self.live[rid]) * self.bs)
            self.live[rid] += grow
            cached.append(CachedRequestData(rid, tuple(grow), self.computed[rid], False))
            counts[rid] = n
        for rid, n in counts.items():
            self.computed[rid] += n
        self.step_id += 1
        return SchedulerOutput(
            self.step_id,
            tuple(new_reqs),
            tuple(cached),
            counts,
            sum(counts.values()),
            frozenset(),
            finished,
            frozenset(),
        )

    def _take(self, tokens: int) -> list[int]:
        need = max(0, cdiv(tokens, self.bs))
        if need > len(self.free):
            raise SystemExit(
                f"the KV cache is too small for this run ({need} blocks needed, "
                f"{len(self.free)} free): every decode batch is kept for the whole run; "
                "raise --kv-cache-gib"
            )
        taken, self.free = self.free[:need], self.free[need:]
        return taken

    def finish(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.free += self.live.pop(rid)
            del self.computed[rid]
        self.runner.execute(self.plan({}, {}, finished=frozenset(req_ids)))

    def finish_all(self) -> None:
        self.finish(list(self.live))


def prompts(n: int, length: int, vocab: int, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"r{seed}-{i}": torch.randint(10, vocab, (length,), generator=gen).tolist()
        for i in range(n)
    }


def start_decodes(bench: Bench, batch: int, context: int) -> list[str]:
    """Prefill `batch` requests of `context` tokens (untimed); returns their ids."""
    reqs = prompts(
        batch, context, bench.runner.info.vocab_size, seed=10**7 + batch * 10**5 + context
    )
    ids = list(reqs)
    per_step = max(1, 4096 // context)  # prefill a few requests per step
    for start in range(0, batch, per_step):
        bench.runner.execute(
            bench.plan({rid: reqs[rid] for rid in ids[start : start + per_step]}, {})
        )
    return ids


def timed_execute(bench: Bench, plan: SchedulerOutput) -> float:
    return time_once(lambda: bench.runner.execute(plan), bench.runner.device)


def prefill_once(bench: Bench, tokens: int, context: int) -> float:
    """Seconds of one prefill chunk of `tokens` tokens, after `context` tokens of the same
    prompt were computed by an earlier (untimed) step."""
    prompt = prompts(1, context + tokens, bench.runner.info.vocab_size, seed=bench.step_id)
    rid = next(iter(prompt))
    if context:
        bench.runner.execute(bench.plan(prompt, {}, first_chunk=context))
        seconds = timed_execute(bench, bench.plan({}, {rid: tokens}))
    else:
        seconds = timed_execute(bench, bench.plan(prompt, {}))
    bench.finish([rid])
    return seconds


def measure_steps(bench: Bench, decodes: list[tuple[int, int]], chunks: list[tuple[int, int]],
                  rounds: int) -> dict[tuple[str, int, int], float]:
    """Median seconds of each step shape: ("decode", batch, context) and ("prefill", tokens,
    context). Every decode batch is prefilled first and kept; then each round times every
    shape once (round 0 warms up), so a slow spell of a shared machine spreads over all
    shapes instead of skewing the few measured during it."""
    groups = {(b, c): start_decodes(bench, b, c) for b, c in decodes}
    times: dict[tuple[str, int, int], list[float]] = {}
    for r in range(rounds + 1):
        for (b, c), ids in groups.items():
            seconds = timed_execute(bench, bench.plan({}, dict.fromkeys(ids, 1)))
            if r:
                times.setdefault(("decode", b, c), []).append(seconds)
        for n, c in chunks:
            seconds = prefill_once(bench, n, c)
            if r:
                times.setdefault(("prefill", n, c), []).append(seconds)
    bench.finish_all()
    return {key: median(v) for key, v in times.items()}


def build_runner(
    args: argparse.Namespace, gguf_activations: str = "auto", kv_cache_dtype: str | None = None,
    gguf_wide_steps: str | None = None,
) -> ModelRunner:
    config = WorkerConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_gib << 30,
        num_threads=args.threads,
        enforce_eager=args.enforce_eager,
        compile_wait=True,
        gguf_activations=gguf_activations,
        kv_cache_dtype=kv_cache_dtype or args.kv_cache_dtype,
        gguf_wide_steps=gguf_wide_steps or args.gguf_wide_steps,
    )
    if args.model_shape is None:
        return ModelRunner(config)
    if not args.random_weights:
        raise SystemExit("--model-shape needs --random-weights (no weights ship for it)")
    shape = MODEL_SHAPES[args.model_shape]
    device = resolve_device(args.device)
    return ModelRunner(
        config, loaded=(shape, random_weights(shape, device, resolve_dtype(args.dtype, device)))
    )


def measure(
    runner: ModelRunner, args: argparse.Namespace, rates: dict[str, float]
) -> dict[str, Any]:
    """Decode and prefill numbers for one runner, with roofline fractions."""
    info, bench = runner.info, Bench(runner)
    weight_bytes = (
        info.weight_bytes or info.num_params * torch.empty((), dtype=runner.dtype).element_size()
    )
    c = runner.model_config
    head_params = c.vocab_size * c.hidden_size
    matmul_params = info.num_params - head_params * (
        1 if c.tie_word_embeddings else 2
    )  # no embedding, no head
    flops_rate = (
        rates[f"matmul_flops_{info.dtype}"]
        if f"matmul_flops_{info.dtype}" in rates
        else rates["matmul_flops_float32"]
    )
    measured = measure_steps(bench, [(b, c) for c in args.context for b in args.batches],
                             [(n, c) for c in args.chunk_context for n in args.chunks], args.repeat)
    decode, prefill, steps = {}, {}, []
    for (kind, n, context), seconds in measured.items():
        batch, tokens = (n, 1) if kind == "decode" else (1, n)
        steps.append({"num_reqs": batch, "tokens_per_req": tokens, "context": context,
                      "step_ms": round(seconds * 1e3, 3)})
        if kind == "decode" and context == args.context[0]:
            step_bytes = weight_bytes + batch * (context + 1) * info.kv_bytes_per_token
            # every decode token also runs the LM head, so it counts as a matmul here
            bound = max(
                step_bytes / rates["copy_bandwidth_bytes"],
                2 * (matmul_params + head_params) * batch / flops_rate,
            )
            decode[str(batch)] = {
                "step_ms": round(seconds * 1e3, 3),
                "tokens_per_s": round(batch / seconds, 1),
                "roofline_ms": round(bound * 1e3, 3),
                "roofline_fraction": round(bound / seconds, 3),
            }
        elif kind == "prefill" and context == args.chunk_context[0]:
            bound = 2 * matmul_params * tokens / flops_rate
            prefill[str(tokens)] = {
                "step_ms": round(seconds * 1e3, 2),
                "tokens_per_s": round(tokens / seconds, 1),
                "roofline_ms": round(bound * 1e3, 2),
                "roofline_fraction": round(bound / seconds, 3),
            }
    return {
        "dtype": info.dtype,
        "quantization": info.quantization,
        "gguf_activations": runner.gguf_activations,
        "kv_cache_dtype": info.kv_cache_dtype,
        "compiled": info.compiled,
        "weight_bytes": weight_bytes,
        "decode": decode,
        "prefill": prefill,
        "steps": steps,
    }


# ---- --breakdown ----------------------------------------------------------------------------

_OP_GROUPS = (  # profiler op names (substrings) -> group; first match wins
    ("kv", ("index_copy", "index_select", "index_put", "set_kv_cache", "bind_step")),
    (
        "attention",
        ("paged_attention", "scaled_dot_product", "flash_attention", "_efficient_attention"),
    ),
    (
        "matmul",
        (
            "lowbit_linear", "aten::mm", "aten::addmm", "aten::bmm", "_weight_int8pack_mm",
            "_weight_int4pack_mm", "mkldnn", "aten::linear", "aten::matmul",
        ),
    ),
)


def _op_group(name: str) -> str:
    return next((group for group, keys in _OP_GROUPS if any(k in name for k in keys)), "other")


class PhaseTimer:
    """Wall time of each phase of `runner.execute`, by wrapping the bound methods it calls."""

    PHASES = (
        ("batch", "apply", "apply_plan"),
        ("batch", "prepare", "prepare_inputs"),
        ("batch", "attention_metadata", "attention_metadata"),
        ("attention", "bind", "attention_metadata"),
        ("", "forward", "forward"),
        ("model", "compute_logits", "logits"),
        ("sampler", "sample", "sampler"),
        ("batch", "advance", "advance"),
    )

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.ms: dict[str, float] = defaultdict(float)
        self.saved: list[tuple[Any, str, Any]] = []
        for owner_name, attr, phase in self.PHASES:
            owner = getattr(runner, owner_name) if owner_name else runner
            self._wrap(owner, attr, phase)

    def _wrap(self, owner: Any, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)
        self.saved.append((owner, attr, owner.__dict__.get(attr)))

        def timed_call(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.ms[phase] += (time.perf_counter() - start) * 1e3

        setattr(owner, attr, timed_call)

    def restore(self) -> None:
        for owner, attr, original in reversed(self.saved):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def _phases(bench: Bench, make_plan: Callable[[], SchedulerOutput], steps: int) -> dict[str, float]:
    """Mean ms per step of each phase over `steps` steps (the step total, and what no phase
    holds)."""
    runner = bench.runner
    runner.execute(make_plan())  # warm-up
    timer = PhaseTimer(runner)
    total = 0.0
    try:
        for _ in range(steps):
            total += timed_execute(bench, make_plan()) * 1e3
    finally:
        timer.restore()
    out = {phase: round(ms / steps, 3) for phase, ms in timer.ms.items()}
    out["step_total"] = round(total / steps, 3)
    out["unaccounted"] = round((total - sum(timer.ms.values())) / steps, 3)
    return out


def _forward_ops(
    bench: Bench, make_plan: Callable[[], SchedulerOutput], steps: int
) -> dict[str, float]:
    """The eager forward's operators per step (self CPU ms, torch profiler), by group."""
    from torch.profiler import ProfilerActivity, profile

    runner = bench.runner
    compiled_forward = runner.forward
    runner.forward = runner.model.forward  # the profiler sees eager operators, not a compiled graph
    try:
        runner.execute(make_plan())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.execute(make_plan())
    finally:
        runner.forward = compiled_forward
    groups: dict[str, float] = defaultdict(float)
    ops: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        group = _op_group(event.key)
        groups[group] += event.self_cpu_time_total / 1e3 / steps
        ops[group] += event.count // steps
    return {**{f"{g}_ms": round(v, 3) for g, v in sorted(groups.items())},
            **{f"{g}_ops": n for g, n in sorted(ops.items())}}


def ipc_round_trip_ms(batch: int, steps: int = 100) -> dict[str, float]:
    """A decode plan of `batch` requests through the worker process's pipe, with the instant
    runner behind it: round trip minus the worker's own execute time is the IPC cost."""
    from worker.process.client import WorkerClient
    from worker.process.main import INSTANT_RUNNER_FACTORY

    async def run() -> dict[str, float]:
        client = WorkerClient(
            WorkerConfig(device="cpu", kv_cache_memory=4 << 30), INSTANT_RUNNER_FACTORY
        )
        await client.start()
        try:
            # plans only, run by the client
            fake = Bench(None, client.info)  # type: ignore[arg-type]
            reqs = prompts(batch, 32, client.info.vocab_size, seed=7)
            client.submit(fake.plan(reqs, {}))
            await client.get_output()
            trips, executes = [], []
            for _ in range(steps):
                plan = fake.plan({}, dict.fromkeys(reqs, 1))
                start = time.perf_counter()
                client.submit(plan)
                out = await client.get_output()
                trips.append(time.perf_counter() - start)
                executes.append(out.execute_time)
        finally:
            await client.shutdown()
        return {
            "round_trip_ms": round(median(trips) * 1e3, 3),
            "worker_execute_ms": round(median(executes) * 1e3, 3),
            "ipc_ms": round((median(trips) - median(executes)) * 1e3, 3),
        }

    return asyncio.run(run())


def breakdown(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Any]:
    """Phase and operator breakdown of decode steps at each `--batches` size (first
    `--context`) and of one prefill chunk (first `--chunks`)."""
    bench, context, out = Bench(runner), args.context[0], {}
    for batch in args.batches:
        ids = start_decodes(bench, batch, context)

        def decode_plan(ids: list[str] = ids) -> SchedulerOutput:
            return bench.plan({}, dict.fromkeys(ids, 1))

        steps = max(3, min(20, 400 // batch))
        out[f"decode_{batch}"] = {
            "phases_ms": _phases(bench, decode_plan, steps),
            "eager_forward_ops": _forward_ops(bench, decode_plan, max(2, steps // 4)),
            "ipc": ipc_round_trip_ms(batch),
        }
        bench.finish(ids)
    tokens = args.chunks[0]
    holder: list[str] = []

    def prefill_plan() -> SchedulerOutput:  # a fresh prompt each step; the last one finishes in it
        done = frozenset(holder)
        for rid in holder:
            bench.free += bench.live.pop(rid)
            del bench.computed[rid]
        reqs = prompts(1, tokens, runner.info.vocab_size, seed=bench.step_id)
        holder[:] = list(reqs)
        return bench.plan(reqs, {}, finished=done)

    out[f"prefill_{tokens}"] = {"phases_ms": _phases(bench, prefill_plan, 3),
                                "eager_forward_ops": _forward_ops(bench, prefill_plan, 2)}
    bench.finish_all()
    return out


@dataclass(frozen=True)
class Arm:
    """One side of an in-process A/B: a runner, and what to switch before each of its turns
    (two arms may share one runner and differ only in the switch)."""

    runner: ModelRunner
    switch: Callable[[], None] = lambda: None


def runners_ab(
    arms: dict[str, ModelRunner | Arm], args: argparse.Namespace, steps: int = 3
) -> dict[str, Any]:
    """Two arms in one process, alternating which goes first each round so both share the
    machine's drift: every decode batch (at the first --context) and prefill chunk (after the
    first --chunk-context), `steps` steps a round; medians, and the median over each two
    rounds (one in either order) of the geometric mean of their ratios (first over second).
    The arm that goes first follows the other shapes' steps, which can cost it (decode steps
    right after a 1,024-token prefill measured up to 1.5x slower than later ones): one
    order's ratios alone are biased."""
    rounds = args.ab_rounds
    sides = {name: arm if isinstance(arm, Arm) else Arm(arm) for name, arm in arms.items()}
    (a, _), (b, _) = sides.items()
    context, chunk_context = args.context[0], args.chunk_context[0]
    # per runner (arms sharing one share its bench): the bench and its decode batches
    benches: dict[int, tuple[Bench, dict[int, list[str]]]] = {}
    for arm in sides.values():
        if id(arm.runner) not in benches:
            bench = Bench(arm.runner)
            benches[id(arm.runner)] = (
                bench,
                {n: start_decodes(bench, n, context) for n in args.batches},
            )

    def once(name: str, shape: tuple[str, int]) -> float:
        arm = sides[name]
        arm.switch()
        bench, groups = benches[id(arm.runner)]
        if shape[0] == "prefill":
            return sum(prefill_once(bench, shape[1], chunk_context) for _ in range(steps)) / steps
        ids = groups[shape[1]]
        return (
            sum(timed_execute(bench, bench.plan({}, dict.fromkeys(ids, 1))) for _ in range(steps))
            / steps
        )

    shapes = [("decode", n) for n in args.batches] + [("prefill", n) for n in args.chunks]
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in range(rounds + 1):
        for shape in shapes:
            for name in (a, b) if r % 2 else (b, a):
                seconds = once(name, shape)
                if r:  # round 0 warms both up
                    times.setdefault((name, *shape), []).append(seconds)
    out: dict[str, Any] = {}
    for kind, n in shapes:
        first, second = times[(a, kind, n)], times[(b, kind, n)]
        out[f"{kind}_{n}"] = {
            f"{a}_ms": round(median(first) * 1e3, 3),
            f"{b}_ms": round(median(second) * 1e3, 3),
            f"{a}_over_{b}_pair_median": round(_two_round_ratio(first, second), 3),
        }
    sides[a].switch()  # the first arm is the runner as it was
    for bench, _ in benches.values():
        bench.finish_all()
    return out


def _two_round_ratio(first: list[float], second: list[float]) -> float:
    """Median over consecutive rounds (2i, 2i + 1), one in each order, of the geometric mean
    of their first / second ratios."""
    ratios = [x / y for x, y in zip(first, second, strict=True)]
    return median([(ratios[i] * ratios[i + 1]) ** 0.5 for i in range(0, len(ratios) - 1, 2)])


def activations_ab(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Any]:
    """The GGUF products with int8 activations (the default where the CPU runs them) against
    float32 ones (`runners_ab`)."""
    if runner.gguf_activations != "int8":
        return {
            "skipped": f"this runner's GGUF activations are {runner.gguf_activations}, not int8"
        }
    return runners_ab(
        {"int8": runner, "float32": build_runner(args, gguf_activations="float32")}, args
    )


def kv_cache_ab(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Any]:
    """This runner's KV cache element type against another (`--compare-kv-cache`, float32
    unless named; `runners_ab`)."""
    mine, other = runner.info.kv_cache_dtype, args.compare_kv_cache
    if mine == other:
        return {"skipped": f"this runner's KV cache is {other} already"}
    return runners_ab({mine: runner, other: build_runner(args, kv_cache_dtype=other)}, args)


def wide_steps_ab(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Any]:
    """This runner's wide steps (`--gguf-wide-steps`, the probe's cut-over by default)
    against `--compare-wide-steps`' setting (`runners_ab`), each arm named by where its
    bf16 copy takes over ("above N", or "blocks" without one)."""
    if runner.kernels.quantization != "gguf":
        return {"skipped": f"this runner's quantization is {runner.kernels.quantization}, not gguf"}
    other = build_runner(args, gguf_wide_steps=args.compare_wide_steps)

    def name(r: ModelRunner) -> str:
        cut = r.kernels.dense_above
        return "blocks" if cut is None else f"above_{cut}"

    if name(runner) == name(other):
        return {"skipped": f"both runners' wide steps are {name(runner)}"}
    arms = {name(runner): runner, name(other): other}
    return {"arms": list(arms), **runners_ab(arms, args)}  # type: ignore[arg-type]


def chunk_attention_ab(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Any]:
    """Long prefill chunks through the C++ chunk kernel (the default on the C++ attention)
    against torch's SDPA, the same runner switched between turns (`runners_ab`)."""
    if runner.info.attention_backend != "cpu":
        return {
            "skipped": f"this runner's attention backend is {runner.info.attention_backend}, "
            "not cpu"
        }
    ops = torch.ops.stepserve_cpu
    return runners_ab({"kernel": Arm(runner, lambda: ops.set_chunk_kernel(True)),
                       "sdpa": Arm(runner, lambda: ops.set_chunk_kernel(False))}, args)


def greedy_tokens(runner: ModelRunner, n_prompts: int, length: int, steps: int) -> list[list[int]]:
    """Greedy continuations of fixed random prompts (for comparing dtypes)."""
    bench = Bench(runner)
    reqs = prompts(n_prompts, length, runner.info.vocab_size, seed=12345)
    outs: dict[str, list[int]] = {rid: [] for rid in reqs}
    result = runner.execute(bench.plan(reqs, {}))
    for _ in range(steps):
        for rid, tok in result.sampled_token_ids.items():
            outs[rid].append(tok)
        result = runner.execute(bench.plan({}, dict.fromkeys(reqs, 1)))
    bench.finish_all()
    return list(outs.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2 GGUF)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"]
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=[256],
        help="decode context(s); the decode table uses the first, `steps` lists all "
        "(a grid of contexts is what `stepserve simulate calibrate` needs)",
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument(
        "--chunk-context",
        type=int,
        nargs="+",
        default=[0],
        help="tokens already computed before each prefill chunk; the prefill table uses the first",
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed rounds over all step shapes (median kept)"
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=int, default=4,
                        help="CPU KV cache size; every decode batch stays cached for the whole run "
                             "(the default grid needs ~2.2 GiB with SmolLM2 in fp32)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument(
        "--compare-dtypes", action="store_true", help="also run bfloat16 and compare greedy outputs"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also break each decode batch's step (and one prefill chunk) into phases and "
        "operator groups",
    )
    parser.add_argument(
        "--compare-activations",
        action="store_true",
        help="also time every decode batch and prefill chunk with the GGUF products' int8 "
        "activations (the default where the CPU runs them) against float32 ones, two runners "
        "in one process, alternating rounds",
    )
    parser.add_argument(
        "--compare-kv-cache",
        nargs="?",
        const="float32",
        choices=KV_CACHE_DTYPES[1:],
        help="also time every decode batch and prefill chunk with this runner's KV cache element "
        "type (float16 by default on the C++ attention) against another (float32 unless "
        "named), the same way",
    )
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=16,
        help="timed rounds of every --compare-* A/B, an even number (half in each order)",
    )
    parser.add_argument(
        "--gguf-wide-steps", default="auto",
        help="the runner's --gguf-wide-steps (auto: the probe's cut-over; blocks; or N tokens)",
    )
    parser.add_argument(
        "--compare-wide-steps",
        metavar="SETTING",
        help="also time every decode batch and prefill chunk with this runner's wide steps "
        "against a second runner's --gguf-wide-steps SETTING (e.g. 8, blocks), the same way",
    )
    parser.add_argument(
        "--compare-chunk-attention",
        action="store_true",
        help="also time every decode batch and prefill chunk (after the first --chunk-context) "
        "with long chunks' attention in the C++ chunk kernel against torch's SDPA, the same way",
    )
    args = parser.parse_args(argv)
    if args.ab_rounds < 2 or args.ab_rounds % 2:
        parser.error(f"--ab-rounds must be an even number >= 2, got {args.ab_rounds}")
    torch.manual_seed(0)
    runner = build_runner(args)
    # fp32 always (the reference roof); bf16 when it is used or compared: on a CPU without
    # native bf16 its 1024^3 matmul alone takes seconds
    dtypes = (
        ("float32",)
        if runner.info.dtype == "float32" and not args.compare_dtypes
        else ("float32", "bfloat16")
    )
    rates = machine_rates(runner.device, tuple(dict.fromkeys((*dtypes, runner.info.dtype))))
    report: dict[str, Any] = {
        "model": runner.info.model_name,
        "device": runner.info.device,
        "threads": torch.get_num_threads(),
        "attention_backend": runner.info.attention_backend,
        "num_params": runner.info.num_params,
        "context": args.context[0],
        "machine": {k: round(v / 1e9, 2) for k, v in rates.items()},
        "machine_units": "GFLOP/s and GB/s",
        "results": [measure(runner, args, rates)],
    }
    if args.breakdown:
        report["breakdown"] = breakdown(runner, args)
    if args.compare_activations:
        report["gguf_activations"] = activations_ab(runner, args)
    if args.compare_kv_cache:
        report["kv_cache"] = kv_cache_ab(runner, args)
    if args.compare_chunk_attention:
        report["chunk_attention"] = chunk_attention_ab(runner, args)
    if args.compare_wide_steps:
        report["wide_steps"] = wide_steps_ab(runner, args)
    if args.compare_dtypes and args.model_shape is None:
        base = greedy_tokens(runner, 8, 32, 32)
        del runner
        # the bf16 pass is kept short: without AVX-512 BF16 / AMX, CPU bf16 matmuls are slow
        short = argparse.Namespace(
            **{
                **vars(args),
                "dtype": "bfloat16",
                "batches": [1, 8],
                "chunks": [256],
                "repeat": 3,
                "context": args.context[:1],
                "chunk_context": [0],
            }
        )
        other = build_runner(short)
        report["results"].append(measure(other, short, rates))
        alt = greedy_tokens(other, 8, 32, 32)
        same = sum(a == b for a, b in zip(base, alt, strict=True))
        report["bf16_vs_fp32_greedy"] = {
            "identical_sequences": same,
            "of": len(base),
            "identical_tokens": sum(
                x == y for a, b in zip(base, alt, strict=True) for x, y in zip(a, b, strict=True)
            ),
            "of_tokens": sum(len(a) for a in base),
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
