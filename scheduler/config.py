"""`SchedulerConfig`: the scheduler's knobs, validated once at construction.

Each field that has a flag has the flag's name (`--max-num-seqs` is `max_num_seqs`), named
after `vllm serve` where the concept is the same; its default here is the flag's default
(`scheduler.flags` declares the flags from these fields). Invalid combinations raise
`ValueError` with a message that names the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from scheduler.slo import SLOClasses
from scheduler.step_cost import StepCostFn, flop_rate_cost

SchedulingPolicy = Literal["fcfs", "priority", "sjf", "fair", "slo"]
PreemptionMode = Literal["recompute", "swap", "auto"]
VictimPolicy = Literal[
    "newest", "priority", "fewest_output", "least_remaining", "largest_kv", "slack"
]
Predictor = Literal["learned", "max_tokens"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority", "sjf", "fair", "slo")
VICTIM_POLICIES: tuple[VictimPolicy, ...] = (
    "newest", "priority", "fewest_output", "least_remaining", "largest_kv", "slack",
)
PREDICTORS: tuple[Predictor, ...] = ("learned", "max_tokens")


DEFAULT_TOKEN_BUDGET = 2048


def token_budget(
    given: int | None,
    enable_chunked_prefill: bool,
    max_model_len: int,
    default: int = DEFAULT_TOKEN_BUDGET,
) -> int:
    """`max_num_batched_tokens`: the one given, else `default` (vLLM's server default on the
    CPU, 2048, unless the run is offline), or enough for a whole max-length prompt in one
    step when prompts cannot be chunked."""
    if given is not None:
        return given
    return default if enable_chunked_prefill else max(default, max_model_len)


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets, policies and preemption settings for one `Scheduler`."""

    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    max_num_seqs: int = 128
    max_model_len: int = 2048
    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0  # host swap slots; 0 disables swap preemption
    scheduling_policy: SchedulingPolicy = "fcfs"
    aging_period: float = 10.0  # seconds of waiting that buy one priority level
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a chunk is only capped by the token budget
    preemption_mode: PreemptionMode = "recompute"
    victim_policy: VictimPolicy | None = (
        None  # None: "priority" under the priority policy, else "newest"
    )
    # Output-length prediction (sjf ranks and least_remaining victims; see scheduler/predictor.py).
    output_len_predictor: Predictor = "learned"
    sjf_aging_rate: float = 100.0  # tokens of predicted work forgiven per second of waiting
    # Virtual Token Counter (policy "fair"; see scheduler/fairness.py): cost per token served.
    fair_prompt_weight: float = 1.0
    fair_output_weight: float = 2.0
    tenant_weights: tuple[tuple[str, float], ...] = ()  # (tenant, share weight); others weigh 1
    enable_prefix_caching: bool = True
    priority_preemption_threshold: int | None = (
        None  # None: waiting requests never preempt running ones
    )
    # preemption_mode="auto" prices a swap at swap_bandwidth (the server passes the worker's
    # measured copy bandwidth) and a recompute with step_cost, or without one, dense FLOPs
    # at compute_rate (defaults: a Llama-3.1-8B-shaped model on an A100).
    kv_bytes_per_token: int = 131072
    flops_per_token: float = 16e9
    swap_bandwidth: float = 16e9  # bytes/s over the host link, one direction
    compute_rate: float = 312e12  # FLOP/s
    # The step-time budget (`--max-step-ms`): while any request decodes, prefill chunks
    # shrink so that step_cost(step) <= max_step_ms. It applies where there is a step_cost
    # model to predict a step with and prompts can be chunked (`step_time_limit_s`); 0: off,
    # chunks are sized by tokens alone. step_cost also prices recompute under "auto".
    max_step_ms: float = 150.0
    # `--min-prefill-share`: with decodes alone over (1 - share) x the budget, a step may run
    # to their predicted time / (1 - share), so prefill keeps this share of every step
    # (0: the budget is a cap).
    min_prefill_share: float = 0.5
    # Objectives (scheduler/slo.py): the server's per class, for requests that set none.
    # Every policy measures against them; "slo" schedules by them (docs/scheduling.md).
    slo_classes: SLOClasses = field(default_factory=SLOClasses)
    slo_demotion_s: float = 10.0  # slo: how long a request whose deadline is lost yields
    # Answer a request whose TTFT objective the forecast says cannot be met with a refusal
    # and the predicted wait until it could be (the server's 429 with Retry-After).
    reject_unmeetable: bool = False
    step_cost: StepCostFn | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        positive = (
            "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
            "num_gpu_blocks",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                f"{self.scheduling_policy!r}"
            )
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(
                "preemption_mode must be 'recompute', 'swap' or 'auto', got "
                f"{self.preemption_mode!r}"
            )
        if self.victim_policy is not None and self.victim_policy not in VICTIM_POLICIES:
            raise ValueError(
                f"victim_policy must be one of {', '.join(VICTIM_POLICIES)}, got "
                f"{self.victim_policy!r}"
            )
        self._check_policy_fields()
        if self.preemption_mode in ("swap", "auto") and self.num_cpu_blocks == 0:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} needs num_cpu_blocks > 0 (swap space)"
            )
        if self.aging_period <= 0:
            raise ValueError(f"aging_period must be > 0 seconds, got {self.aging_period}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is off, "
                "or long prompts could never run"
            )
        if self.priority_preemption_threshold is not None and self.scheduling_policy != "priority":
            raise ValueError("priority_preemption_threshold needs scheduling_policy='priority'")
        if (
            self.priority_preemption_threshold is not None
            and self.priority_preemption_threshold < 1
        ):
            raise ValueError(
                "priority_preemption_threshold must be >= 1, got "
                f"{self.priority_preemption_threshold}"
            )
        for name in ("kv_bytes_per_token", "flops_per_token", "swap_bandwidth", "compute_rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self._check_time_budget()

    def _check_time_budget(self) -> None:
        if not self.max_step_ms >= 0:  # also rejects NaN
            raise ValueError(f"max_step_ms must be >= 0, got {self.max_step_ms}")
        if not 0.0 <= self.min_prefill_share < 1.0:  # also rejects NaN
            raise ValueError(f"min_prefill_share must be in [0, 1), got {self.min_prefill_share}")
        if not (self.slo_demotion_s >= 0 and self.slo_demotion_s < float("inf")):
            raise ValueError(f"slo_demotion_s must be >= 0 seconds, got {self.slo_demotion_s}")
        if self.reject_unmeetable and self.step_cost is None:
            raise ValueError("reject_unmeetable needs a step-cost model to forecast with")

    @property
    def step_time_limit_s(self) -> float:
        """The step-time budget in seconds as the scheduler applies it: 0 (off) without a
        step-cost model or without chunked prefill, since it sizes prefill chunks."""
        if self.step_cost is None or not self.enable_chunked_prefill:
            return 0.0
        return self.max_step_ms / 1e3

    @property
    def holds_prefill_only_steps(self) -> bool:
        """Whether a step without decodes keeps the step-time target (the slo policy: an
        urgent arrival must not wait behind a prefill-only step of seconds) instead of
        taking the whole token budget."""
        return self.scheduling_policy == "slo"

    @property
    def recompute_cost(self) -> StepCostFn:
        """What prices a recompute under preemption_mode="auto": the step-cost model when
        there is one, else dense FLOPs at `compute_rate`."""
        return self.step_cost or flop_rate_cost(self.flops_per_token, self.compute_rate)

    def _check_policy_fields(self) -> None:
        if self.output_len_predictor not in PREDICTORS:
            raise ValueError(
                f"output_len_predictor must be one of {', '.join(PREDICTORS)}, got "
                f"{self.output_len_predictor!r}"
            )
        if not self.sjf_aging_rate > 0:
            raise ValueError(
                f"sjf_aging_rate must be > 0 tokens per second, got {self.sjf_aging_rate}"
            )
        for name in ("fair_prompt_weight", "fair_output_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.fair_prompt_weight + self.fair_output_weight <= 0:
            raise ValueError("fair_prompt_weight and fair_output_weight cannot both be 0")
        names = [name for name, _ in self.tenant_weights]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant_weights names a tenant twice: {names}")
        for name, weight in self.tenant_weights:
            if not weight > 0:
                raise ValueError(f"tenant_weights: weight of {name!r} must be > 0, got {weight}")

    @property
    def effective_victim_policy(self) -> VictimPolicy:
        if self.victim_policy is not None:
            return self.victim_policy
        if self.scheduling_policy == "slo":
            return "slack"
        return "priority" if self.scheduling_policy == "priority" else "newest"


# An offline run (`stepserve generate`, `service.offline.LLM`) answers whole responses, so no
# one waits between its tokens: it takes vLLM's CPU defaults for its LLM class (4,096 tokens
# and 256 requests a step against the server's 2,048 and 128) and no step-time budget, whose
# short steps buy inter-token latency with throughput (docs/scheduling.md).
OFFLINE_DEFAULTS = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256, max_step_ms=0.0)
