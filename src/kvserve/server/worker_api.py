"""The routes a router in front of several servers calls on each of them, besides the OpenAI ones.

vllm-router (and SGLang's gateway, which it forks) renders every request on a worker before it
picks one (`POST /v1/completions/render`, `/v1/chat/completions/render`: vLLM's, the prompt as
token ids plus the sampling parameters it resolves to, nothing generated), and forwards its own
`/flush_cache`, `/get_server_info` and `/get_model_info` to the workers (SGLang's names). Health
is `/health`, load is read from `/metrics`: both exist already.
"""
from __future__ import annotations

import dataclasses
import time

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from kvserve.core.sampling_params import SamplingParams
from kvserve.server import protocol as P
from kvserve.version import __version__

# The SamplingParams fields a render response carries, under vLLM's names (the rest are kvserve's
# own bookkeeping or fields vLLM would refuse here).
_RENDERED = ("n", "temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
             "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens")


def _params_json(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in _RENDERED}


def _generate_request(request_id: str, ids: list[int], params: SamplingParams, req, model: str) -> dict:
    """vLLM's GenerateRequest (the body of its token-in /generate), as its render routes answer."""
    return {"request_id": request_id, "token_ids": ids, "features": None, "sampling_params": _params_json(params),
            "model": model, "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": req.cache_salt, "priority": req.priority}


def add_worker_routes(app: FastAPI, llm, serving, tenant) -> None:
    """serving: the app's OpenAIServing (its checks and tokenization, so a render equals what the
    same body would run); tenant: the API-key dependency."""

    @app.post("/v1/completions/render", dependencies=[Depends(tenant)])
    async def render_completion(body: P.CompletionRequest):
        serving._check_common(body, P.COMPLETION_REFUSED)
        ids, _ = await serving.off_loop(serving._completion_prompts, body)
        base = f"cmpl-{body.model_extra.get('request_id') or time.time_ns()}"
        out = []
        for i, prompt in enumerate(serving._truncated(p, body) for p in ids):
            max_tokens = serving._check_length(len(prompt), body.max_tokens, "prompt")
            params = serving._sampling_params(body, max_tokens, body.logprobs, prompt_logprobs=body.prompt_logprobs)
            rid = base if len(ids) == 1 else f"{base}-{i}"
            out.append(_generate_request(rid, prompt, params, body, serving._served_name(body)))
        return out

    @app.post("/v1/chat/completions/render", dependencies=[Depends(tenant)])
    async def render_chat_completion(body: P.ChatCompletionRequest):
        serving._check_common(body, {"echo": "echo is not implemented for chat completions"})
        ids = serving._truncated(await serving.off_loop(serving.chat_prompt, body), body)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = serving._sampling_params(body, serving._check_length(len(ids), requested, "messages"),
                                          (body.top_logprobs or 0) if body.logprobs else None,
                                          prompt_logprobs=body.prompt_logprobs)
        rid = f"chatcmpl-{body.model_extra.get('request_id') or time.time_ns()}"
        return _generate_request(rid, ids, params, body, serving._served_name(body))

    @app.post("/flush_cache", dependencies=[Depends(tenant)])
    async def flush_cache():
        # SGLang's answer: plain text, 200 when flushed, 400 while requests hold blocks
        if await llm.reset_prefix_cache():
            return Response("Cache flushed.\n", media_type="text/plain")
        return Response("Cache not flushed: KV blocks are in use by running or waiting requests; retry when the "
                        "server is idle.\n", status_code=400, media_type="text/plain")

    @app.get("/get_model_info", dependencies=[Depends(tenant)])
    async def get_model_info():
        cfg = llm.model_config
        return {"model_path": llm.args.model or "SmolLM2-135M-Instruct",
                "tokenizer_path": llm.args.tokenizer or llm.args.model or "SmolLM2-135M-Instruct",
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)}

    @app.get("/get_server_info", dependencies=[Depends(tenant)])
    async def get_server_info():
        s = llm.latest_stats
        args = {f.name: getattr(llm.args, f.name) for f in dataclasses.fields(llm.args)}
        return JSONResponse({**{k: v for k, v in args.items() if _is_json(v)}, "version": __version__,
                             "served_model_name": serving.model_name, "max_model_len": llm.max_model_len,
                             "internal_states": [{
                                 "num_running_reqs": s.num_running if s else 0,
                                 "num_waiting_reqs": s.num_waiting if s else 0,
                                 "token_usage": s.kv_usage if s else 0.0,
                                 "last_gen_throughput": None, "avg_spec_accept_length": None}]})


def _is_json(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, (list, tuple)) and all(_is_json(v) for v in value))

