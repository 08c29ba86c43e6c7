"""Output-length predictors: how many tokens a request will generate, guessed before it runs.

The `sjf` policy ranks waiting requests by predicted remaining work, and the
`least_remaining` victim policy preempts the running request with the least of it. Both
read `Request.predicted_output_tokens`, which the scheduler sets once, when the request is
added (so a waiting request's rank never changes under it). Two predictors:

- `MaxTokensPredictor`: the request's own bound, `max_tokens`. Exact when clients ask for
  what they get; pessimistic when they leave max_tokens at a generous default.
- `LearnedPredictor`: the running mean output length of finished requests of the same
  tenant (the OpenAI `user`) and prompt-length bucket (powers of two), falling back to the
  tenant alone, then the bucket alone, then every request; `max_tokens` until enough have
  finished. Never above `max_tokens`, never below `min_tokens`.

Each predictor scores itself: when a request finishes by stop or length (not by abort),
the absolute error of its prediction is added to `error` (exported to /metrics).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from scheduler.config import Predictor
from scheduler.request import Request


@dataclass
class PredictionError:
    """Cumulative |predicted - actual| output tokens over scored requests."""

    count: int = 0
    abs_sum: float = 0.0

    def add(self, predicted: int, actual: int) -> None:
        self.count += 1
        self.abs_sum += abs(predicted - actual)

    @property
    def mean(self) -> float:
        return self.abs_sum / self.count if self.count else 0.0


class OutputLengthPredictor(Protocol):
    name: str
    error: PredictionError

    def predict(self, req: Request) -> int:
        """Output tokens `req` will generate in all, in [max(min_tokens, 1), max_tokens]."""

    def observe(self, req: Request) -> None:
        """`req` finished by stop or length: score its prediction and learn from it."""


def _clamp(value: float, req: Request) -> int:
    sp = req.sampling_params
    return int(min(max(round(value), sp.min_tokens, 1), sp.max_tokens))


def remaining_work(req: Request) -> int:
    """Tokens still to compute: known tokens without KV (the prompt, and after a recompute
    preemption the outputs so far) plus predicted outputs not sampled yet."""
    predicted = req.predicted_output_tokens or req.sampling_params.max_tokens
    to_generate = max(predicted - req.num_output_tokens - req.num_placeholders, 0)
    return max(req.num_tokens - req.num_computed_tokens, 0) + to_generate


class MaxTokensPredictor:
    """Predicts the bound itself."""

    name = "max_tokens"

    def __init__(self) -> None:
        self.error = PredictionError()

    def predict(self, req: Request) -> int:
        return req.sampling_params.max_tokens

    def observe(self, req: Request) -> None:
        if req.predicted_output_tokens is not None:
            self.error.add(req.predicted_output_tokens, req.num_output_tokens)


class _Mean:
    """A running mean that becomes an exponential average after `window` samples, so it
    follows a tenant whose lengths drift."""

    __slots__ = ("count", "mean")

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0

    def add(self, x: float, window: int) -> None:
        self.count += 1
        self.mean += (x - self.mean) / min(self.count, window)


def prompt_bucket(num_prompt_tokens: int) -> int:
    """Bucket b holds prompts of 2**b to 2**(b+1) - 1 tokens."""
    return max(num_prompt_tokens, 1).bit_length() - 1


class LearnedPredictor:
    """Mean output length per (tenant, prompt bucket), learned online from finished requests."""

    name = "learned"

    def __init__(self, window: int = 64, min_samples: int = 2, max_cells: int = 8192) -> None:
        self.window = window
        self.min_samples = min_samples
        self.max_cells = max_cells  # bounds memory under many tenants; oldest cells go first
        self.error = PredictionError()
        self._cells: OrderedDict[tuple[str | None, int | None], _Mean] = OrderedDict()

    @staticmethod
    def _keys(req: Request) -> tuple[tuple[str | None, int | None], ...]:
        bucket = prompt_bucket(req.num_prompt_tokens)
        return (req.tenant, bucket), (req.tenant, None), (None, bucket), (None, None)

    def predict(self, req: Request) -> int:
        for key in self._keys(req):
            cell = self._cells.get(key)
            if cell is not None and cell.count >= self.min_samples:
                return _clamp(cell.mean, req)
        return req.sampling_params.max_tokens

    def observe(self, req: Request) -> None:
        if req.predicted_output_tokens is not None:
            self.error.add(req.predicted_output_tokens, req.num_output_tokens)
        for key in self._keys(req):
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = _Mean()
            else:
                self._cells.move_to_end(key)
            cell.add(req.num_output_tokens, self.window)
        while len(self._cells) > self.max_cells:
            self._cells.popitem(last=False)


def make_predictor(name: Predictor) -> OutputLengthPredictor:
    return MaxTokensPredictor() if name == "max_tokens" else LearnedPredictor()
