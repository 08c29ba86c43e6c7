"""The load generator's own tokenizer (tokenizers only) gives the server's token ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.model_files import find_default_model
from loadgen.tokenizer import ClientTokenizer, load_tokenizer

TEXTS = ["Hello world, this is 1234 a test.", "<|im_start|>user\nhi<|im_end|>\n",
         "  spaces   and\ttabs\n\nnewlines", "émoji 😀 naïve café 中文", "def f(x):\n    return x**2"]


@pytest.fixture(scope="module")
def ours() -> ClientTokenizer:
    return load_tokenizer()  # the default model's GGUF, parsed once for this module


def test_gguf_tokenizer_matches_the_workers(ours: ClientTokenizer) -> None:
    from common.tokenizer import load_tokenizer as worker_tokenizer

    theirs = worker_tokenizer()
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)


def test_hf_directory_and_errors(ours: ClientTokenizer, tmp_path: Path) -> None:
    tok = ours
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    with pytest.raises(FileNotFoundError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "missing")
    assert find_default_model().suffix == ".gguf"
