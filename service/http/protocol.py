"""OpenAI-compatible request bodies (pydantic v2) and their translation to `SamplingParams`.

Types are strict: a string where a number belongs is a 400, not a silent coercion. Ranges
are those the OpenAI API documents (temperature 0..2, top_p 0..1, penalties -2..2,
logit_bias -100..100, completions `logprobs` 0..5, chat `top_logprobs` 0..20, n and
max_tokens at least 1) and, for the vLLM extensions, those vLLM's `SamplingParams` enforces
(top_k >= -1, min_p 0..1, repetition_penalty > 0, min_tokens >= 0); a value outside one is
a 400 naming the field. `SamplingParams` checks what it needs again (and what relates two
fields, such as min_tokens <= max_tokens).

Every field OpenAI or vLLM defines for these routes is declared here and either honoured or
refused by name: a 400 whose `param` is the field and whose message says it is not
supported yet. A null value means the field's default (the SDKs send null for what they
leave unset). Keys neither defines are ignored, as OpenAI does, and logged at debug level.

A field a request leaves unset takes the server's `GenerationDefaults` (the model's
generation_config.json, as vLLM's `--generation-config auto`), else `SamplingParams`' default.

A request's objectives (scheduler/slo.py) come as stepserve's fields `slo_ttft_ms` and
`slo_tpot_ms`, or from a gateway as the headers `x-slo-ttft-ms` and `x-slo-tpot-ms`; the
field wins over the header for the same objective (`SamplingRequest.objectives`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.grammar import Constraint, GrammarFormat
from scheduler.sampling import SamplingParams, SamplingParamsError
from scheduler.slo import SLO
from service.engine.detokenizer import DetokenizeOptions
from service.http.errors import APIError, bad_request

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # matching costs up to O(len) per token in the engine's loop
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)
# chat_template_kwargs may not set what the chat itself sets
RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt",
     "continue_final_message", "chat_template", "tokenize"}
)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for the requests that leave a field unset (None: no default here)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config.json's max_new_tokens

    def __post_init__(self) -> None:
        """Ranges as `SamplingParams` checks them; SamplingParamsError names the field."""
        SamplingParams(**self.sampling())
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
            )

    def sampling(self) -> dict[str, Any]:
        """The sampling fields that have a default."""
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name != "max_tokens" and (v := getattr(self, f.name)) is not None
        }

    def describe(self) -> str:
        """'temperature=0.6, top_p=0.9' for the start-up log ('none' when nothing is set)."""
        items = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return ", ".join(f"{k}={v:g}" for k, v in items if v is not None) or "none"


NO_DEFAULTS = GenerationDefaults()
# where `create_app` keeps the server's defaults for the routes
GENERATION_DEFAULTS = web.AppKey("stepserve_generation_defaults", GenerationDefaults)


# objective field -> the header a gateway may set it with instead (milliseconds)
SLO_HEADERS = {"slo_ttft_ms": "x-slo-ttft-ms", "slo_tpot_ms": "x-slo-tpot-ms"}
_DECIMAL = re.compile(r"\s*\+?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def header_ms(headers: Mapping[str, str], name: str) -> float | None:
    """A header's positive, finite number of milliseconds (None: not sent); else a 400
    naming the header."""
    raw = headers.get(name)
    if raw is None:
        return None
    value = float(raw) if _DECIMAL.fullmatch(raw) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise bad_request(
            f"header {name} must be a positive number of milliseconds, got {raw!r:.40}", name
        )
    return value


def not_supported(param: str, note: str = "") -> APIError:
    """The 400 for a field this server does not honour yet."""
    return bad_request(f"'{param}' is not supported yet{f' ({note})' if note else ''}", param)


def _is_unset(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None or value in neutral:
        return True
    return isinstance(value, (str, list, dict)) and not value


class Body(BaseModel):
    """A request body: strict types, null meaning the default, unknown keys ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    # fields declared so that they are refused by name: field -> (values that ask for
    # nothing, note for the message)
    REFUSED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = sorted(str(k) for k in data if k not in cls.model_fields)
        if unknown:
            log.debug("%s: ignoring unknown fields %s", cls.__name__, unknown)
        return {k: v for k, v in data.items() if v is not None}

    def check_refused(self) -> None:
        """A 400 for the first field set that this server does not honour yet."""
        for name, (neutral, note) in self.REFUSED.items():
            if not _is_unset(getattr(self, name), neutral):
                raise not_supported(name, note)


SAMPLING_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search"),
    "length_penalty": ((1.0,), "it applies to beam search"),
    "structural_tag": ((), "structural tags (JSON schema, regex, choice and grammar are)"),
    "guided_decoding_backend": (
        ("auto", "guidance", "llguidance"), "a grammar engine other than llguidance"
    ),
    "guided_whitespace_pattern": ((), "a custom whitespace pattern"),
    "logits_processors": ((), "custom logits processors"),
    "cache_salt": ((), "a per-request prefix-cache salt"),
    "kv_transfer_params": ((), "disaggregated serving"),
    "vllm_xargs": ((), "this server has no extension that reads them"),
    "mm_processor_kwargs": ((), "this server serves a text-only model"),
    "store": ((False,), "this server does not store completions"),
    "metadata": ((), "it belongs to stored completions, which this server does not keep"),
    "service_tier": (("auto", "default"), "only 'auto' and 'default'"),
}


class StreamOptions(Body):
    """`stream_options`: the usage chunk at the end, and usage in every chunk (vLLM)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False


class JsonSchemaFormat(Body):
    """`response_format.json_schema`: a named schema; `strict` is always honoured (the output
    follows the schema whether or not it is set)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """`response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    REFUSED = {
        "structural_tag": ((), "structural tags"),
        "whitespace_pattern": ((), "a custom whitespace pattern"),
        "disable_additional_properties": ((False,), "rewriting the schema's additionalProperties"),
    }

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_fallback: bool | None = None  # one grammar engine: never a fallback either way
    disable_additional_properties: Any = None
    backend: Any = None

    def constraint(self, param: str) -> Constraint:
        for name, (neutral, note) in self.REFUSED.items():
            if not _is_unset(getattr(self, name), neutral):
                raise not_supported(f"{param}.{name}", note)
        if self.backend not in (None, "auto", "guidance", "llguidance"):
            raise not_supported(f"{param}.backend", "a grammar engine other than llguidance")
        kinds: list[tuple[GrammarFormat, Any]] = [
            ("json", self.json_), ("regex", self.regex), ("choice", self.choice),
            ("grammar", self.grammar), ("json_object", self.json_object or None),
        ]
        given = [(k, v) for k, v in kinds if v is not None]
        if len(given) != 1:
            raise bad_request(
                f"{param} must set exactly one of json, regex, choice, grammar and "
                f"json_object; got {[k for k, _ in given] or 'none'}", param,
            )
        # vLLM's default lets JSON carry any whitespace; see common.grammar for ours
        any_ws = self.disable_any_whitespace is False
        return Constraint(given[0][0], given[0][1], any_whitespace=any_ws)


Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]


class SamplingRequest(Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    REFUSED = SAMPLING_REFUSED

    model: str | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    n: Annotated[int, Field(ge=1)] = 1
    best_of: Annotated[int | None, Field(ge=1)] = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: dict[str, float] | None = None  # token-id strings -> -100..100
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`: the tenant without one
    prompt_cache_key: str | None = None  # a cache hint: the prefix cache matches without one
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: Annotated[int | None, Field(ge=-1)] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # in the vocabulary: checked by the route
    repetition_penalty: Annotated[float | None, Field(gt=0.0)] = None
    priority: int = 0
    # objectives in milliseconds (scheduler/slo.py; headers x-slo-ttft-ms, x-slo-tpot-ms)
    slo_ttft_ms: Annotated[float | None, Field(gt=0.0)] = None
    slo_tpot_ms: Annotated[float | None, Field(gt=0.0)] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int | None, Field(ge=-1)] = None  # -1: max_model_len
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    request_id: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    # the prompt's logprobs with this many alternatives (-1, the whole vocabulary, is refused)
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # declared to be refused by name (see REFUSED)
    use_beam_search: Any = None
    length_penalty: Any = None
    # structured outputs (`constraint`)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of structured outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple; empty strings are rejected by `check`."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        """A usage chunk ends the stream (continuous_usage_stats alone asks for it too)."""
        opts = self.stream_options
        if not self.stream or opts is None:
            return False
        return opts.include_usage if opts.include_usage is not None else opts.continuous_usage_stats

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        opts = self.stream_options
        return opts is not None and self.include_usage and opts.continuous_usage_stats

    @property
    def tenant(self) -> str | None:
        return self.user or self.safety_identifier

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def generates(self) -> bool:
        """Whether the response shows generated tokens (completions' max_tokens 0 does not)."""
        return True

    def check(self) -> None:
        """Checks pydantic cannot express, and the refusals of what is not honoured yet."""
        self._check_stops()
        self._check_stream_options()
        self.check_refused()
        self.constraint()
        if self.best_of is not None and self.best_of != self.n:
            if self.best_of < self.n:
                raise bad_request(f"best_of ({self.best_of}) must be at least n ({self.n})",
                                  "best_of")
            raise not_supported("best_of", "best_of greater than n")
        self.logit_bias_pairs()
        for i, word in enumerate(self.bad_words or ()):
            if not word.strip():
                raise bad_request(f"bad_words[{i}] must not be empty or blank", "bad_words")

    def constraint(self) -> tuple[str, Constraint] | None:
        """The structured-output constraint and the field that set it; None without one.
        A 400 names the field when it is malformed or more than one field sets one."""
        found: list[tuple[str, Constraint]] = []
        rf = self.response_format
        if rf is not None and rf.type == "structural_tag":
            raise not_supported("response_format", "type 'structural_tag'")
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", Constraint("json_object")))
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            found.append(("response_format", Constraint("json", rf.json_schema.schema_)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs",
                          self.structured_outputs.constraint("structured_outputs")))
        older: list[tuple[str, GrammarFormat, Any]] = [
            ("guided_json", "json", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        found += [(name, Constraint(kind, spec)) for name, kind, spec in older if spec is not None]
        if len(found) > 1:
            raise bad_request(
                f"only one structured-output constraint per request; got {[n for n, _ in found]}",
                found[1][0],
            )
        return found[0] if found else None

    def _check_stops(self) -> None:
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", "stop"
            )
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise bad_request(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters", "stop"
            )

    def _check_stream_options(self) -> None:
        opts = self.stream_options
        if opts is None:
            return
        if not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if opts.continuous_usage_stats and opts.include_usage is False:
            raise bad_request(
                "stream_options.continuous_usage_stats needs include_usage",
                "stream_options.continuous_usage_stats",
            )
        if opts.include_obfuscation:
            raise not_supported("stream_options.include_obfuscation")

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` with its keys (token-id strings) as ints; 400 naming the field for a
        key that is not one or a bias outside OpenAI's -100..100."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r:.40}", "logit_bias"
                ) from None
            if not -100.0 <= bias <= 100.0:
                raise bad_request(
                    f"logit_bias values must be between -100 and 100, got {bias:g} for {key}",
                    "logit_bias",
                )
            pairs.append((token, bias))
        return tuple(pairs)

    PROMPT_FIELD: ClassVar[str] = "prompt"  # what holds the prompt, for error messages

    def max_tokens_field(self) -> str:
        """The field that holds the completion budget (chat has two names for it)."""
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for (None: the route's default)."""
        return self.max_tokens

    def unset_max_tokens(self) -> int | None:
        """The budget when the client sets none (None: what the context leaves)."""
        return None

    def num_logprobs(self) -> int | None:
        """How many top logprobs to return per token (None: no logprobs)."""
        return None

    def objectives(self, headers: Mapping[str, str]) -> SLO:
        """The objectives the request sets: each field, else its header (`SLO_HEADERS`);
        a value that is not a positive number of milliseconds is a 400 naming the field (or
        the header)."""
        seconds: dict[str, float | None] = {}
        for field, header in SLO_HEADERS.items():
            ms: float | None = getattr(self, field)
            param = field
            if ms is None:
                ms, param = header_ms(headers, header), header
            if ms is not None and not ms / 1e3 > 0:  # (pydantic: > 0, but it may underflow)
                raise bad_request(f"{param} must be a positive number of milliseconds, got "
                                  f"{ms!r}", param)
            seconds[field] = None if ms is None else ms / 1e3
        return SLO(seconds["slo_ttft_ms"], seconds["slo_tpot_ms"])

    def detokenize_options(self) -> DetokenizeOptions:
        return DetokenizeOptions(self.skip_special_tokens, self.spaces_between_special_tokens)

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """`ids` cut to their last `truncate_prompt_tokens` (vLLM's), when it is set."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = max_model_len if keep == -1 else keep
        if keep < 1 or keep > max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens must be between 1 and max_model_len ({max_model_len})"
                f" or -1, got {self.truncate_prompt_tokens}", "truncate_prompt_tokens"
            )
        return ids[-keep:]

    def sampling_params(
        self,
        max_tokens: int,
        defaults: GenerationDefaults = NO_DEFAULTS,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
        grammar: str | None = None,
    ) -> SamplingParams:
        """Translate to `SamplingParams`, the unset fields from `defaults`; raises
        `SamplingParamsError` for out-of-range values. `bad_words` arrive tokenized."""
        opt: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        fallback = defaults.sampling()
        opt = {k: fallback.get(k) if v is None else v for k, v in opt.items()}
        allowed = self.allowed_token_ids
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=self.num_logprobs(),
            priority=self.priority,
            logit_bias=self.logit_bias_pairs(),
            allowed_token_ids=None if allowed is None else tuple(allowed),
            bad_words_token_ids=bad_words_token_ids,
            grammar=grammar,
            prompt_logprobs=self.num_prompt_logprobs(),
            **{k: v for k, v in opt.items() if v is not None},
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    REFUSED = {
        **SAMPLING_REFUSED,
        "suffix": ((), "inserting text before a suffix"),
        "prompt_embeds": ((), ""),
    }

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int | None, Field(ge=0)] = None  # 0: with echo, the prompt alone
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: Any = None
    prompt_embeds: Any = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` returns the prompt's logprobs too, with as many
        alternatives as the generated tokens'."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                 if k is not None]
        return max(asked) if asked else None

    def requested_max_tokens(self) -> int | None:
        """max_tokens 0 (with echo) computes the prompt and samples one token, which the
        response leaves out."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def generates(self) -> bool:
        """False for max_tokens 0: the response is the echoed prompt alone."""
        return self.max_tokens != 0

    def unset_max_tokens(self) -> int | None:
        return COMPLETION_MAX_TOKENS

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string or token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")


def resolve_max_tokens(
    req: SamplingRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int | None = None,
) -> int:
    """The completion budget, checked against the context; 400 with the numbers if over.
    Unset, it is the route's default (16 for completions; chat: what the context leaves),
    capped by what the context leaves and by `default_max_tokens` when given."""
    requested = req.requested_max_tokens()
    param = req.max_tokens_field()
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    what = req.PROMPT_FIELD
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has {num_prompt_tokens} tokens, leaving no room for the completion. "
            f"Please reduce the length of the {what}.",
            param=what,
            code="context_length_exceeded",
        )
    if requested is None:
        caps = (max_model_len - num_prompt_tokens, req.unset_max_tokens(), default_max_tokens)
        return min(c for c in caps if c is not None)
    if num_prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"{what}, {requested} for the completion). Please reduce the length of the "
            f"{what} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested
