"""`SamplingParams`: how one request samples and when it stops, validated at construction.

The scheduler reads the stop fields (max/min tokens, stop token ids, ignore_eos); the
worker's sampler reads the rest. Stop *strings* live in the service, which sees text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM names and meanings)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs to return with each sampled token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    priority: int = 0  # lower value = more urgent (as in vLLM)
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logits before sampling
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # vLLM's allowed_token_ids: only these may be sampled (None: all)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words, as token-id sequences: a word's last token is banned whenever the output
    # ends with the rest of it (a one-token word is always banned)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # structured outputs: the grammar (llguidance's text, `common.grammar`) every output
    # token must follow; the worker masks the logits with it, the scheduler never reads it
    grammar: str | None = None
    # vLLM's prompt_logprobs: the log-probability of each prompt token (after the first) and
    # this many top alternatives at its position (0: the token's alone); None: not computed
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids)
        )
        self._check_token_controls()
        self._check(
            self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        self._check(
            self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"
        )
        self._check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        self._check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be >= 0, got {self.temperature}",
        )
        self._check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self._check(
            self.top_k == -1 or self.top_k >= 0,
            "top_k",
            f"top_k must be -1 (disabled) or >= 0, got {self.top_k}",
        )
        self._check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        self._check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        self._check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"logprobs must be between 0 and 20, got {self.logprobs}",
        )
        self._check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}",
        )
        self._check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        self._check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        self._check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        self._check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative",
        )
        self._check(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            f"seed must be a 64-bit integer, got {self.seed}",
        )

    def _check_token_controls(self) -> None:
        bias = self.logit_bias
        self._check(
            all(t >= 0 and -100.0 <= b <= 100.0 for t, b in bias),
            "logit_bias",
            "logit_bias maps token ids (>= 0) to biases in [-100, 100]",
        )
        self._check(
            len({t for t, _ in bias}) == len(bias), "logit_bias", "logit_bias names a token twice"
        )
        allowed = self.allowed_token_ids
        self._check(
            allowed is None or (len(allowed) > 0 and all(t >= 0 for t in allowed)),
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of token ids (>= 0)",
        )
        self._check(
            all(len(w) > 0 and all(t >= 0 for t in w) for w in self.bad_words_token_ids),
            "bad_words",
            "every bad word must tokenize to at least one token",
        )
        self._check(
            self.grammar is None or not self.ignore_eos,
            "ignore_eos",
            "ignore_eos cannot be combined with structured outputs: a finished grammar allows "
            "only the end-of-sequence token",
        )

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name, for a check against the vocabulary."""
        ids = [*self.stop_token_ids, *(t for t, _ in self.logit_bias)]
        ids += [*(self.allowed_token_ids or ()), *(t for w in self.bad_words_token_ids for t in w)]
        return ids

    @staticmethod
    def _check(ok: bool, param: str, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
