"""KV compression settings of one request: which blocks of its KV may be released while it runs.

`streaming` (StreamingLLM): the first `sink_tokens` plus the most recent `window` tokens stay; the
blocks between are released as the sequence grows. `h2o` (Heavy-Hitter Oracle, at block
granularity): the most recent `window` tokens stay, and of the older blocks the `heavy_tokens`
worth with the most accumulated attention; the rest are released. `snapkv`: when the prompt's
prefill ends, its last `observation_tokens` queries vote for `heavy_tokens` worth of older prompt
blocks, which stay with the sinks and the window. All keep whole blocks, so a sink or window
that ends mid-block keeps the whole block (up to block_size - 1 tokens more).
Plain data, no torch; the KV cache manager applies it (kv/release.py, kv/compression/).
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("streaming", "h2o", "snapkv")
_KEYS = {"streaming": {"method", "sink_tokens", "window"},
         "h2o": {"method", "heavy_tokens", "window"},
         "snapkv": {"method", "sink_tokens", "heavy_tokens", "window", "observation_tokens"}}


class KVCompressionError(ValueError):
    """An invalid kv_compression value; the message starts with the field it names."""


@dataclass(frozen=True)
class KVCompression:
    method: str
    window: int  # most recent tokens always kept
    sink_tokens: int = 0  # streaming, snapkv: first tokens always kept
    heavy_tokens: int = 0  # h2o, snapkv: older tokens kept by attention score
    observation_tokens: int = 0  # snapkv: the prompt's last queries, whose attention votes

    @property
    def budget(self) -> int:
        """Tokens kept besides block rounding (the attended context once the sequence is longer)."""
        return self.window + self.sink_tokens + self.heavy_tokens

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in sorted(_KEYS.get(self.method, {"method"}))}


# {"method": "none"}: no compression, and none of the server's default either.
NONE = KVCompression("none", 0)


def active(c: KVCompression | None) -> KVCompression | None:
    """The compression a sequence runs under, None for none."""
    return None if c is None or c.method == "none" else c


def parse_kv_compression(value, field: str = "kv_compression") -> KVCompression | None:
    """A request's `kv_compression` (a dict, a KVCompression or None) -> KVCompression; None when
    unset, NONE for {"method": "none"} (which also opts out of a server default)."""
    if value is None or isinstance(value, KVCompression):
        return value
    if not isinstance(value, dict):
        raise KVCompressionError(f"{field} must be an object such as {{\"method\": \"streaming\", "
                                 f"\"sink_tokens\": 4, \"window\": 1024}}, got {value!r}")
    method = value.get("method")
    if method == "none":
        if set(value) != {"method"}:
            raise KVCompressionError(f"{field} method \"none\" takes no other keys; got {sorted(value)}")
        return NONE
    if method not in METHODS:
        raise KVCompressionError(f"{field}.method must be one of {', '.join(METHODS)} or none, got {method!r}")
    unknown = sorted(set(value) - _KEYS[method])
    if unknown:
        raise KVCompressionError(f"{field} keys {', '.join(unknown)} not understood by method {method!r} "
                                 f"(its keys: {', '.join(sorted(_KEYS[method]))})")
    defaults = {"window": None, "sink_tokens": 4, "heavy_tokens": None, "observation_tokens": 32}
    got = {}
    for key in sorted(_KEYS[method] - {"method"}):
        v = value.get(key, defaults[key])
        if v is None:
            raise KVCompressionError(f"{field}.{key} is required for method {method!r} (an integer >= 1)")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KVCompressionError(f"{field}.{key} must be an integer >= 1, got {v!r}")
        got[key] = v
    return KVCompression(method, **got)


def check_kv_compression(c: KVCompression | None, max_model_len: int, sliding_window: int | None,
                         field: str = "kv_compression") -> None:
    """Refuse what an engine cannot serve: compression on a model with a sliding window (its KV is
    bounded by the window already, and its attention masks by position distance, which released
    blocks would shorten), or settings that could never release anything within the context."""
    c = active(c)
    if c is None:
        return
    if sliding_window:
        raise KVCompressionError(f"{field} is not available for this model: it attends through a sliding "
                                 f"window of {sliding_window} tokens, whose blocks kvserve already releases "
                                 f"as the sequence passes them; drop {field}")
    for key in ("window", "sink_tokens", "heavy_tokens", "observation_tokens"):
        v = getattr(c, key)
        if v >= max_model_len:
            raise KVCompressionError(f"{field}.{key} {v} is not smaller than the context length "
                                     f"{max_model_len} (max_model_len): nothing would ever be released; "
                                     f"lower it or drop kv_compression")
    if c.budget >= max_model_len:
        raise KVCompressionError(f"{field} keeps {c.budget} tokens (window + sinks + heavy), no fewer than the context "
                                 f"length {max_model_len} (max_model_len); lower window")
