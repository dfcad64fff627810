"""One line of the request log (`kvserve serve --request-log FILE`), the input of `kvserve analyze`:
the server writes it, the tool reads it, both through this module (field list in tools/analyze.py)."""
from __future__ import annotations

import json
import time as _time

REQUEST_LOG_KEYS = ("time", "request_id", "prompt_tokens", "output_tokens", "cached_tokens",
                    "prompt_token_ids", "ttft", "e2e", "finish_reason", "abort_reason")
ABORT_REASONS = ("client", "shutdown", "error")  # the client left; the shutdown drain ended it; a step failed


def format_request_log_record(*, request_id: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                              ttft: float | None, e2e: float, finish_reason: str | None,
                              prompt_token_ids: list[int] | None = None, time: float | None = None,
                              abort_reason: str | None = None) -> str:
    """One line of kvserve's request log (no trailing newline); the server appends it for --request-log.
    `abort_reason` (one of ABORT_REASONS) for a request that ended without finishing."""
    if abort_reason is not None and abort_reason not in ABORT_REASONS:
        raise ValueError(f"request log: abort_reason must be one of {ABORT_REASONS} (got {abort_reason!r})")
    for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens),
                        ("cached_tokens", cached_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"request log: {name} must be a non-negative int (got {value!r})")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"request log: cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")
    if prompt_token_ids is not None and len(prompt_token_ids) != prompt_tokens:
        raise ValueError(f"request log: {len(prompt_token_ids)} prompt_token_ids for prompt_tokens={prompt_tokens}")
    record = {"time": _time.time() if time is None else float(time), "request_id": str(request_id),
              "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "cached_tokens": cached_tokens}
    if prompt_token_ids is not None:
        record["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
    record.update(ttft=None if ttft is None else round(float(ttft), 6), e2e=round(float(e2e), 6),
                  finish_reason=finish_reason)
    if abort_reason is not None:
        record["abort_reason"] = abort_reason
    return json.dumps(record, separators=(",", ":"))
