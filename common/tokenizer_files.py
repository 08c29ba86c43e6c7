"""Reading a tokenizer from disk: a Hugging Face tokenizer directory, or a GGUF file's
vocabulary (cached as such a directory).

An HF directory is its tokenizer.json (the Rust tokenizer's own serialization) plus config
files: special tokens, clean-up, chat templates. A GGUF file stores its vocabulary as
metadata. Byte-level BPE ("gpt2") vocabularies that split text the GPT-2 way are built here
with the `tokenizers` library, as transformers' GGUF converter builds them; other kinds
(SentencePiece "llama", vocabularies with their own split rule) are converted by transformers
in a child process, so the server process never imports torch. Reading the metadata is slow
(the gguf reader walks ~100k strings), so the result is saved as an HF directory in the model
cache, keyed by the file's path, size and mtime, and later loads read that.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from common.model_files import ModelLoadError, model_cache_dir
from common.tokenizer import SPECIAL_TOKEN_NAMES, TEMPLATE_DIR, TEMPLATE_FILE, Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as a config spells it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content"))
    return None if value is None else str(value)


def load_hf_dir(directory: Path, tokenizer_file: Path | None = None) -> Tokenizer:
    """An HF tokenizer directory: tokenizer.json, with tokenizer_config.json (special tokens,
    clean-up), special_tokens_map.json, and chat templates from chat_template.jinja and
    additional_chat_templates/ (which win), the config, or chat_template.json."""
    tokenizer_file = tokenizer_file or directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(
            f"{directory}: no tokenizer.json (stepserve reads fast tokenizers; save one with "
            "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(...))"
        )
    try:
        backend = RustTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelLoadError(f"{tokenizer_file}: not a tokenizers JSON file ({exc})") from exc
    config = _read_json(directory / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:  # older directories: the map file has the say
        config = {**config, **_read_json(directory / "special_tokens_map.json")}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = [str(_token_text(t)) for t in extra] if isinstance(extra, list) else []
    default, named = _hf_templates(directory, config)
    return Tokenizer(
        backend,
        special_tokens={name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES},
        chat_template=default,
        named_templates=named,
        extra_special_tokens=extra,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        name_or_path=str(directory),
    )


def _hf_templates(directory: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The default chat template and the named ones."""
    files = [directory / TEMPLATE_FILE, *sorted((directory / TEMPLATE_DIR).glob("*.jinja"))]
    named = {
        ("default" if f.name == TEMPLATE_FILE else f.stem): f.read_text(encoding="utf-8")
        for f in files
        if f.is_file()
    }
    if not named:
        raw = config.get("chat_template")
        if raw is None:
            raw = _read_json(directory / "chat_template.json").get("chat_template")
        if isinstance(raw, str):
            named = {"default": raw}
        elif isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
            if not all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in raw):
                raise ModelLoadError(f"{directory}: chat_template entries need a name and template")
            named = {str(t["name"]): str(t["template"]) for t in raw}
    return named.pop("default", None), named


# -- GGUF files ------------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types
# `tokenizer.ggml.pre` values of byte-level vocabularies that split text with GPT-2's own rule
# (the ByteLevel pre-tokenizer's); others need their own split, so transformers builds those
_GPT2_SPLIT = frozenset({"default", "gpt-2", "gpt2", "smollm", "starcoder", "refact"})
_CONVERT = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf = Path(sys.argv[1])
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[2])
"""


def _cache_dir(model: Path) -> Path:
    stat = model.stat()
    key = hashlib.sha256(
        f"{model.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return model_cache_dir() / "tokenizers" / f"{model.stem}-{key}"


def load_gguf_tokenizer(model: Path, cache: bool = True) -> Tokenizer:
    """The tokenizer of the GGUF file `model`: from the cache, else built (and cached)."""
    tokenizer = _cached_or_built(model, _cache_dir(model) if cache else None)
    tokenizer.name_or_path = str(model)
    return tokenizer


def _cached_or_built(model: Path, cached: Path | None) -> Tokenizer:
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        try:
            return load_hf_dir(cached)
        except ModelLoadError:  # a damaged entry is rebuilt below
            shutil.rmtree(cached, ignore_errors=True)
    meta = _gguf_tokenizer_metadata(model)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre in _GPT2_SPLIT and "tokenizer.ggml.merges" in meta:
        try:
            tokenizer = _byte_level_bpe(model, meta)
        except Exception as exc:  # malformed metadata: a merge without a pair, a bad id, ...
            raise ModelLoadError(f"{model}: cannot build its tokenizer ({exc})") from exc
        if cached is not None:
            _publish(cached, tokenizer.save_pretrained)
        return tokenizer
    if cached is not None and _publish(cached, lambda tmp: _convert_in_child(model, kind, tmp)):
        return load_hf_dir(cached)
    with tempfile.TemporaryDirectory(prefix="stepserve-tokenizer-") as tmp:
        _convert_in_child(model, kind, Path(tmp))
        return load_hf_dir(Path(tmp))


def _publish(target: Path, write: Callable[[Path], object]) -> bool:
    """`write(dir)` into a temporary sibling, then renamed to `target`, so that concurrent
    loaders never see half a directory. True when `target` is there afterwards: the cache
    is only an optimisation, so a cache dir that cannot be written is no error."""
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp", dir=target.parent))
        write(tmp)
        tmp.rename(target)
    except OSError:  # read-only, or another loader renamed its copy there first
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return (target / "tokenizer_config.json").is_file()


def _gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The file's `tokenizer.*` metadata as Python values."""
    from common.gguf_file import GGUFFile

    meta = {
        name: value
        for name, value in GGUFFile(path).metadata.items()
        if name.startswith("tokenizer.")
    }
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{path}: the GGUF file holds no vocabulary (tokenizer.ggml.tokens)")
    return meta


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of bytes as characters: printable Latin-1 bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def _byte_level_bpe(path: Path, meta: Mapping[str, Any]) -> Tokenizer:
    """A byte-level BPE vocabulary as transformers' GGUF converter builds it: tokens spelled
    outside the byte alphabet respelled in it, control tokens special, user-defined tokens
    matched whole, BOS/EOS added as the metadata says."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i
        for i, t in enumerate(tokens)
    }
    pairs = (m.split(" ", 1) for m in meta["tokenizer.ggml.merges"])
    merges = [(left, right) for left, right in pairs]
    backend = RustTokenizer(
        models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="")
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # transformers' GPT-2 class declares "<|endoftext|>" its default special token
    backend.add_special_tokens([t for t in ("<|endoftext|>",) if t in vocab])
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, kinds, strict=True)
        if k == _CONTROL and set(t) <= alphabet  # other spellings are mislabelled byte tokens
    ])
    in_vocab = backend.get_vocab(with_added_tokens=True)
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, kinds, strict=True)
        if k == _USER_DEFINED and t in in_vocab
    ])
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    ids = {n: meta.get(f"tokenizer.ggml.{key}_token_id") for n, key in names.items()}
    specials = {n: tokens[i] for n, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    backend.post_processor = _bos_eos_template(
        specials.get("bos_token") if meta.get("tokenizer.ggml.add_bos_token") else None,
        specials.get("eos_token") if meta.get("tokenizer.ggml.add_eos_token") else None,
        ids,
    )
    return Tokenizer(backend, specials, meta.get("tokenizer.chat_template"), name_or_path=str(path))


def _bos_eos_template(
    bos: str | None, eos: str | None, ids: Mapping[str, int | None]
) -> processors.TemplateProcessing:
    """`[BOS] $A [EOS]` with whichever of the two is added (pairs get them around each)."""
    head = f"{bos}:0 " if bos else ""
    tail = f" {eos}:0" if eos else ""
    single = f"{head}$A:0{tail}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    used = [(bos, ids["bos_token"]), (eos, ids["eos_token"])]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, i) for t, i in used if t and i is not None]
    )


def _convert_in_child(model: Path, kind: object, out: Path) -> None:
    """Have transformers convert the GGUF tokenizer into the HF directory `out`, in a child
    process (transformers imports torch, which this process must not)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CONVERT, str(model), str(out)],
            capture_output=True, text=True, timeout=900, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"{model}: converting its {kind!r} tokenizer failed ({exc})") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        hint = " (install transformers)" if "No module named 'transformers'" in last else ""
        raise ModelLoadError(
            f"{model}: cannot build a tokenizer for its {kind!r} vocabulary{hint}: {last}"
        )
