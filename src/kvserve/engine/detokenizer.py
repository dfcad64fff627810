"""Incremental detokenization and stop strings.

Decoding a window of ids is what keeps this correct for every tokenizer: byte-level BPE tokens can
end mid-character (a delta is held back while the text ends in U+FFFD), and SentencePiece decoders
drop a leading space at the start of a decode (so a few prompt tokens are kept as left context).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

_CONTEXT_TOKENS = 5


def token_text_cache(tokenizer) -> Callable[[int], str]:
    """A token's own text (logprobs' decoded_token, /tokenize's token strings), memoized."""
    return functools.lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # kvserve.model.tokenizer.Tokenizer
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._ids: list[int] = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # full decoded output (stop string removed once found)
        self._emitted = 0  # characters of `text` already handed out
        # Text that could still turn into a stop string is held back while streaming.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stop_reason: str | None = None

    def add_token(self, token_id: int, stop_strings: bool = True) -> bool:
        """Feed one generated token. Returns True if a stop string ended the output. With
        `stop_strings` False (the request is still within min_tokens, as vLLM) none is looked for."""
        self._ids.append(token_id)
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                       skip_special_tokens=self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:],
                                     skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        new_text = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += new_text
        return stop_strings and self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> bool:
        if not self.stop:
            return False
        # A stop string may straddle the previous delta: search from just before it.
        search_from = max(0, old_len - self._holdback)
        best = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self.text = self.text[:idx + len(s)] if self.include_stop_str_in_output else self.text[:idx]
        self.stop_reason = s
        return True

    @property
    def emitted_text(self) -> str:
        return self.text[:self._emitted]

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, the tail that could begin a stop string stays."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
