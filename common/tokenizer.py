"""The model's tokenizer, torch-free: `Tokenizer` over the `tokenizers` library (Rust), with
the names and defaults of a transformers fast tokenizer; `load_tokenizer` (files are read by
`common.tokenizer_files`); and `apply_chat_template`, which the chat route calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as RustTokenizer

from common.chat_template import read_template_option, render_chat
from common.model_files import resolve_model_path

# the named special tokens a chat template sees, as transformers names them
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)
NO_CHAT_TEMPLATE = "this model's tokenizer has no chat template; use the completions API"
TEMPLATE_FILE, TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"  # in HF dirs


class Tokenizer:
    """Encode, decode, special tokens and chat templates over a `tokenizers.Tokenizer`, with
    the names and defaults of a transformers fast tokenizer, which callers may use instead."""

    def __init__(
        self,
        backend: RustTokenizer,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        named_templates: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str = "",
    ) -> None:
        self._backend = backend
        self._specials = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        unknown = sorted(set(self._specials) - set(SPECIAL_TOKEN_NAMES))
        if unknown:
            raise ValueError(f"special_tokens: unknown name {unknown[0]!r}")
        self.chat_template = chat_template  # the model's template; a server option replaces it
        self.chat_templates = dict(named_templates or {})  # named ones, e.g. "tool_use"
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.name_or_path = name_or_path
        # as transformers does: special tokens the backend does not match whole yet become
        # special added tokens (kept at their vocabulary ids when they have one)
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        wanted = dict.fromkeys([*self._specials.values(), *extra_special_tokens])
        missing = [AddedToken(t, special=True) for t in wanted if t not in added]
        if missing:
            backend.add_special_tokens(missing)

    @property
    def backend_tokenizer(self) -> RustTokenizer:
        """The Rust tokenizer (for `tokenizers.decoders.DecodeStream`)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
        clean = self.clean_up_tokenization_spaces
        clean = clean if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE models, whose text it would corrupt
        if clean and not isinstance(self._backend.model, models.BPE):
            text = _clean_up_spaces(text)
        return text

    @overload
    def convert_ids_to_tokens(self, ids: int, skip_special_tokens: bool = ...) -> str | None: ...
    @overload
    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = ...
    ) -> list[str]: ...
    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [str(self._backend.id_to_token(i)) for i in ids if i not in skip]

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The token's id; the unknown token's id (or None) when it is not in the vocabulary."""
        found = self._backend.token_to_id(token)
        return found if found is not None else self.unk_token_id

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._backend.get_added_tokens_decoder())

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size (added tokens beyond it not counted; `len()` counts them)."""
        return int(self._backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. {"bos_token": "<s>", ...}."""
        return dict(self._specials)

    def special_token(self, name: str) -> str | None:
        """A named special token ("bos_token", ...), None when the model has none."""
        return self._specials.get(name)

    def special_token_id(self, name: str) -> int | None:
        token = self._specials.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_token("bos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.special_token_id("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_token("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_token_id("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_token("unk_token")

    @property
    def unk_token_id(self) -> int | None:
        return self.special_token_id("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_token("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.special_token_id("pad_token")

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then every other added token marked special (those a
        decode with `skip_special_tokens` leaves out)."""
        added = [t.content for _, t in sorted(self.added_tokens_decoder.items()) if t.special]
        return list(dict.fromkeys([*self._specials.values(), *added]))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._backend.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template to render with: `chat_template` (a name among the named templates, or
        the template itself), else "tool_use" when tools are given and it exists, else the
        model's own; ValueError when there is none."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if not self.chat_template:
            raise ValueError(NO_CHAT_TEMPLATE)
        return self.chat_template

    @overload
    def apply_chat_template(
        self, conversation: Sequence[Any], *, tokenize: Literal[False], **kwargs: Any
    ) -> str: ...
    @overload
    def apply_chat_template(
        self, conversation: Sequence[Any], *, tokenize: Literal[True] = ..., **kwargs: Any
    ) -> list[int]: ...
    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered with the chat template (as transformers renders it; the
        special tokens and `template_kwargs` are template variables): token ids, or the text
        when `tokenize` is False. The template writes any BOS itself, so none is added."""
        text = render_chat(
            self.get_chat_template(chat_template, tools),
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            variables={**self._specials, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | Path) -> tuple[str, ...]:
        """Write an HF tokenizer directory (which transformers loads too); the paths written."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
            **self._specials,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        written = [out / "tokenizer.json", out / "tokenizer_config.json"]
        if self.chat_template is not None:
            written.append(out / TEMPLATE_FILE)
            written[-1].write_text(self.chat_template, encoding="utf-8")
        for name, template in self.chat_templates.items():
            if Path(name).name != name or name.startswith("."):
                raise ValueError(f"chat_templates: {name!r} is not a plain template name")
            (out / TEMPLATE_DIR).mkdir(exist_ok=True)
            written.append(out / TEMPLATE_DIR / f"{name}.jinja")
            written[-1].write_text(template, encoding="utf-8")
        return tuple(str(p) for p in written)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={len(self)}, specials={self._specials})"


def _clean_up_spaces(text: str) -> str:
    """Drop the spaces a word-piece decode leaves before punctuation and English clitics."""
    for spaced in (" .", " ?", " !", " ,", " n't", " 'm", " 's", " 've", " 're"):
        text = text.replace(spaced, spaced[1:])
    return text.replace(" ' ", "'")


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (or the named
    `chat_template`), as the chat API builds its prompt; works for a `Tokenizer` and for a
    transformers tokenizer alike. `template_kwargs` are extra template variables;
    `add_special_tokens` adds the tokenizer's own (a BOS, say) on top of the template's."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(NO_CHAT_TEMPLATE)
    text = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=None if tools is None else list(tools),
        documents=None if documents is None else list(documents),
        chat_template=chat_template,
        **dict(template_kwargs or {}),
    )
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def load_tokenizer(
    path: str | Path | None = None, cache: bool = True, chat_template: str | None = None
) -> Tokenizer:
    """The tokenizer of an HF model directory, a `tokenizer.json` or a GGUF file (None: the
    default model). `chat_template` replaces the model's template: a file or an inline Jinja
    template (`--chat-template`). `cache=False` neither reads nor writes the GGUF cache."""
    from common.tokenizer_files import load_gguf_tokenizer, load_hf_dir  # they build on this

    model = resolve_model_path(None if path is None else str(path))
    if model.is_dir():
        tokenizer = load_hf_dir(model)
    elif model.suffix == ".json":
        tokenizer = load_hf_dir(model.parent, model)
    else:
        tokenizer = load_gguf_tokenizer(model, cache)
    if chat_template is not None:  # replaces the named templates too ("tool_use", ...)
        tokenizer.chat_template = read_template_option(chat_template)
        tokenizer.chat_templates.clear()
    return tokenizer
