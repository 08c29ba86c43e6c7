"""Chat templates: rendering a conversation with a model's Jinja template, torch-free.

Hugging Face chat templates are written for the environment transformers renders them in, so
this module builds the same one with jinja2 alone: a sandbox that cannot change its inputs,
`trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text,
`raise_exception`, `strftime_now`, guarded `dict` and `namespace` helpers, and a no-op
`{% generation %}` block. A template sees `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's named special tokens (`bos_token`, `eos_token`, ...)
and any extra variables, all rebuilt from plain JSON types first. Also here: reading a
`--chat-template` value, which is a file or an inline template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# the names older code and APIs give a message's reasoning; templates read the first two
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body", [], [], None, None, lineno)
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _check_attr_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template may not set the attribute {name!r} on a namespace"
        )


class _GuardedNamespace(Namespace):
    """`namespace(...)` that refuses underscore names, which could reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: B902 (`self` may be a kwarg)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attr_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attr_name(name)
        Namespace.__setitem__(self, name, value)


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own filter escapes <, > and & for HTML, which would change the prompt
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a server renders the same few templates all day)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_DictFactory(),
        namespace=_GuardedNamespace,
    )
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (str, int, float, bool, None, dict, list, tuple):
    the sandbox cannot vet the methods of other objects, so pydantic models and dataclasses
    become dicts, and anything else an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, ...) lose their extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain_data(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return plain_data(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    return f"<{type(value).__name__}>"


def _message(message: Any) -> dict[str, Any]:
    """One message as a plain dict, without None values (templates print "None", or fail on
    it, where they handle a missing key), reasoning under the names templates read."""
    plain = plain_data(message)
    if not isinstance(plain, dict):
        raise TypeError(f"a chat message must be a dict or a model of one, got {message!r}")
    plain = {k: v for k, v in plain.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_KEYS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _tag_final_message(messages: list[dict[str, Any]], key: str) -> str:
    """Append the continuation tag to the last message's `key` text; return that text."""
    final = messages[-1].get(key)
    if isinstance(final, str):
        messages[-1][key] = final + _CONTINUE_TAG
        return final
    for block in reversed(final or []):  # a list of content blocks: the last text block
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text = block["text"]
            block["text"] = text + _CONTINUE_TAG
            return str(text)
    raise ValueError(f"continue_final_message: the final message has no {key!r} text to continue")


def _cut_at_tag(rendered: str, final_text: str) -> str:
    """The rendered chat up to the continuation tag (the final message left open)."""
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered or final_text.strip() not in rendered:
        raise ValueError(
            "continue_final_message: the chat template dropped part of the final message, "
            "so it cannot be continued"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the tag's trailing space


def render_chat(
    template: str,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """`messages` rendered with the Jinja `template`. `continue_final_message` (True, or the
    message key to continue) leaves the last message open for the model to go on writing;
    `variables` are the special tokens and any template options."""
    chat = [_message(m) for m in messages]
    if not chat:
        raise ValueError("messages: a chat needs at least one message")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools: each tool must be a JSON schema (a dict)")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ValueError("documents: each document must be a dict with 'title' and 'text'")
    extra = plain_data(dict(variables or {}))
    clash = sorted(set(extra) & {"messages", "tools", "documents", "add_generation_prompt"})
    if clash:
        raise ValueError(f"template variables: {clash[0]!r} is set by the chat itself")
    final_text = None
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        key = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = _tag_final_message(chat, key)
    rendered = compile_template(template).render(
        **extra,
        messages=chat,
        tools=plain_data(tools),
        documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt,
    )
    return rendered if final_text is None else _cut_at_tag(rendered, final_text)


def read_template_option(value: str) -> str:
    """A `--chat-template` value: the text of a template file, or the value itself when it is
    an inline Jinja template. The template must compile."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: cannot read {path}: {exc}") from exc
    elif any(mark in value for mark in ("{{", "{%", "\n")):
        source = value
    else:
        raise ValueError(
            f"chat_template: {value!r} is neither a file nor an inline Jinja template"
        )
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a valid Jinja template: {exc}") from exc
    return source
