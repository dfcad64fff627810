"""Server-sent events as vLLM's stream sends them."""
from __future__ import annotations

import json

from kvserve.server import protocol as P


def chat_chunk(chunk: P.ChatCompletionChunk) -> dict:
    """A chat stream chunk as vLLM sends it: finish_reason / logprobs / stop_reason present even
    when null; the delta only with what it carries; usage only when there is some."""
    d = chunk.model_dump()
    for c in d["choices"]:
        c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
    if d.get("usage") is None:
        d.pop("usage", None)
    return d


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
