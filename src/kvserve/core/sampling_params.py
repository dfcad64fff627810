"""Per-request sampling settings, with vLLM's field names and validation messages."""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass, field
from enum import IntEnum

from kvserve.core.cache_retention import CacheRetention, CacheRetentionError, parse_cache_retention
from kvserve.core.kv_compression import KVCompression, KVCompressionError, parse_kv_compression

# Below this temperature a request samples greedily (the sampler takes the argmax).
GREEDY_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """vLLM's: what `LLMEngine.step` returns for a request. CUMULATIVE (the default): an output per
    step that produced tokens, with the whole text and token ids so far (and kvserve's delta_*
    fields); DELTA: the same outputs holding only the new text, token ids and logprobs; FINAL_ONLY:
    only the finished output, which `LLM.generate` asks for, as vLLM's does (an output per request
    per step is work an offline batch never reads)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # torch generator seeds; vLLM's bounds


class SamplingParamsError(ValueError):
    """A user-supplied sampling setting is invalid; the message names the field and the limit."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (computed, not cached)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Release KV blocks as the sequence grows (core/kv_compression.py): a dict such as
    # {"method": "streaming", "sink_tokens": 4, "window": 1024}, made a KVCompression here.
    kv_compression: KVCompression | dict | None = None
    # How long the blocks this request leaves in the prefix cache stay ahead of others
    # (core/cache_retention.py): a dict such as {"priority": 80, "ttl_s": 600}.
    cache_retention: CacheRetention | dict | None = None
    # Disaggregated prefill (vLLM's kv_transfer_params; vLLM carries them in extra_args): a request
    # with do_remote_decode leaves its prompt's KV in the transfer layer when it finishes.
    kv_transfer_params: dict | None = None
    # vLLM fields kvserve does not implement: accepted at their "off" value, refused otherwise
    # (a script that sets one must not get output that silently ignored it).
    best_of: int | None = None
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: object = None
    guided_decoding: object = None
    logits_processors: list | None = None
    extra_args: dict | None = None
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        # Normalised where the type allows; anything else is left for validate() to name.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:  # vLLM's "disabled"
            self.top_k = 0
        if isinstance(self.stop_token_ids, list):  # numpy integers are token ids too
            self.stop_token_ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
                                   for t in self.stop_token_ids]
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool) \
                and self.output_kind in RequestOutputKind.__members__.values():
            self.output_kind = RequestOutputKind(self.output_kind)
        try:
            self.kv_compression = parse_kv_compression(self.kv_compression)
        except KVCompressionError as e:
            raise SamplingParamsError(str(e)) from None
        try:
            self.cache_retention = parse_cache_retention(self.cache_retention)
        except CacheRetentionError as e:
            raise SamplingParamsError(str(e)) from None
        # Refused when made, as vLLM does; the engine checks again against its own limits.
        self.validate(max_logprobs=sys.maxsize, max_n=sys.maxsize)

    def _check_unimplemented(self) -> None:
        off = {"logit_bias": "logit bias is not implemented",
               "allowed_token_ids": "allowed_token_ids is not implemented",
               "bad_words": "bad_words is not implemented",
               "structured_outputs": "structured output is not implemented",
               "guided_decoding": "structured output is not implemented",
               "logits_processors": "custom logits processors are not implemented",
               "extra_args": "extra_args (custom sampling plugins) are not implemented"}
        for name, why in off.items():
            if getattr(self, name) not in (None, {}, []):
                raise SamplingParamsError(f"{name} is not supported by kvserve: {why}; leave it unset")
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamsError("best_of is not supported by kvserve (vLLM V1 dropped it too); use n")
        if not self.detokenize:
            raise SamplingParamsError("detokenize=False is not supported by kvserve; leave it True")
        # spaces_between_special_tokens only changes slow (Python) tokenizers' decoding; kvserve's
        # are fast tokenizers, as vLLM's usually are, for which both values decode alike.

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, max_logprobs: int = 20, max_n: int = 128) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name} {why}")

        def number(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")

        self._check_unimplemented()
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            number(name)
        for name in ("top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise bad(name, f"must be an integer, got {v!r}")
        if not isinstance(self.stop, list):
            raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of non-negative integer token ids, got {self.stop_token_ids!r}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", f"must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                                     f"got {self.output_kind!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > max_n:
            raise bad("n", f"must be <= {max_n}, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise bad("logprobs", f"must be in [0, {max_logprobs}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            raise bad("prompt_logprobs", f"must be in [0, {max_logprobs}], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
            # Choice i samples with seed + i (a torch generator each), so every one must fit in int64.
            limit = INT64_MAX - (self.n - 1)
            raise bad("seed", f"must be in [{INT64_MIN}, {limit}] (a signed 64-bit integer"
                              + (f"; choice i of n={self.n} samples with seed + i" if self.n > 1 else "")
                              + f"), got {self.seed}")
