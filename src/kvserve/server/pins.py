"""Pinned prefixes over HTTP: `POST /v1/cache/pins`, `GET /v1/cache/pins[/{id}]`,
`DELETE /v1/cache/pins/{id}`.

Neither vLLM nor SGLang has pinning; the routes follow OpenAI's resource conventions (a create
returns the object with its id, a list is {"object": "list", "data"}, a delete {"id", "object",
"deleted"}). They are admin routes: with --api-key / --api-keys-file, only admin keys (every
--api-key key, file entries with "admin": true) may call them, and a key sees only its tenant's
pins (another tenant's id is a 404, as if it did not exist). Without keys they are open, as every
route is. A pin's blocks are hashed with the tenant's salt, so they serve that tenant's requests
only (those that send no cache_salt of their own).
"""
from __future__ import annotations

import asyncio
import time

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ConfigDict

from kvserve.engine.outputs import RequestError
from kvserve.server import protocol as P
from kvserve.server.auth import Authenticator, effective_cache_salt
from kvserve.server.protocol import APIError

POLL_S = 0.02  # how often a pin being computed is looked at
WAIT_S = 600.0  # longer than this, the POST answers 202 with the pin still "pending"


class PinRequest(P._Strict):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    model: str | None = None  # the base model's name, or a LoRA adapter's (its blocks are the adapter's)


def add_pin_routes(app: FastAPI, llm, serving, auth: Authenticator) -> None:
    bearer = HTTPBearer(auto_error=False)

    async def admin(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str | None:
        """The caller's tenant, for an admin key (or anyone, without keys)."""
        if not auth.enabled:
            return None
        key = auth.require(credentials.credentials if credentials else None)
        if not key.admin:
            raise APIError(f"pinning needs an admin key: this key (tenant {key.tenant!r}) has none; give its entry "
                           f"\"admin\": true in --api-keys-file, or use an --api-key key", status=403,
                           type="permission_error", code="admin_required")
        return key.tenant

    def not_found(pin_id: str) -> APIError:
        return APIError(f"no pin {pin_id!r} for this key's tenant; GET /v1/cache/pins lists them", status=404,
                        param="id", type="NotFoundError", code="pin_not_found")

    @app.post("/v1/cache/pins", responses={k: {"model": P.ErrorResponse} for k in (400, 401, 403, 404)})
    async def create_pin(body: PinRequest, who: str | None = Depends(admin)):
        if llm.args.data_parallel_size > 1:
            raise APIError(f"pinning is not available with --data-parallel-size {llm.args.data_parallel_size}: "
                           "each replica has its own KV pool; run one replica to pin prefixes", param="prompt")
        if (body.prompt is None) == (body.prompt_token_ids is None):
            raise APIError("send exactly one of `prompt` (text) or `prompt_token_ids`", param="prompt")
        lora = serving.check_model(body.model)
        if body.prompt is not None:
            if not body.prompt:
                raise APIError("prompt is empty; send the text of the prefix to pin", param="prompt")
            ids = await serving.off_loop(serving.tokenizer.encode, body.prompt)  # as /v1/completions does
        else:
            ids = body.prompt_token_ids
            if not ids:
                raise APIError("prompt_token_ids is empty; send the token ids of the prefix to pin",
                               param="prompt_token_ids")
            vocab = serving.tokenizer.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(f"prompt_token_ids must be in [0, {vocab}); got {bad[:5]}", param="prompt_token_ids")
        salt = effective_cache_salt(who, None)
        try:
            pin = await llm.acall("pin_prefix", ids, salt, lora)
        except RequestError as e:
            code = "pinned_bytes_cap" if e.param == "max_pinned_kv_bytes" else None
            raise APIError(str(e), param=e.param, code=code) from None
        deadline = time.monotonic() + WAIT_S
        while pin["status"] == "pending" and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            pin = await llm.acall("get_pin", pin["id"], salt) or pin
        if pin["status"] == "failed":
            raise APIError(f"pin {pin['id']} was not made: {pin.get('error')}", status=500,
                           type="InternalServerError")
        return JSONResponse(pin, status_code=202 if pin["status"] == "pending" else 200)

    @app.get("/v1/cache/pins", responses={k: {"model": P.ErrorResponse} for k in (401, 403)})
    async def list_pins(who: str | None = Depends(admin)):
        return {"object": "list", "data": await llm.acall("list_pins", effective_cache_salt(who, None))}

    @app.get("/v1/cache/pins/{pin_id}", responses={k: {"model": P.ErrorResponse} for k in (401, 403, 404)})
    async def get_pin(pin_id: str, who: str | None = Depends(admin)):
        pin = await llm.acall("get_pin", pin_id, effective_cache_salt(who, None))
        if pin is None:
            raise not_found(pin_id)
        return pin

    @app.delete("/v1/cache/pins/{pin_id}", responses={k: {"model": P.ErrorResponse} for k in (401, 403, 404)})
    async def delete_pin(pin_id: str, who: str | None = Depends(admin)):
        pin = await llm.acall("unpin", pin_id, effective_cache_salt(who, None))
        if pin is None:
            raise not_found(pin_id)
        return {"id": pin_id, "object": "cache.pin.deleted", "deleted": True, "bytes": pin["bytes"]}
