"""stepserve against OpenVINO GenAI on the same CPU, the same GGUF file and the same token
ids, offline on both sides (no HTTP), in one run. Prints JSON.

OpenVINO GenAI (`openvino-genai` on PyPI; it needs no torch) runs its
`ContinuousBatchingPipeline` (paged attention, continuous batching) on the GGUF directly.
It lives in a virtual environment of its own, given by `--openvino-python` (or the
`OPENVINO_PYTHON` variable):

    python3 -m venv ~/ov-venv && ~/ov-venv/bin/pip install openvino-genai
    python -m bench.vs_openvino --openvino-python ~/ov-venv/bin/python

Each engine runs in a fresh child process, one after the other, on the same requests:
stepserve through its offline API (`service.offline.LLM`, its default flags unless
`--stepserve-flags`) and through HTTP (`stepserve serve`, the batch sent at once,
unstreamed, by a client on the same cores; `--no-http` leaves it out), OpenVINO at its CPU
defaults and at f32 compute with an f16 KV cache.
Both get 1 GiB of KV cache, both are warmed up with one request first, and every request
is greedy with `ignore_eos`, so both generate exactly the tokens asked for. Scenarios:

- `saturating`: 48 requests at once, prompts of 32-512 random token ids, 16-128 output
  tokens each (seeded): total (prompt + output) tokens/s;
- `single`: one request, a 32-token prompt, 1 and then 129 output tokens; TPOT is the
  difference over 128 (median of three pairs);
- `prefill`: 16 prompts of 1,000 token ids at once, one output token each: prompt tokens/s;
- `accuracy`: the accuracy at which the speeds compare. Against stepserve's reference mode
  (float32, no quantization, eager: the numerics its parity tests hold to transformers), on
  the texts of stepserve's accuracy gate (`tests/worker/data`): teacher-forced top-1
  agreement over the first 320 tokens of each of its 7 texts (2,049 predictions, each read in
  a prefill: stepserve's prompt logprobs of the whole text, OpenVINO's greedy token after
  each prefix, 309k prompt tokens, since its pipeline returns no prompt logprobs), and
  greedy continuations of the gate's 9 prompts x 32 tokens (how many tokens agree before
  the first difference). Several minutes per OpenVINO variant.

`roofline` is this machine's measured matmul rate and copy bandwidth, and what they bound
for the model (one stream's TPOT, prefill tokens/s); `roofline_fraction` is how near each
engine came (1 is at the bound).

Ratios are stepserve (offline, and through HTTP) over OpenVINO (tokens/s: above 1 is
stepserve ahead; TPOT: below 1). `load_s` is each engine's time from its process's start
to ready (stepserve's includes the kernel probe and compiling the forward).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("saturating", "single", "prefill", "accuracy")
OPENVINO_VARIANTS = {
    "default": {},
    "f32_f16kv": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f16"},
}
KV_CACHE_GIB = 1
ID_RANGE = (100, 10_000)  # token ids every Llama-family vocabulary here holds
SINGLE_PAIRS = 3
GATE_DATA = ROOT / "tests" / "worker" / "data"  # the texts of stepserve's accuracy gate
ACCURACY_TOKENS = 320  # teacher-forced positions per text (OpenVINO's cost grows with the square)
GREEDY_TOKENS = 32
# stepserve's reference mode (the parity tests' REFERENCE in tests/support/worker_modes.py)
REFERENCE_FLAGS = ["--dtype", "float32", "--quantization", "none", "--enforce-eager"]


def workloads(seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """Each scenario's requests as (prompt token ids, output tokens)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*ID_RANGE) for _ in range(n)]

    single_prompt = ids(32)
    return {
        "saturating": [(ids(rng.randint(32, 512)), rng.randint(16, 128)) for _ in range(48)],
        "single": [(single_prompt, n) for _ in range(SINGLE_PAIRS) for n in (1, 129)],
        "prefill": [(ids(1000), 1) for _ in range(16)],
    }


def accuracy_inputs(model: str) -> dict[str, list[list[int]]]:
    """The accuracy gate's texts (cut to `ACCURACY_TOKENS`) and greedy prompts as the
    model's token ids, for the children (OpenVINO's has no stepserve tokenizer)."""
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    texts = json.loads((GATE_DATA / "varied_text.json").read_text())
    prompts = json.loads((GATE_DATA / "greedy_prompts.json").read_text())
    return {
        "texts": [tokenizer.encode(t)[:ACCURACY_TOKENS] for t in texts.values()],
        "prompts": [tokenizer.encode(p) for p in prompts],
    }


# -- the children: each engine in a process of its own ----------------------------------------


class _Engine:
    """What a child measures with: `generate(batch)` runs the batch at once and returns
    the output token counts."""

    def generate(self, batch: list[tuple[list[int], int]]) -> list[int]:
        raise NotImplementedError

    def teacher_forced(self, texts: list[list[int]]) -> list[list[int]]:
        """Per text, the top-1 token after each of its prefixes [0, i), i = 1 .. len - 1."""
        raise NotImplementedError

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Per prompt, its first `n` greedy tokens."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Stepserve(_Engine):
    def __init__(self, model: str, flags: list[str]) -> None:
        from service.offline import LLM

        self.llm = LLM(
            *flags, "--compile-wait", "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", model=model
        )

    def generate(self, batch: list[tuple[list[int], int]]) -> list[int]:
        bodies = [
            {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True} for p, n in batch
        ]
        return [body["usage"]["completion_tokens"] for body in self._answered(bodies)]

    def _answered(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The response bodies, in order; a refusal ends the measurement."""
        answers = self.llm.run(bodies, chat=False)
        bad = [a for a in answers if a.status != 200]
        if bad:
            raise RuntimeError(f"stepserve refused a request: {bad[0].body}")
        return [a.body for a in answers]

    def teacher_forced(self, texts: list[list[int]]) -> list[list[int]]:
        bodies = [
            {"prompt": t, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
             "return_tokens_as_token_ids": True}
            for t in texts
        ]
        return [
            [int(next(k for k, v in lp.items() if v["rank"] == 1)) for lp in lps[1:]]
            for lps in (body["choices"][0]["prompt_logprobs"] for body in self._answered(bodies))
        ]

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        bodies = [
            {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}
            for p in prompts
        ]
        return [list(body["choices"][0]["token_ids"]) for body in self._answered(bodies)]

    def close(self) -> None:
        self.llm.close()


class _StepserveHTTP(_Engine):
    """`stepserve serve` in a process of its own, the batch sent at once by an aiohttp
    client in this one (on the same cores), unstreamed."""

    def __init__(self, model: str, flags: list[str]) -> None:
        import contextlib

        from bench.servers import free_port, running, stepserve_cmd

        port = free_port()
        cmd = stepserve_cmd(
            port,
            os.cpu_count() or 1,
            [
                model,
                *flags,
                "--kv-cache-memory",
                f"{KV_CACHE_GIB}GiB",
                "--max-waiting-requests",
                "100000",
                "--disable-log-stats",
                "--disable-access-log",
            ],
        )
        self.stack = contextlib.ExitStack()
        self.url = self.stack.enter_context(running(cmd, port))

    def generate(self, batch: list[tuple[list[int], int]]) -> list[int]:
        import asyncio

        import aiohttp

        async def send() -> list[int]:
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(timeout=timeout) as session:

                async def one(prompt: list[int], n: int) -> int:
                    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
                    async with session.post(self.url + "/v1/completions", json=body) as resp:
                        data = await resp.json()
                        if resp.status != 200:
                            raise RuntimeError(f"stepserve answered {resp.status}: {data}")
                        return int(data["usage"]["completion_tokens"])

                return list(await asyncio.gather(*(one(p, n) for p, n in batch)))

        return asyncio.run(send())

    def close(self) -> None:
        self.stack.close()


class _OpenVINO(_Engine):
    def __init__(self, model: str, properties: dict[str, str]) -> None:
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        config = ov_genai.SchedulerConfig()
        config.cache_size = KV_CACHE_GIB
        self.pipe = ov_genai.ContinuousBatchingPipeline(model, config, "CPU", properties)

    def generate(self, batch: list[tuple[list[int], int]]) -> list[int]:
        return [len(tokens) for tokens in self._tokens(batch)]

    def _tokens(self, batch: list[tuple[list[int], int]]) -> list[list[int]]:
        import numpy as np
        import openvino as ov

        configs = []
        for _, n in batch:
            config = self.ov_genai.GenerationConfig()
            config.max_new_tokens, config.ignore_eos, config.do_sample = n, True, False
            configs.append(config)
        inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p, _ in batch]
        return [list(r.m_generation_ids[0]) for r in self.pipe.generate(inputs, configs)]

    def teacher_forced(self, texts: list[list[int]]) -> list[list[int]]:
        # no prompt logprobs from the pipeline: one request a prefix, one greedy token each
        return [[out[0] for out in self._tokens([(t[:i], 1) for i in range(1, len(t))])]
                for t in texts]

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        return self._tokens([(p, n) for p in prompts])


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, warm it up, and time each scenario's batch."""
    started = time.perf_counter()
    engine: _Engine
    if args.child == "stepserve":
        engine = _Stepserve(args.model, args.stepserve_flags)
    elif args.child == "stepserve-http":
        engine = _StepserveHTTP(args.model, args.stepserve_flags)
    else:
        engine = _OpenVINO(args.model, OPENVINO_VARIANTS[args.variant])
    load_s = time.perf_counter() - started
    work = workloads(args.seed)
    out: dict[str, Any] = {"load_s": round(load_s, 2)}
    try:
        engine.generate([([1000 + i for i in range(16)], 8)])  # warm-up
        for name in args.scenarios:
            if name == "accuracy":
                inputs = json.loads(Path(args.accuracy_input).read_text())
                out[name] = {
                    "teacher_forced": engine.teacher_forced(inputs["texts"]),
                    "greedy": engine.greedy(inputs["prompts"], GREEDY_TOKENS),
                }
                continue
            batch = work[name]
            if name == "single":
                walls = []
                for prompt, n in batch:
                    t0 = time.perf_counter()
                    got = engine.generate([(prompt, n)])
                    walls.append(time.perf_counter() - t0)
                    _check(name, got, [n])
                pairs = [(walls[i + 1] - walls[i]) / 128 for i in range(0, len(walls), 2)]
                out[name] = {
                    "tpot_ms": round(statistics.median(pairs) * 1e3, 3),
                    "tpot_ms_pairs": [round(p * 1e3, 3) for p in pairs],
                }
                continue
            t0 = time.perf_counter()
            got = engine.generate(batch)
            wall = time.perf_counter() - t0
            _check(name, got, [n for _, n in batch])
            prompt_tokens = sum(len(p) for p, _ in batch)
            output_tokens = sum(got)
            out[name] = {
                "wall_s": round(wall, 3),
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 1),
                "prompt_tokens_per_s": round(prompt_tokens / wall, 1),
            }
    finally:
        engine.close()
    return out


def _check(name: str, got: list[int], want: list[int]) -> None:
    if got != want:
        raise RuntimeError(f"{name}: generated {got[:8]}... tokens, asked for {want[:8]}...")


# -- the parent ------------------------------------------------------------------------------


def openvino_python(given: str | None) -> str | None:
    """The interpreter that imports openvino_genai, if any."""
    for candidate in (given, os.environ.get("OPENVINO_PYTHON"), sys.executable):
        if not candidate:
            continue
        exe = shutil.which(os.path.expanduser(candidate)) or os.path.expanduser(candidate)
        probe = subprocess.run(
            [exe, "-c", "import openvino_genai"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return exe
    return None


def child(python: str, *args: str, timeout: float) -> dict[str, Any]:
    """One engine measured in a fresh process: its JSON line, or the error it ended with."""
    cmd = [python, "-m", "bench.vs_openvino", *args]
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-2000:]}
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


def roofline(model: str) -> dict[str, Any]:
    """This machine's measured rates (`bench.worker_step.machine_rates`: dense 1024-square
    matmuls in float32 and bfloat16, a large copy) and what they bound for the model: one
    stream's TPOT at the GGUF's tensor bytes read once a token, and prefill tokens/s at 2 x
    the block matmuls' parameters a token (embedding and output head left out: a prefill
    samples once a prompt) at the faster dense rate. Integer dot products may beat that
    rate, so a prefill fraction may pass 1."""
    import math

    import torch

    from bench.worker_step import machine_rates
    from common.gguf_file import GGUFFile

    rates = machine_rates(torch.device("cpu"))
    tensors = GGUFFile(model).tensors
    tensor_bytes = sum(t.data.nbytes for t in tensors)
    matmul_params = sum(
        math.prod(t.shape) for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2
    )
    flops = max(rates["matmul_flops_float32"], rates["matmul_flops_bfloat16"])
    return {
        "rates": {k: round(v / 1e9, 1) for k, v in rates.items()},  # GFLOP/s, GB/s
        "tensor_bytes": tensor_bytes,
        "matmul_params": matmul_params,
        "tpot_ms": round(tensor_bytes / rates["copy_bandwidth_bytes"] * 1e3, 3),
        "prefill_tokens_per_s": round(flops / (2 * matmul_params), 1),
    }


def fractions(measured: dict[str, Any], bound: dict[str, Any]) -> dict[str, float | None]:
    """How near an engine came to the roofline: bound / measured TPOT, measured / bound
    prefill tokens/s."""
    tpot = measured.get("single", {}).get("tpot_ms")
    prefill = measured.get("prefill", {}).get("prompt_tokens_per_s")
    return {
        "decode": round(bound["tpot_ms"] / tpot, 3) if tpot else None,
        "prefill": round(prefill / bound["prefill_tokens_per_s"], 3) if prefill else None,
    }


def agreement(measured: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """An engine's accuracy against the reference's predictions: teacher-forced top-1
    agreement, and per greedy prompt the tokens before the first difference."""
    ours, ref = measured.pop("accuracy"), reference["accuracy"]
    pairs = [
        (a, b) for got, want in zip(ours["teacher_forced"], ref["teacher_forced"], strict=True)
        for a, b in zip(got, want, strict=True)
    ]
    same = sum(a == b for a, b in pairs)
    prefix = [
        next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        for got, want in zip(ours["greedy"], ref["greedy"], strict=True)
    ]
    return {
        "teacher_forced_top1": round(same / len(pairs), 4),
        "positions": len(pairs),
        "greedy_identical": f"{sum(p == GREEDY_TOKENS for p in prefix)}/{len(prefix)}",
        "greedy_tokens_before_first_difference": prefix,
    }


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """stepserve over OpenVINO, per scenario."""
    out: dict[str, float | None] = {}
    for name, key in (
        ("saturating", "total_tokens_per_s"),
        ("prefill", "prompt_tokens_per_s"),
        ("single", "tpot_ms"),
    ):
        a, b = ours.get(name, {}).get(key), theirs.get(name, {}).get(key)
        out[f"{name}_{key}"] = round(a / b, 3) if a and b else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    parser.add_argument(
        "--openvino-python", default=None, help="the interpreter of OpenVINO GenAI's environment"
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument(
        "--variants", nargs="+", choices=tuple(OPENVINO_VARIANTS), default=list(OPENVINO_VARIANTS)
    )
    parser.add_argument(
        "--stepserve-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="flags for stepserve's engine (last on the line)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per child")
    parser.add_argument(
        "--no-http",
        action="store_true",
        help="leave out stepserve through HTTP (its server and a client)",
    )
    parser.add_argument(
        "--child", choices=("stepserve", "stepserve-http", "openvino"), help=argparse.SUPPRESS
    )
    parser.add_argument("--variant", choices=tuple(OPENVINO_VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--accuracy-input", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    python = openvino_python(args.openvino_python)
    if python is None:
        print(
            "OpenVINO GenAI is not importable: install it in an environment of its own "
            "(python3 -m venv ~/ov-venv && ~/ov-venv/bin/pip install openvino-genai) and "
            "pass --openvino-python ~/ov-venv/bin/python",
            file=sys.stderr,
        )
        return 2
    from bench.servers import cpu_info
    from common.model_files import find_default_model

    model = args.model or str(find_default_model())
    base = ["--model", model, "--seed", str(args.seed)]
    speed = [name for name in args.scenarios if name != "accuracy"]
    inputs: list[str] = []  # --accuracy-input FILE when accuracy is measured
    probe = "import openvino_genai; print(openvino_genai.__version__)"
    version = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=False
    ).stdout.strip()
    result: dict[str, Any] = {
        "benchmark": "vs_openvino",
        "cpu": cpu_info(),
        "model": model,
        "openvino_genai": version,
        "stepserve_flags": args.stepserve_flags,
        "kv_cache_gib": KV_CACHE_GIB,
    }
    reference: dict[str, Any] = {}
    if "accuracy" in args.scenarios:
        import tempfile

        held = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115
        with held:
            json.dump(accuracy_inputs(model), held)
        inputs = ["--accuracy-input", held.name]
        reference = child(
            sys.executable, *base, "--scenarios", "accuracy", *inputs, "--child", "stepserve",
            "--stepserve-flags", *REFERENCE_FLAGS, timeout=args.timeout,
        )
        result["accuracy_reference"] = {"stepserve_flags": REFERENCE_FLAGS}
    # the HTTP arm runs the offline arm's engine: only its speed is measured
    arms = ["stepserve"] + ([] if args.no_http or not speed else ["stepserve-http"])
    for arm in arms:
        scenarios = args.scenarios if arm == "stepserve" else speed
        result[arm.replace("-", "_")] = child(
            sys.executable,
            *base,
            "--scenarios",
            *scenarios,
            *inputs,
            "--child",
            arm,
            "--stepserve-flags",
            *args.stepserve_flags,
            timeout=args.timeout,
        )
    for variant in args.variants:
        theirs = child(
            python, *base, "--scenarios", *args.scenarios, *inputs, "--child", "openvino",
            "--variant", variant, timeout=args.timeout,
        )
        result[f"openvino_{variant}"] = theirs
        for arm in arms:
            key = arm.replace("-", "_")
            result[f"ratio_{key}_over_openvino_{variant}"] = ratios(result[key], theirs)
    if inputs:
        os.unlink(inputs[1])
        if "accuracy" not in reference:
            result["accuracy_reference"]["error"] = reference.get("error", "no predictions")
        for name in ["stepserve"] + [f"openvino_{v}" for v in args.variants]:
            if "accuracy" in result[name] and "accuracy" in reference:
                result[name]["accuracy"] = agreement(result[name], reference)
    bound = roofline(model)
    result["roofline"] = bound
    result["roofline_fraction"] = {
        name: fractions(result[name], bound)
        for name in [a.replace("-", "_") for a in arms] + [f"openvino_{v}" for v in args.variants]
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
