"""Tokenizer: the `tokenizers` library behind a small interface, plus the chat template.

Built from an HF directory (tokenizer.json + tokenizer_config.json) or from GGUF metadata, where
llama.cpp keeps the vocabulary, merges, token types and pre-tokenizer name instead of a
tokenizer.json. The engine never imports transformers; the chat template is rendered the way
transformers renders it (sandboxed jinja2, trim_blocks + lstrip_blocks) so prompts match.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers


class Encoding(dict):
    """transformers' BatchEncoding, as far as scripts read it: `enc["input_ids"]` or `enc.input_ids`."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class TokenizerError(ValueError):
    """The tokenizer files are missing/unusable, or a request needs something the model lacks."""


# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp applies them (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# StarCoder-family vocabularies (SmolLM's included) were trained with every digit split off first;
# their tokenizer.json is Digits(individual_digits) + ByteLevel, and llama.cpp splits "\p{N}" first.
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_SPLITS = {
    **{name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")},
    **{name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return byte_level  # "default"/"gpt2" and unknown names: GPT-2's own regex


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids, special-token facts and the chat template of one model."""

    def __init__(self, backend: HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 unk_token: str | None = None, pad_token: str | None = None, add_bos_token: bool = False,
                 chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = ()):
        self.backend = backend
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._extra_eos = [int(i) for i in extra_eos_token_ids]
        # tokenizer.json may already prepend BOS in its post-processor (Llama-3 style); only add it
        # ourselves when the flag asks for it and the post-processor does not.
        probe = backend.encode("", add_special_tokens=True).ids
        self._prepend_bos = (add_bos_token and self.bos_token_id is not None
                             and (not probe or probe[0] != self.bos_token_id))
        self._compiled_template = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from an HF model directory."""
        directory = Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{directory} has no tokenizer.json; kvserve needs the fast-tokenizer file saved by "
                f"transformers (tokenizer.save_pretrained) next to config.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise TokenizerError(f"{tok_file} is not a valid tokenizer.json ({e})") from None
        cfg: dict[str, Any] = {}
        cfg_file = directory / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_file} is not valid JSON ({e})") from None
        chat_template = cfg.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = directory / "chat_template.jinja"  # where transformers >= 4.43 saves it
        if chat_template is None and jinja_file.is_file():
            chat_template = jinja_file.read_text()
        return cls(backend,
                   bos_token=_token_content(cfg.get("bos_token")), eos_token=_token_content(cfg.get("eos_token")),
                   unk_token=_token_content(cfg.get("unk_token")), pad_token=_token_content(cfg.get("pad_token")),
                   add_bos_token=bool(cfg.get("add_bos_token", False)), chat_template=chat_template,
                   extra_eos_token_ids=extra_eos_token_ids)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """A byte-level BPE tokenizer rebuilt from llama.cpp's tokenizer.ggml.* keys."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {model!r} is not supported; kvserve rebuilds byte-level BPE ('gpt2') "
                f"tokenizers only. Load the HF directory (with tokenizer.json) instead")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges; the file is incomplete")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Byte-level vocabularies spell every token in the byte alphabet; a token outside it (some
        # converters write raw text) is respelled so the BPE model can find it.
        vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, <|endoftext|>, ...) must match whole in text and be
        # skippable on decode; user-defined ones match whole but stay visible.
        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def token(key: str) -> str | None:
            idx = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        return cls(backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                   unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
                   add_bos_token=add_bos, chat_template=metadata.get("tokenizer.chat_template"))

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write tokenizer.json + tokenizer_config.json (readable by kvserve and transformers)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token, "eos_token": self.eos_token,
               "unk_token": self.unk_token, "pad_token": self.pad_token, "add_bos_token": self.add_bos_token,
               "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        return directory

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: a text of n characters is at least
        n / max_token_chars tokens, which refuses a prompt far over the context without
        tokenizing it (megabytes take seconds)."""
        return max(len(self.backend.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:  # transformers' default
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # transformers' spellings, which vLLM scripts use on `llm.get_tokenizer()`
    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(t) for t in tokens]

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> "Encoding":
        """`input_ids` for a text or a list of texts, by key or attribute, as transformers' return."""
        if isinstance(text, str):
            return Encoding(input_ids=self.encode(text, add_special_tokens))
        return Encoding(input_ids=[self.encode(t, add_special_tokens) for t in text])

    # -- special tokens -----------------------------------------------------------------------
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the model config's eos ids, then the tokenizer's eos."""
        ids = list(dict.fromkeys(self._extra_eos))
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.append(self.eos_token_id)
        return ids

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Merge in eos ids that only the model config (or generation_config.json) knows."""
        self._extra_eos = list(dict.fromkeys([*self._extra_eos, *(int(i) for i in ids)]))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self._id(self.unk_token))
                   if i is not None)
        return ids

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str | list[int]:
        """Render a conversation into the prompt the model was trained on: token ids, or the text
        with tokenize=False (transformers' defaults, as are add_generation_prompt's).
        continue_final_message: end the prompt inside the last message (no end-of-turn after
        it), so the model continues that text, as transformers and vLLM do."""
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt cannot both be true; set "
                                 "add_generation_prompt to false to continue the last message")
        if not self.chat_template:
            raise TokenizerError(
                "this model has no chat template (none in tokenizer_config.json, chat_template.jinja or the GGUF "
                "metadata); use a completion prompt instead of chat messages, or load an instruction-tuned model")
        messages = chat_text_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        from jinja2.exceptions import TemplateError
        try:
            variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                         "unk_token": self.unk_token or "", "pad_token": self.pad_token or "",
                         "documents": None, **template_kwargs}  # extra variables win, as in transformers
            text = self._compiled_template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
        except (TemplateError, TypeError) as e:  # TypeError: the template's own operations on our values
            raise TokenizerError(f"the chat template rejected these messages: {e}") from None
        if continue_final_message:
            final = messages[-1]["content"]
            cut = final if final in text else final.strip()
            if cut not in text:
                raise TokenizerError("continue_final_message: the chat template does not reproduce the last "
                                     "message's text, so the prompt cannot end inside it")
            text = text[:text.rindex(cut) + len(cut)]
        # The template writes any BOS itself, so tokenizing must not add another.
        return self.encode(text, add_special_tokens=False) if tokenize else text


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs are template variables; these names are the templating call's own arguments.
CHAT_TEMPLATE_RESERVED = ("messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize",
                          "tools", "documents", "chat_template", "return_dict", "return_tensors",
                          "return_assistant_tokens_mask", "padding", "truncation", "max_length")


def check_chat_template_kwargs(kwargs: dict | None) -> None:
    """The server's chat_template_kwargs may only add template variables."""
    reserved = sorted(set(kwargs or ()) & set(CHAT_TEMPLATE_RESERVED))
    if reserved:
        raise TokenizerError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                             f"{'they are' if len(reserved) > 1 else 'it is'} an argument of the templating itself, "
                             "not a template variable; use the request's own field where there is one "
                             "(add_generation_prompt, continue_final_message) or drop it")


def chat_text_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI-style messages -> dicts whose content is a string, as text chat templates expect:
    null content (an assistant turn that only called tools) becomes "", a list of text parts is
    joined with newlines. Other keys (name, tool_calls) are passed through."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise TokenizerError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        content = m.get("content")
        if content is None or isinstance(content, str):
            text = content or ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                    raise TokenizerError(f"messages[{i}].content[{j}]: a text part needs a string 'text' field, "
                                         f"got {type(part.get('text')).__name__}; send {{'type': 'text', 'text': ...}}")
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise TokenizerError(f"messages[{i}].content[{j}]: content part type {kind!r} is not "
                                         "supported; send text parts ({'type': 'text', 'text': ...}) only")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise TokenizerError(f"messages[{i}].content must be a string, a list of text parts or null; "
                                 f"got {type(content).__name__}")
        out.append({**m, "content": text})
    return out


def _compile_chat_template(source: str):
    from jinja2 import ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes; chat templates expect plain JSON (as transformers does)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"the model's chat template is not valid jinja2: {e}") from None


__all__ = ["Tokenizer", "TokenizerError"]
