"""kvserve's Tokenizer vs transformers' tokenizer for the same SmolLM2 GGUF.

One known, deliberate difference: SmolLM2's pre-tokenizer ("smollm" in the GGUF) splits every
digit off before the GPT-2 regex runs (llama.cpp's llama-vocab.cpp and the model's original
tokenizer.json both do). transformers' GGUF converter has no entry for "smollm" and runs the GPT-2
regex alone, so the two disagree only where a run of 2+ whitespace characters precedes a digit
("  1": llama.cpp/original -> ["ĠĠ", "1"], transformers-GGUF -> ["Ġ", "Ġ", "1"]). We follow the
original. The reference here is therefore transformers' tokenizer applied to the text cut at
every digit, which is exactly llama.cpp's two-stage split; on texts without such a whitespace run
we also require equality with transformers' output directly.
"""
from __future__ import annotations

import json
import random
import re
import unicodedata

import pytest
import transformers
from tiny_models import smollm2_gguf_path, smollm2_tokenizer  # noqa: E402

from kvserve.model.tokenizer import Tokenizer, TokenizerError  # noqa: E402

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they're here, we'll see.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }\t// loop",
    "3.14159 and 2718281828 and 1,000,000 and -42 and 0x1F",
    "Prices: $19.99, €5, ¥1000; year 2024-06-01T12:30:00Z",
    "naïve café résumé Ünïcödé — “quotes” ‘single’ …",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "   leading spaces and trailing   ",
    "tabs\t\tand\n\n\nnewlines\r\n  mixed \u00a0nbsp\u2003em-space",
    "indent\n    1. first\n    2. second\n\n  10 items",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos<repo_name>kvserve<file_sep>a.py",
    "not special: <|im_start without close and <im_end>",
    "",
    " ",
    "a",
    "🤖" * 7,
]


def _digits_first(text: str) -> list[str]:
    """llama.cpp's first "smollm" split: every digit is its own piece."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch] if current else [ch]
            current = ""
        else:
            current += ch
    return pieces + [current] if current else pieces


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def hf():
    path = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def reference_ids(hf, text: str) -> list[int]:
    ids: list[int] = []
    for piece in _digits_first(text):
        ids += hf.encode(piece, add_special_tokens=False)
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference(ours, hf, text):
    got = ours.encode(text, add_special_tokens=False)
    assert got == reference_ids(hf, text)
    if not re.search(r"\s{2,}\d", text):
        assert got == hf.encode(text, add_special_tokens=False)
    # SmolLM2 adds no BOS (tokenizer.ggml.add_bos_token = false), like transformers
    assert ours.encode(text) == got
    assert hf.encode(text) == hf.encode(text, add_special_tokens=False)


def test_whitespace_before_digit_follows_llama_cpp(ours):
    tokens = ours.convert_ids_to_tokens(ours.encode("  1 x\n\n 2", add_special_tokens=False))
    assert tokens == ["ĠĠ", "1", "Ġx", "ĊĊĠ", "2"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_roundtrip_and_matches_hf(ours, hf, text):
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_arbitrary_ids_matches_hf(ours, hf):
    # random ids include tokens that are partial UTF-8 sequences and special tokens
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_tokens_stay_whole(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<|im_start|>", "<|im_end|>"]
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_special_ids_and_properties(ours, hf):
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.eos_token_ids == [2]
    assert ours.vocab_size == len(hf) == 49152
    assert ours.all_special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert ours.all_special_ids == set(range(17))  # the 17 control tokens of the StarCoder-style vocab
    assert ours.pad_token_id == hf.pad_token_id


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 42 😀"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(ours, hf, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ours.encode(text, add_special_tokens=False)
    assert ids == reference_ids(hf, text)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_trim_blocks_and_raise_exception():
    tok = Tokenizer(smollm2_tokenizer().backend, eos_token="<|im_end|>", chat_template=(
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}\n"
        "{{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}"))
    # trim_blocks/lstrip_blocks drop the newline after each block tag and the indent before it;
    # tojson leaves HTML characters alone (jinja's builtin would write \u003c)
    assert tok.apply_chat_template([{"role": "user", "content": "<b>&"}], add_generation_prompt=True,
                                   tokenize=False) == '"<b>&"<|im_end|>\n'
    with pytest.raises(TokenizerError, match="tool messages are not supported"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_a_clear_error(tmp_path):
    directory = smollm2_tokenizer().save_pretrained(tmp_path / "tok")
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(directory)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_saved_tokenizer_json_reloads_identically(ours, tmp_path):
    directory = ours.save_pretrained(tmp_path / "tok")
    reloaded = Tokenizer.from_pretrained(directory)
    hf_dir = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        ids = ours.encode(text)
        assert reloaded.encode(text) == ids
        assert hf_dir.encode(text, add_special_tokens=False) == ids  # transformers reads our tokenizer.json
    assert reloaded.all_special_ids == ours.all_special_ids
    assert reloaded.eos_token_ids == ours.eos_token_ids
    conversation = CONVERSATIONS[2]
    assert reloaded.apply_chat_template(conversation) == ours.apply_chat_template(conversation)
    # transformers' defaults: token ids, no generation prompt
    assert ours.apply_chat_template(conversation) == ours.encode(
        ours.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)


def test_add_bos_token_is_applied_once(tmp_path):
    from tokenizers import processors

    base = smollm2_tokenizer()
    directory = base.save_pretrained(tmp_path / "bos")
    cfg_file = directory / "tokenizer_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "add_bos_token": True}))
    tok = Tokenizer.from_pretrained(directory)
    assert tok.encode("hi") == [1, *base.encode("hi")]
    assert tok.encode("hi", add_special_tokens=False) == base.encode("hi")
    # a tokenizer.json whose post-processor already prepends BOS (Llama-3 style) must not get two
    tok.backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                              special_tokens=[("<|im_start|>", 1)])
    tok.backend.save(str(directory / "tokenizer.json"))
    again = Tokenizer.from_pretrained(directory)
    assert again.encode("hi") == [1, *base.encode("hi")]


def test_extra_eos_ids_merge_with_tokenizer_eos():
    tok = Tokenizer(smollm2_tokenizer().backend, eos_token="<|im_end|>", extra_eos_token_ids=[0, 2])
    assert tok.eos_token_ids == [0, 2]
    tok.add_eos_token_ids([5, 0])
    assert tok.eos_token_ids == [0, 2, 5]


def test_missing_or_bad_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(TokenizerError, match="GGUF tokenizer model 'llama' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
