"""The load generator's tokenizer is the server's (`common.tokenizer`): the same ids from a
GGUF file, an HF directory or a bare tokenizer.json, and a clear error for a missing path."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.model_files import find_default_model
from common.tokenizer import load_tokenizer as server_tokenizer
from loadgen.tokenizer import Tokenizer, load_tokenizer

TEXTS = ["Hello world, this is 1234 a test.", "<|im_start|>user\nhi<|im_end|>\n",
         "  spaces   and\ttabs\n\nnewlines", "émoji 😀 naïve café 中文",
         "def f(x):\n    return x**2"]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer()  # the default model's GGUF (through the model cache)


def test_default_tokenizer_is_the_servers(ours: Tokenizer) -> None:
    server = server_tokenizer(find_default_model())
    assert len(ours) == len(server) and ours.vocab_size == server.vocab_size
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == server.encode(text, add_special_tokens=False)
        assert ours.encode(text) == server.encode(text)
        assert ours.decode(ids) == server.decode(ids) == text


def test_hf_directory_tokenizer_json_and_errors(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save_pretrained(tmp_path / "dir")
    from_dir = load_tokenizer(tmp_path / "dir")
    bare = tmp_path / "tokenizer.json"
    ours.backend_tokenizer.save(str(bare))
    from_file = load_tokenizer(bare)
    for text in TEXTS:
        assert from_dir.encode(text) == from_file.encode(text) == ours.encode(text)
    assert from_dir.chat_template == ours.chat_template
    with pytest.raises(FileNotFoundError, match="missing: no such tokenizer file"):
        load_tokenizer(tmp_path / "missing")
