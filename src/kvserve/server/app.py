"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, error objects, body limits, disconnects.

Every refusal is an OpenAI error object `{"error": {"message", "type", "param", "code"}}` with a 4xx
status; a 5xx means a bug in kvserve (or a failed engine step) and is logged with its traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import envs
from kvserve.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError
from kvserve.server import protocol as P
from kvserve.server.auth import Authenticator, effective_cache_salt
from kvserve.server.metrics import ServerMetrics
from kvserve.server.pins import add_pin_routes
from kvserve.server.protocol import APIError
from kvserve.server.semantic_cache import Headed
from kvserve.server.serving import OpenAIServing, ServingConfig
from kvserve.server.sse import EventStreamResponse, sse_event
from kvserve.server.worker_api import add_worker_routes
from kvserve.version import __version__

logger = logging.getLogger("kvserve.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
_ERRORS = {400: P.ErrorResponse, 401: P.ErrorResponse, 404: P.ErrorResponse, 413: P.ErrorResponse}
ERROR_RESPONSES = {code: {"model": model} for code, model in _ERRORS.items()}


def _error(status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(message, status=status, param=param, type=type, code=code).to_dict(),
                        status_code=status)


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): paired ones decode to one character, a lone
# one to a str no tokenizer or UTF-8 response can take.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def lone_surrogate(body: bytes) -> str | None:
    """Where a JSON body's strings hold an unpaired surrogate escape: a message naming the field,
    or None (also for bodies that are not JSON, whose parser error says more)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None

    def found(where: str, s: str) -> str | None:
        bad = next((i for i, ch in enumerate(s) if 0xD800 <= ord(ch) <= 0xDFFF), None)
        if bad is None:
            return None
        return (f"{where} holds an unpaired UTF-16 surrogate (\\u{ord(s[bad]):04x} at character {bad}), which "
                "is not Unicode text; send the character as a surrogate pair or drop it")

    stack: list[tuple[str, object]] = [("", doc)]
    while stack:  # iterative: a deeply nested body must not exhaust the recursion limit
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if message := found(f"a key of `{path}`" if path else "a key", key):
                    return message
                name = key.encode("utf-8", "backslashreplace").decode()
                stack.append((f"{path}.{name}" if path else name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and (message := found(f"`{path or 'request body'}`", value)):
            return message
    return None


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` (413) and bodies that are not UTF-8 (400) or hold an unpaired
    surrogate escape (400) before any parsing.

    Pure ASGI so that the disconnect messages that follow the body still reach the app.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, 413, f"Request body is {int(declared)} bytes; the limit is "
                                                 f"{self.max_bytes} bytes (--max-request-body-bytes)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send, 413, f"Request body exceeds the limit of {self.max_bytes} bytes "
                                                     "(--max-request-body-bytes)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await self._refuse(send, 400, f"Request body is not valid UTF-8: byte 0x{body[e.start]:02x} "
                                                 f"at offset {e.start}; send JSON encoded as UTF-8")
        surrogate = lone_surrogate(body)
        if surrogate is not None:
            return await self._refuse(send, 400, surrogate)
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if not ctype.endswith(b"json") and body.lstrip()[:1] in (b"{", b"["):
            # A JSON body under another content type (`curl -d` sends x-www-form-urlencoded) is
            # read as the JSON it is, rather than refused as "not a dictionary".
            scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        response = _error(status, message, code="request_too_large" if status == 413 else None)
        await response({"type": "http"}, None, send)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, coro):
    """Run a non-streaming handler; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            logger.info("client disconnected before the response; request aborted")
    return None if task.cancelled() else task.result()


def _stream_error(e: BaseException) -> list[str] | None:
    """The last events of a stream whose engine failed mid-way (None: not an engine failure)."""
    if isinstance(e, EngineStepError):
        return [sse_event(APIError(str(e), status=500, type="InternalServerError").to_dict()), "data: [DONE]\n\n"]
    if isinstance(e, EngineDeadError):  # shutdown (--shutdown-timeout) or a dead loop: the 503 a non-streamed one gets
        return [sse_event(APIError(f"the engine is not running: {e}", status=503,
                                   type="ServiceUnavailableError").to_dict()), "data: [DONE]\n\n"]
    return None


# Fields that take one of several forms, and how to say which (pydantic lists each form's failure).
_UNION_SHAPES = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists "
              "(one kind per request, not a mix)",
    "stop": "must be a string or a list of strings",
}


def _semantic(serving: OpenAIServing):
    if serving.semantic is None:
        raise APIError("this server has no semantic cache; start it with --semantic-cache", status=404,
                       type="NotFoundError", code="semantic_cache_off")
    return serving.semantic


def build_app(llm: AsyncLLM, config: ServingConfig, metrics: ServerMetrics, auth: Authenticator,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, dashboard=None, semantic_cache=None) -> FastAPI:
    """dashboard: a DashboardSeries (server/dashboard.py) listening to the steps, or None for no
    GET /dashboard. semantic_cache: a SemanticCacheConfig (server/semantic_cache.py), or None."""
    serving = OpenAIServing(llm, config)
    if semantic_cache is not None:
        from kvserve.server.semantic_cache import SemanticFront
        serving.semantic = SemanticFront(semantic_cache, metrics.registry)
    if llm.args.kv_transfer_config is not None:
        from kvserve.server.kv_transfer import KVTransfer
        serving.kv_transfer = KVTransfer(llm, metrics.registry)
    serving.register_startup_adapters()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start(on_loop=True)
        yield
        llm.shutdown()
        if serving.semantic is not None:
            serving.semantic.close()

    no_docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.disable_docs else {}
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server built around KV-cache management.", **no_docs)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if config.cors is not None:
        from starlette.middleware.cors import CORSMiddleware
        c = config.cors
        app.add_middleware(CORSMiddleware, allow_origins=c.allowed_origins, allow_methods=c.allowed_methods,
                           allow_headers=c.allowed_headers, allow_credentials=c.allow_credentials)
    bearer = HTTPBearer(auto_error=False)

    async def tenant(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str | None:
        if not auth.enabled:
            return None
        key = auth.require(credentials.credentials if credentials else None)
        return key.tenant

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "JSON decode error")
            return _error(400, f"Request body is not valid JSON: {detail} at offset {loc[0] if loc else '?'}")
        if len(loc) > 3 and loc[0] == "messages" and loc[2] == "content":
            # pydantic names the union branch that failed last (`messages.0.content.str`); say the shapes
            return _error(400, f"`messages[{loc[1]}].content` must be a string, null or a list of content parts "
                               "such as {\"type\": \"text\", \"text\": \"...\"}", param=f"messages.{loc[1]}.content")
        fields = {next((str(x) for x in err.get("loc", ()) if x != "body"), None) for err in errors}
        if len(errors) > 1 and len(fields) == 1 and (field := fields.pop()) in _UNION_SHAPES:
            # One field that fits none of its accepted forms: pydantic reports each form's failure
            return _error(400, f"`{field}` {_UNION_SHAPES[field]}", param=field)
        param = ".".join(loc) or None
        where = f"`{param}`" if param else "request body"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        msg = first.get("msg", "invalid")
        if first.get("type") == "missing":
            msg = "this field is required"
        return _error(400, f"{where}: {msg}{more}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), type=kind)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError):
        return _error(503, f"the engine is not running: {e}", type="ServiceUnavailableError")

    @app.exception_handler(EngineStepError)
    async def step_failed(_: Request, e: EngineStepError):
        return _error(500, str(e), type="InternalServerError")

    def _tenant_retention(body: P._SamplingRequest, who: str | None) -> None:
        """A request that gives no cache_retention takes its tenant's (--api-keys-file)."""
        if body.cache_retention is None and (default := auth.default_retention(who)) is not None:
            body.cache_retention = default.as_dict()

    async def respond(request: Request, result):
        headers = None
        if isinstance(result, Headed):
            result, headers = result.body, result.headers
        if isinstance(result, dict):
            return JSONResponse(result, headers=headers)
        return EventStreamResponse(result, _stream_error, headers)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: P.CompletionRequest, request: Request, who: str | None = Depends(tenant)):
        salt = effective_cache_salt(who, body.cache_salt)
        _tenant_retention(body, who)
        if body.stream:
            return await respond(request, await serving.create_completion(body, salt))
        result = await _until_disconnect(request, serving.create_completion(body, salt))
        return Response(status_code=499) if result is None else await respond(request, result)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request,
                               who: str | None = Depends(tenant)):
        salt = effective_cache_salt(who, body.cache_salt)
        _tenant_retention(body, who)
        if body.stream:
            return await respond(request, await serving.create_chat_completion(body, salt, who))
        result = await _until_disconnect(request, serving.create_chat_completion(body, salt, who))
        return Response(status_code=499) if result is None else await respond(request, result)

    @app.get("/v1/models", response_model=P.ModelList, dependencies=[Depends(tenant)])
    async def models():
        base = [P.ModelCard(id=name, root=llm.args.model or "SmolLM2-135M-Instruct",
                            max_model_len=llm.max_model_len) for name in config.served_model_names]
        adapters = [P.ModelCard(id=name, root=lora.lora_path, parent=serving.model_name, max_model_len=llm.max_model_len)
                    for name, lora in serving.loras.items()]
        return P.ModelList(data=base + adapters)

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:  # as vLLM: the routes exist only when allowed
        @app.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES, dependencies=[Depends(tenant)])
        async def load_lora_adapter(body: P.LoadLoRAAdapterRequest):
            return Response(await serving.load_lora_adapter(body.lora_name, body.lora_path), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES, dependencies=[Depends(tenant)])
        async def unload_lora_adapter(body: P.UnloadLoRAAdapterRequest):
            return Response(serving.unload_lora_adapter(body.lora_name), media_type="text/plain")

    @app.get("/v1/semantic_cache", responses=ERROR_RESPONSES)
    async def semantic_cache_size(who: str | None = Depends(tenant)):
        """The caller's tenant's entries and bytes in the semantic cache."""
        return _semantic(serving).size(who)

    @app.delete("/v1/semantic_cache", responses=ERROR_RESPONSES)
    async def semantic_cache_clear(who: str | None = Depends(tenant)):
        """Removes the caller's tenant's entries, and no one else's."""
        return await serving.off_loop(_semantic(serving).clear, who)

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return _error(503, "the engine loop is not running", type="ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response)
    async def metrics_endpoint():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", responses={409: {"model": P.ErrorResponse}}, dependencies=[Depends(tenant)])
    async def reset_prefix_cache():
        if await llm.reset_prefix_cache():
            return {"status": "ok", "message": "prefix cache reset"}
        used = llm.latest_stats.num_blocks_used
        return _error(409, f"cannot reset the prefix cache: KV blocks are in use ({used} referenced by "
                           "running or waiting requests); retry when the server is idle", type="conflict", code="blocks_in_use")

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERROR_RESPONSES,
              dependencies=[Depends(tenant)])
    async def tokenize(body: P.TokenizeRequest):
        serving.check_model(body.model)
        serving.check_extras(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send exactly one of `prompt` or `messages`", param="prompt")
        if body.prompt is not None:
            ids = await serving.off_loop(serving.tokenizer.encode, body.prompt,
                                         add_special_tokens=body.add_special_tokens)
        else:
            if not body.messages:
                raise APIError("`messages` is empty", param="messages")
            chat = P.ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                           continue_final_message=body.continue_final_message)
            ids = await serving.off_loop(serving.chat_prompt, chat)
        # vocabulary pieces, as vLLM's convert_ids_to_tokens ("Ġthere"), not decoded text
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERROR_RESPONSES,
              dependencies=[Depends(tenant)])
    async def detokenize(body: P.DetokenizeRequest):
        serving.check_model(body.model)
        serving.check_extras(body)
        vocab = serving.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return P.DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    add_worker_routes(app, llm, serving, tenant)
    add_pin_routes(app, llm, serving, auth)
    if dashboard is not None:
        from kvserve.server.dashboard import add_dashboard
        add_dashboard(app, llm, dashboard, tenant, serving.tokenizer)
    return app
