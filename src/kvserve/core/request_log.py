"""One line of the request log (`kvserve serve --request-log FILE`), the input of `kvserve analyze`:
the server writes it, the tool reads it, both through this module (field list in tools/analyze.py)."""
from __future__ import annotations

import json
import time as _time

from kvserve.core.cache_retention import CacheRetentionError, parse_cache_retention

REQUEST_LOG_KEYS = ("time", "request_id", "prompt_tokens", "output_tokens", "cached_tokens",
                    "cache_write_tokens", "cache_retention", "prompt_token_ids", "ttft", "e2e", "finish_reason",
                    "abort_reason")
ABORT_REASONS = ("client", "shutdown", "error")  # the client left; the shutdown drain ended it; a step failed


def format_request_log_record(*, request_id: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                              ttft: float | None, e2e: float, finish_reason: str | None,
                              prompt_token_ids: list[int] | None = None, time: float | None = None,
                              abort_reason: str | None = None, cache_write_tokens: int | None = None,
                              cache_retention: dict | None = None) -> str:
    """One line of kvserve's request log (no trailing newline); the server appends it for --request-log.
    `abort_reason` (one of ABORT_REASONS) for a request that ended without finishing.
    `cache_write_tokens`: prompt tokens the request wrote to the prefix cache; `cache_retention`:
    its effective retention ({"priority", "ttl_s"}, a tenant's default applied)."""
    if abort_reason is not None and abort_reason not in ABORT_REASONS:
        raise ValueError(f"request log: abort_reason must be one of {ABORT_REASONS} (got {abort_reason!r})")
    for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens),
                        ("cached_tokens", cached_tokens), ("cache_write_tokens", cache_write_tokens or 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"request log: {name} must be a non-negative int (got {value!r})")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"request log: cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")
    if cache_retention is not None:
        try:
            cache_retention = parse_cache_retention(cache_retention).as_dict()
        except CacheRetentionError as e:
            raise ValueError(f"request log: {e}") from None
    if prompt_token_ids is not None and len(prompt_token_ids) != prompt_tokens:
        raise ValueError(f"request log: {len(prompt_token_ids)} prompt_token_ids for prompt_tokens={prompt_tokens}")
    record = {"time": _time.time() if time is None else float(time), "request_id": str(request_id),
              "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "cached_tokens": cached_tokens}
    if cache_write_tokens is not None:
        record["cache_write_tokens"] = cache_write_tokens
    if cache_retention is not None:
        record["cache_retention"] = cache_retention
    if prompt_token_ids is not None:
        record["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
    record.update(ttft=None if ttft is None else round(float(ttft), 6), e2e=round(float(e2e), 6),
                  finish_reason=finish_reason)
    if abort_reason is not None:
        record["abort_reason"] = abort_reason
    return json.dumps(record, separators=(",", ":"))
