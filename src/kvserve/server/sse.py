"""Server-sent events as vLLM's stream sends them, and the ASGI response that writes them."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from json.encoder import encode_basestring  # what json.dumps(a str, ensure_ascii=False) runs
from typing import AsyncIterator, Callable

from starlette.responses import Response

from kvserve.server import protocol as P

logger = logging.getLogger("kvserve.server")


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


def _value(v) -> str:
    return "null" if v is None else json.dumps(v, ensure_ascii=False)


class ChunkTemplate:
    """One stream's text chunks, byte for byte what `sse_event(CompletionChunk(...).model_dump())`
    or `sse_event(chat_chunk(ChatCompletionChunk(...)))` write, from the parts every chunk of the
    stream shares, encoded once: an event costs one string escape and one format instead of a
    pydantic model, its dump and a dict's JSON (8.4 -> 0.2 us; bench/NOTES.md, "Streaming: an
    event's JSON from a per-stream template, written by one task"). For chunks without logprobs or
    usage; those take the models."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = json.dumps({"id": request_id, "object": obj, "created": created, "model": model}, ensure_ascii=False)
        self._head = f'data: {head[:-1]}, "choices": [{{"index": '
        self._text = ', "delta": {"content": ' if chat else ', "text": '
        self._tail = "}]}\n\n" if chat else '}], "usage": null}\n\n'
        self._close = "}" if chat else ""  # the delta object

    def event(self, index: int, text: str, finish_reason: str | None = None, stop_reason=None) -> str:
        return (f'{self._head}{index}{self._text}{encode_basestring(text)}{self._close}, "logprobs": null, '
                f'"finish_reason": {_value(finish_reason)}, "stop_reason": {_value(stop_reason)}{self._tail}')


_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
            (b"content-type", b"text/event-stream; charset=utf-8")]


class EventStreamResponse(Response):
    """An ASGI text/event-stream response over an async iterator of events.

    One task writes the events as they come; the request's own task meanwhile waits for the
    client's disconnect and cancels the writer when it comes, which closes the iterator (its
    `finally` aborts the requests) even while nothing has been produced yet. Per event: one
    `send`, no task and no wait set, where Starlette's StreamingResponse behind a guard that
    watched the disconnect around every event cost ~20 us more (bench/NOTES.md, "Streaming: an
    event's JSON from a per-stream template, written by one task").

    `on_error(e)`: the last events to send for an exception the iterator raised, or None to let it
    propagate (a bug: the server logs it and closes the connection).
    """

    def __init__(self, events: AsyncIterator[str], on_error: Callable[[BaseException], list[str] | None],
                 headers: dict[str, str] | None = None):
        # A Response (FastAPI returns those as they are), but none of its body machinery.
        self.events, self.on_error, self.background = events, on_error, None
        self.extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS + self.extra})
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(self._disconnect(receive))
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not writer.done():
                writer.cancel()
                logger.info("client disconnected mid-stream; request aborted")
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                return
        writer.result()  # an unexpected error: ServerErrorMiddleware logs it

    async def _write(self, send) -> None:
        events = self.events
        try:
            async for event in events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        except Exception as e:
            last = self.on_error(e)
            if last is None:
                raise
            for event in last:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        finally:
            # Cancelled while a send waited for the socket: the generator sits at a yield and
            # only closing it runs its cleanup (the abort). A no-op when it already ended.
            await events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _disconnect(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
