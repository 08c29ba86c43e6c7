"""The torch-free tokenizer against transformers on the same files: ids, decodes, special
tokens and chat templates of the default GGUF model; HF directories both ways; the GGUF cache
(built into an empty cache dir, then read back); SentencePiece GGUF files converted by
transformers in a child process; and `--chat-template` overrides (file, inline, bad)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

from common.model_files import ModelLoadError, find_default_model
from common.tokenizer import NO_CHAT_TEMPLATE, Tokenizer, apply_chat_template, load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 1234567 degrees; 3.14159!",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n\n\n",
    "Le cœur a ses raisons que la raison ne connaît point. Où est l'hôtel ?",
    "Größenwahn: Übermäßige Straßenbahnhaltestellen in Düsseldorf",
    "emoji 😀🎉🇫🇷 👩‍👩‍👧 and 中文 日本語",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>",
    "   leading and    inner \t\t tabs \n\n\n  and trailing   ",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Oui, merci ! 😀"},
        {"role": "user", "content": "def f(): pass"},
    ],
]
# exercises the environment: tojson, namespace, loop controls, dict(), generation blocks,
# tools, special tokens, a missing key (dropped None) and the reasoning aliases
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0, seen=dict(a=1)) %}
{% if tools %}Tools: {{ tools | tojson }}
{{ tools | tojson(indent=2, sort_keys=True) }}
{% endif %}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% if m.role == 'stop' %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  <{{ m.role }}|{{ ns.n }}>{% if m.name is defined %}({{ m.name }}){% endif %}
  {% if m.thinking is defined %}[think:{{ m.thinking }}|{{ m.reasoning_content }}]{% endif %}
  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
  {% else %}{{ m.content | tojson }}{% endif %}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant|>{% endif %}{{ extra_flag | default('none') }}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "météo <now>",
                                          "parameters": {"type": "object", "properties": {}}}}]
RICH_CHATS = [
    [{"role": "user", "content": "a < b & c > d", "name": None},
     {"role": "assistant", "content": "ok", "reasoning": "because"},
     {"role": "skip", "content": "x"}, {"role": "user", "content": "ünïcödé", "name": "bob"},
     {"role": "stop", "content": "y"}, {"role": "user", "content": "never"}],
    [{"role": "assistant", "content": "thought", "reasoning_content": "r"}],
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty model cache for this module (STEPSERVE_MODEL_CACHE)."""
    path = tmp_path_factory.mktemp("model-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STEPSERVE_MODEL_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def ours(cache_dir: Path) -> Tokenizer:
    """The default model's tokenizer, built from the GGUF metadata into the module's cache."""
    return load_tokenizer()


@pytest.fixture(scope="module")
def theirs() -> Any:
    from transformers import AutoTokenizer

    gguf = find_default_model()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _assert_same_tokens(ours: Tokenizer, theirs: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )


def test_ids_and_decodes_equal_transformers(ours: Tokenizer, theirs: Any) -> None:
    _assert_same_tokens(ours, theirs)
    ids = list(range(0, len(theirs), 997))  # arbitrary ids, byte fragments included
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(2) == theirs.convert_ids_to_tokens(2) == "<|im_end|>"


def test_special_tokens_and_sizes_equal_transformers(ours: Tokenizer, theirs: Any) -> None:
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    assert ours.special_tokens_map == theirs.special_tokens_map
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token")
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id")
    assert ours.get_vocab() == theirs.get_vocab()
    # every id a decode skips as special is listed
    specials = set(ours.all_special_ids)
    kept = [i for i in range(len(ours)) if ours.decode([i], skip_special_tokens=True)]
    assert specials and not specials & set(kept)
    assert set(range(len(ours))) - set(kept) >= specials


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("prompt", [True, False])
def test_chat_template_equals_transformers(
    ours: Tokenizer, theirs: Any, chat: list[dict[str, str]], prompt: bool
) -> None:
    text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
    assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
    want = theirs.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
    assert apply_chat_template(ours, chat, prompt) == want
    assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == want


def test_rich_template_renders_as_transformers_does(ours: Tokenizer, theirs: Any) -> None:
    ours_t = Tokenizer(ours.backend_tokenizer, ours.special_tokens_map, RICH_TEMPLATE)
    for chat in RICH_CHATS:
        for tools in (None, TOOLS):
            for prompt in (True, False):
                kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": prompt}
                want = theirs.apply_chat_template(
                    chat, chat_template=RICH_TEMPLATE, tokenize=False, extra_flag="on", **kwargs
                )
                got = ours_t.apply_chat_template(chat, tokenize=False, extra_flag="on", **kwargs)
                assert got == want
    # continuing the final message leaves it open, as transformers does
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    got = ours.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert got == theirs.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert got.endswith("Once upon")


def test_template_helpers_and_sandbox(ours: Tokenizer) -> None:
    def render(template: str, chat: list[dict[str, str]] | None = None) -> str:
        tok = Tokenizer(ours.backend_tokenizer, ours.special_tokens_map, template)
        return tok.apply_chat_template(chat or CHATS[0], tokenize=False)

    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")
    assert render("{{ strftime_now('%Y-%m') }}")[:2] in ("20", "21")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ messages.append(1) }}")  # the sandbox is immutable
    assert render("{{ dict.fromkeys(['a'], 1) | tojson }}") == '{"a": 1}'
    with pytest.raises(ValueError, match="messages: a chat needs at least one message"):
        ours.apply_chat_template([], tokenize=False)


def test_no_template_is_a_clear_error(ours: Tokenizer) -> None:
    bare = Tokenizer(ours.backend_tokenizer, ours.special_tokens_map)
    with pytest.raises(ValueError, match=NO_CHAT_TEMPLATE):
        apply_chat_template(bare, CHATS[0])
    with pytest.raises(ValueError, match=NO_CHAT_TEMPLATE):
        bare.apply_chat_template(CHATS[0])


def test_hf_directories_both_ways(ours: Tokenizer, theirs: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    theirs.save_pretrained(tmp_path / "from-transformers")
    loaded = load_tokenizer(tmp_path / "from-transformers")
    _assert_same_tokens(loaded, theirs)
    assert loaded.chat_template == theirs.chat_template
    assert loaded.special_tokens_map == theirs.special_tokens_map
    # a bare tokenizer.json is an HF directory's file
    assert load_tokenizer(tmp_path / "from-transformers" / "tokenizer.json").encode(TEXTS[0]) == (
        theirs.encode(TEXTS[0])
    )
    ours.save_pretrained(tmp_path / "from-ours")
    back = AutoTokenizer.from_pretrained(str(tmp_path / "from-ours"))
    _assert_same_tokens(ours, back)
    assert back.chat_template == ours.chat_template
    assert back.special_tokens_map == ours.special_tokens_map


def test_hf_directory_template_sources(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},
                                {"name": "tool_use", "template": "T{{ tools | length }}"}],
              "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    tok = load_tokenizer(tmp_path)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token) == ("<|im_end|>", 2, "<|im_start|>")
    assert tok.apply_chat_template(CHATS[0], tokenize=False) == "DHello!"
    assert tok.apply_chat_template(CHATS[0], tools=TOOLS, tokenize=False) == "T1"
    (tmp_path / "chat_template.jinja").write_text("J")  # template files win over the config
    assert load_tokenizer(tmp_path).chat_template == "J"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert load_tokenizer(tmp_path).chat_template == "P"
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json: not a tokenizers JSON file"):
        load_tokenizer(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="empty: no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")


def test_gguf_cache_is_written_then_read(ours: Tokenizer, cache_dir: Path) -> None:
    (entry,) = (cache_dir / "tokenizers").iterdir()
    assert entry.name.startswith(find_default_model().stem + "-")
    assert {p.name for p in entry.iterdir()} == {
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
    }
    (entry / "chat_template.jinja").write_text("cached {{ messages[0].content }}")
    again = load_tokenizer()
    assert again.apply_chat_template(CHATS[0], tokenize=False) == "cached Hello!"
    assert again.encode(TEXTS[0]) == ours.encode(TEXTS[0])
    assert load_tokenizer(cache=False).chat_template == ours.chat_template  # no cache read
    (entry / "tokenizer.json").write_text("damaged")
    rebuilt = load_tokenizer()
    assert rebuilt.chat_template == ours.chat_template and rebuilt.encode(TEXTS[1]) == ours.encode(
        TEXTS[1]
    )
    assert (entry / "tokenizer.json").stat().st_size > 1000  # and written again


def test_chat_template_override(ours: Tokenizer, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("F:{{ messages[0].content }}")
    assert load_tokenizer(chat_template=str(template)).apply_chat_template(
        CHATS[0], tokenize=False
    ) == "F:Hello!"
    inline = load_tokenizer(chat_template="I:{{ messages | length }}")
    assert inline.apply_chat_template(CHATS[1], tokenize=False) == "I:2"
    with pytest.raises(ValueError, match="chat_template: 'missing.jinja' is neither a file"):
        load_tokenizer(chat_template="missing.jinja")
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template"):
        load_tokenizer(chat_template="{% for x in %}")


def _sentencepiece_gguf(path: Path) -> None:
    """A tiny SentencePiece ("llama") vocabulary, which only transformers can build."""
    import gguf

    pieces = ["▁hello", "▁world", "▁he", "llo", "▁w", "orld", "▁", "h", "e", "l", "o", "w",
              "r", "d", "ll", "or", "▁h"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces])
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m.content }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_sentencepiece_gguf_is_converted_in_a_child(tmp_path: Path, cache_dir: Path) -> None:
    from transformers import AutoTokenizer

    _sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = load_tokenizer(tmp_path / "sp.gguf")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in ("hello world", " hello  world\n", "héllo"):
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.apply_chat_template(CHATS[0], tokenize=False) == "<s>Hello!"
    assert any(p.name.startswith("sp-") for p in (cache_dir / "tokenizers").iterdir())


def test_gguf_errors_name_the_file(tmp_path: Path, cache_dir: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bad.gguf: not a readable GGUF file"):
        load_tokenizer(bad)
    with pytest.raises(ModelLoadError, match="nope.gguf: no such file"):
        load_tokenizer(tmp_path / "nope.gguf")
