"""OpenAI completions and chat completions on top of AsyncLLM: request -> SamplingParams -> engine
-> response JSON or SSE chunks.

Prompts are tokenized here (not in the engine) so that the context-length check, the usage block
and the chat template's special tokens are decided in one place.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

import torch

from kvserve.core.lora import LoRARequest
from kvserve.core.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from kvserve.engine.async_engine import AsyncLLM, RequestStream
from kvserve.engine.outputs import RequestError
from kvserve.model.tokenizer import TokenizerError, check_chat_template_kwargs
from kvserve.server import protocol as P
from kvserve.server.logprobs import chat_logprobs, completion_logprobs, echoed, prompt_logprobs
from kvserve.server.protocol import APIError
from kvserve.server.semantic_cache import HEADER as SEMANTIC_HEADER
from kvserve.server.semantic_cache import Headed
from kvserve.server.semantic_cache import check_request as check_semantic
from kvserve.server.sse import ChunkTemplate, chat_chunk, sse_event

logger = logging.getLogger("kvserve.server")



@dataclass
class ServingConfig:
    served_model_names: list[str]
    max_logprobs: int = 20
    enable_log_requests: bool = False
    max_log_len: int | None = None
    response_role: str = "assistant"  # vLLM's --response-role
    scheduling_policy: str = "fcfs"
    cors: CorsConfig | None = None  # None: no CORS headers (tests, embedding apps)
    disable_docs: bool = False  # vLLM's --disable-fastapi-docs: no /docs, /redoc, /openapi.json
    max_queued_requests: int | None = None  # SGLang's --max-queued-requests: a 503 beyond it
    lora_modules: list = field(default_factory=list)  # config.LoRAModulePath: adapters served from the start


def _is_off(value) -> bool:
    """A parameter sent at "not used": null, false or empty (0 is a value: prompt_logprobs=0 asks)."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


@dataclass
class CorsConfig:
    """vLLM's CORS flags, with its defaults: any origin, method and header, no credentials."""
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False


@dataclass
class _Admitted:
    """The requests one HTTP call put into the engine (a completions batch has several prompts)."""
    request_id: str
    streams: list[RequestStream]

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, config: ServingConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.model_name = config.served_model_names[0]
        self.loras: dict[str, LoRARequest] = {}  # served adapters by name
        self._lora_ids = itertools.count(1)
        self.token_text = llm.token_text
        self.kv_transfer = None  # KVTransfer (kv_transfer.py) when --kv-transfer-config is set: build_app's
        self.semantic = None  # SemanticFront (semantic_cache.py) when --semantic-cache is set: build_app's
        # Tokenizing (and rendering chat templates) runs here, off the event loop: a 10 MB prompt
        # takes seconds to tokenize, during which /health and every stream must keep answering.
        # The tokenizers library releases the GIL while it encodes.
        self._tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-tokenize")
        if self.tokenizer is not None:
            self.tokenizer.max_token_chars  # computed now (a pass over the vocabulary), not by a request

    async def off_loop(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the tokenizing threads; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, partial(fn, *args, **kwargs))

    # ----- validation -----

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model in self.config.served_model_names:
            return None
        if model in self.loras:
            return self.loras[model]
        raise APIError(f"The model `{model}` does not exist. Served models: "
                       f"{', '.join([*self.config.served_model_names, *self.loras])}", status=404, param="model",
                       type="NotFoundError", code="model_not_found")

    def _served_name(self, req) -> str:
        """The `model` a response names: the adapter's name when the request chose one (vLLM's)."""
        return req.model if req.model is not None and req.model in self.loras else self.model_name

    # ----- LoRA adapters -----

    def _check_adapter(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for a readable adapter of this model; LoRAError with the reason otherwise."""
        from kvserve.model.lora import load_adapter
        cfg = self.llm.model_config
        load_adapter(path, name, cfg, self.llm.args.max_lora_rank, torch.float32)  # raises the reason
        return LoRARequest(name, next(self._lora_ids), path)

    def register_startup_adapters(self) -> None:
        """--lora-modules, each checked now: a bad one stops the start with the reason."""
        from kvserve.config import ConfigError
        from kvserve.model.lora import LoRAError
        for m in self.config.lora_modules:
            if m.name in self.loras or m.name in self.config.served_model_names:
                raise ConfigError(f"--lora-modules: the name {m.name!r} is given twice; give each adapter its own name")
            try:
                self.loras[m.name] = self._check_adapter(m.name, m.path)
            except LoRAError as e:
                raise ConfigError(f"--lora-modules {m.name}={m.path}: {e}") from None

    async def load_lora_adapter(self, name: str, path: str) -> str:
        from kvserve.model.lora import LoRAError
        if not self.llm.args.enable_lora:
            raise APIError("LoRA is not enabled on this server; start it with --enable-lora", param="lora_name")
        if not name or not path:
            raise APIError("both 'lora_name' and 'lora_path' must be provided", param="lora_name")
        if name in self.loras or name in self.config.served_model_names:
            raise APIError(f"The lora adapter '{name}' has already been loaded; unload it first to replace it",
                           param="lora_name", code="already_loaded")
        try:
            req = await self.off_loop(self._check_adapter, name, path)
        except LoRAError as e:
            raise APIError(f"The lora adapter '{name}' cannot be loaded: {e}", param="lora_path") from None
        if name in self.loras:  # a concurrent load of the same name won
            raise APIError(f"The lora adapter '{name}' has already been loaded", param="lora_name",
                           code="already_loaded")
        self.loras[name] = req
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, name: str) -> str:
        """New requests for it get a 404 at once; requests already running keep their copy of the
        adapter in the engine and finish with it."""
        if name not in self.loras:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                           type="NotFoundError", code="lora_not_found")
        del self.loras[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def check_extras(self, req: P._Request, refused: dict[str, str] | None = None) -> None:
        """A vLLM parameter kvserve lacks gets a 400 naming it; other unknown fields are ignored
        with a warning, as vLLM does. `refused`: endpoint-specific additions."""
        ignored = []
        for name, value in (req.model_extra or {}).items():
            why = (refused or {}).get(name) or P.UNSUPPORTED_PARAMS.get(name)
            if why is not None:
                if not _is_off(value) and value != P.OFF_VALUES.get(name, None):
                    raise APIError(f"{name} is not supported by kvserve: {why}; remove it", param=name)
            elif name not in P.GATEWAY_DEFAULTS or P.GATEWAY_DEFAULTS[name] != value:
                ignored.append(name)
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", sorted(ignored))

    def _check_common(self, req: P._SamplingRequest, refused: dict[str, str] | None = None) -> None:
        self.check_model(req.model)
        self.check_extras(req, refused)
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options can only be given when stream is true", param="stream_options")
        if req.priority and self.config.scheduling_policy != "priority":
            raise APIError(f"priority {req.priority} was given but the server schedules "
                           f"{self.config.scheduling_policy}; start it with --scheduling-policy priority, "
                           "or drop priority", param="priority")
        if req.logit_bias:
            raise APIError("logit_bias is not supported by kvserve; remove it", param="logit_bias")
        if isinstance(req.stop, list) and any(not s for s in req.stop) or req.stop == "":
            raise APIError("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if req.stop_token_ids and any(not 0 <= t < self.tokenizer.vocab_size for t in req.stop_token_ids):
            raise APIError(f"stop_token_ids must be in [0, {self.tokenizer.vocab_size})", param="stop_token_ids")
        if req.stream and req.prompt_logprobs:  # vLLM refuses them too: they are not sent in chunks
            raise APIError("prompt_logprobs are not available when stream is true; drop one of them",
                           param="prompt_logprobs")

    def _truncated(self, ids: list[int], req: P._SamplingRequest) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: as many as max_model_len)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0:
            raise APIError("truncate_prompt_tokens must be >= 1 (or -1 for max_model_len)", param="truncate_prompt_tokens")
        if k > self.max_model_len:
            raise APIError(f"truncate_prompt_tokens {k} is more than max_model_len {self.max_model_len}",
                           param="truncate_prompt_tokens")
        return ids[-(self.max_model_len if k == -1 else k):]

    def _check_length(self, prompt_len: int, max_tokens: int | None, what: str, at_least: bool = False) -> int:
        """`at_least`: prompt_len is a lower bound (from the text's length, before tokenizing)."""
        if prompt_len == 0:
            raise APIError(f"{what} is empty; send at least one token", param=what)
        room = self.max_model_len - prompt_len
        if room <= 0:
            verb = "have" if what == "messages" else "has"
            count = f"at least {prompt_len}" if at_least else f"{prompt_len}"
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your {what} {verb} {count} tokens, leaving no room for output; shorten it "
                           f"or start the server with a larger --max-model-len", param=what,
                           code="context_length_exceeded")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                           f"{max_tokens} in the completion); reduce max_tokens to at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _sampling_params(self, req: P._SamplingRequest, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and k > self.config.max_logprobs:
                raise APIError(f"{name} must be <= {self.config.max_logprobs} (--max-logprobs), got {k}", param=name)
        # Unset fields take the model's generation_config.json values (--generation-config auto),
        # then vLLM's own defaults; its max_new_tokens caps max_tokens, as in vLLM's get_max_tokens.
        d = self.llm.sampling_defaults

        def pick(value, name: str, default):
            return value if value is not None else d.get(name, default)
        try:
            params = SamplingParams(
                n=req.n, temperature=pick(req.temperature, "temperature", 1.0),
                top_p=pick(req.top_p, "top_p", 1.0), top_k=pick(req.top_k, "top_k", 0),
                min_p=pick(req.min_p, "min_p", 0.0), seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
                max_tokens=min(max_tokens, d.get("max_tokens", max_tokens)), min_tokens=req.min_tokens, stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens, prompt_logprobs=prompt_logprobs,
                kv_compression=req.kv_compression, cache_retention=req.cache_retention)
            params.validate(max_logprobs=self.config.max_logprobs, max_n=P.MAX_N)
        except SamplingParamsError as e:
            raise APIError(str(e), param=str(e).split()[0]) from None
        return params

    async def _admit(self, prompts: list[list[int]], per_prompt: list[SamplingParams],
                     req: P._SamplingRequest, cache_salt: str | None, prefix: str) -> _Admitted:
        admitted = _Admitted(f"{prefix}-{uuid.uuid4().hex}", [])
        limit = self.config.max_queued_requests
        if limit is not None and self.llm.num_queued() + len(prompts) * req.n > limit:
            raise APIError(f"the server has {limit} requests waiting, the most --max-queued-requests allows; "
                           f"retry later", status=503, type="ServiceUnavailableError",
                           code="queue_full", headers={"Retry-After": "1"})
        try:
            for i, (ids, params) in enumerate(zip(prompts, per_prompt)):
                if not req.stream:
                    # Nothing reads a non-streamed request's output before it finishes: the engine
                    # builds none (RequestProgress still carries its per-token metrics).
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                rid = admitted.request_id if len(prompts) == 1 else f"{admitted.request_id}-{i}"
                if self.config.enable_log_requests:
                    text = self.tokenizer.decode(ids, skip_special_tokens=False)[:self.config.max_log_len]
                    logger.info("Received request %s: prompt: %r, params: %s", rid, text, params)
                admitted.streams.append(await self.llm.add_request(ids, params, rid, req.priority, cache_salt,
                                                                   final_only=not req.stream,
                                                                   lora_request=self.check_model(req.model)))
        except RequestError as e:
            admitted.abort()
            raise APIError(str(e), param=e.param) from None
        except BaseException:
            admitted.abort()
            raise
        return admitted

    # ----- /v1/completions -----

    def _completion_prompts(self, req: P.CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        """Token ids of each prompt, and its text where it came as text (echo sends it back as is)."""
        p = req.prompt
        if isinstance(p, str):
            raw = [p]
        elif not p:
            raise APIError("prompt is empty; send a string, a list of strings or token ids", param="prompt")
        elif isinstance(p[0], int):
            raw = [p]
        else:
            raw = list(p)
        if len(raw) * req.n > P.MAX_N:
            raise APIError(f"{len(raw)} prompts x n={req.n} = {len(raw) * req.n} choices; the limit is {P.MAX_N}",
                           param="n")
        vocab = self.tokenizer.vocab_size
        prompts, texts = [], []
        for item in raw:
            if isinstance(item, str):
                if not item:
                    raise APIError("prompt is empty; send at least one character", param="prompt")
                if req.truncate_prompt_tokens is None:
                    self._check_length(-(-len(item) // self.tokenizer.max_token_chars), None, "prompt", at_least=True)
                prompts.append(self.tokenizer.encode(item))
                texts.append(item)
            else:
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise APIError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param="prompt")
                prompts.append(list(item))
                texts.append(None)
        return prompts, texts

    async def create_completion(self, req: P.CompletionRequest, cache_salt: str | None):
        self._check_common(req, P.COMPLETION_REFUSED)
        if req.suffix:
            raise APIError("suffix is not supported by kvserve; remove it", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of is not supported (vLLM V1 dropped it too); use n", param="best_of")
        ids, texts = await self.off_loop(self._completion_prompts, req)
        prompts = [self._truncated(p, req) for p in ids]
        # echo: the prompt as sent (vLLM); token ids and truncated prompts decoded, special tokens kept
        echoes = [(t if t is not None and len(p) == len(q) else self.tokenizer.decode(q)) if req.echo else ""
                  for t, p, q in zip(texts, ids, prompts)]
        if req.max_tokens == 0 and not req.echo:
            raise APIError("max_tokens must be at least 1 (0 is allowed with echo, which returns the prompt alone)",
                           param="max_tokens")
        # echo with max_tokens 0: the prompt alone, as OpenAI and vLLM answer it (one token is
        # generated, as vLLM does, and not sent)
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        # one limit per prompt: a null max_tokens is the room each prompt leaves (vLLM's get_max_tokens)
        # echo with logprobs scores the prompt too (lm-eval's log-likelihood requests)
        scored = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if req.echo else None
        params = [self._sampling_params(req, self._check_length(len(p), max_tokens, "prompt"), req.logprobs,
                                        prompt_logprobs=scored) for p in prompts]
        transfer = self.kv_transfer.plan(req, len(prompts)) if self.kv_transfer else None
        admitted = await self._admit(prompts, self.kv_transfer.sampling(transfer, params, req) if transfer else params,
                                     req, cache_salt, "cmpl")
        if req.stream:
            return self._stream_completion(req, admitted, echoes, transfer)
        finals = await self._collect(admitted)
        choices = []
        for i, out in enumerate(finals):
            for o in out.outputs:
                text, ids, lps = echoed(req, out, echoes[i], o.text, o.token_ids, o.logprobs)
                choices.append(P.CompletionChoice(
                    index=i * req.n + o.index, text=text, finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason, logprobs=completion_logprobs(self.token_text, ids, lps, req.logprobs, 0),
                    prompt_logprobs=prompt_logprobs(out)))
        response = P.CompletionResponse(id=admitted.request_id, model=self._served_name(req), choices=choices,
                                        usage=self._usage(finals)).model_dump()
        return self._with_transfer(response, transfer, finals)

    def _with_transfer(self, response: dict, transfer, finals: list) -> dict:
        """vLLM's kv_transfer_params in a prefill server's response (kv_transfer.py)."""
        params = self.kv_transfer.finish(transfer, finals) if transfer else None
        if params is not None:
            response["kv_transfer_params"] = params
        return response

    async def _stream_completion(self, req: P.CompletionRequest, admitted: _Admitted,
                                 echoes: list[str], transfer=None) -> AsyncIterator[str]:
        try:
            created = int(time.time())  # one timestamp for the whole stream, as vLLM
            finals: dict[int, object] = {}
            offsets: dict[int, int] = {}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            finished: set[int] = set()  # a choice's outputs keep coming while its siblings run (n > 1)
            template = ChunkTemplate(admitted.request_id, created, self._served_name(req), chat=False)
            async for i, out in _merge(admitted):
                finals[i] = out
                for o in out.outputs:
                    index = i * req.n + o.index
                    if index in finished:
                        continue
                    if o.finish_reason:
                        finished.add(index)
                    text, ids, lps = o.delta_text, o.delta_token_ids, o.delta_logprobs
                    if req.echo and index not in offsets:
                        text, ids, lps = echoed(req, out, echoes[i], text, ids, lps)
                    if not text and not o.finish_reason and not o.delta_logprobs:
                        continue
                    start = offsets.get(index, 0)
                    offsets[index] = start + len(text)  # also marks the echo as sent
                    if lps is None and not (include_usage and continuous):
                        yield template.event(index, text, o.finish_reason, o.stop_reason)
                        continue
                    lp = completion_logprobs(self.token_text, ids, lps, req.logprobs, start)
                    chunk = P.CompletionChunk(id=admitted.request_id, created=created, model=self._served_name(req), choices=[
                        P.CompletionStreamChoice(index=index, text=text, logprobs=lp, finish_reason=o.finish_reason,
                                                 stop_reason=o.stop_reason)])
                    if include_usage and continuous:
                        chunk.usage = self._choice_usage(len(out.prompt_token_ids), len(o.token_ids), out.num_cached_tokens,
                                                         out.num_cache_write_tokens)
                    yield sse_event(chunk.model_dump())  # every key, null ones too, as vLLM's stream
            if include_usage:
                yield sse_event(P.CompletionChunk(id=admitted.request_id, created=created, model=self._served_name(req), choices=[],
                                             usage=self._usage(list(finals.values()))).model_dump())
            if transfer:
                self.kv_transfer.finish(transfer, list(finals.values()))
            yield "data: [DONE]\n\n"
        finally:
            admitted.abort()  # idempotent; covers a client that leaves between chunks

    # ----- /v1/chat/completions -----

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True, exclude={"tool_calls"}) for m in req.messages]
        try:  # normalises the messages (chat_text_messages) before rendering
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      continue_final_message=req.continue_final_message,
                                                      **(req.chat_template_kwargs or {}))
        except TokenizerError as e:
            raise APIError(str(e), param="messages") from None
        except Exception as e:  # a template's own raise_exception(), e.g. roles out of order
            raise APIError(f"messages: the chat template rejected them: {e}", param="messages") from None

    async def create_chat_completion(self, req: P.ChatCompletionRequest, cache_salt: str | None,
                                     tenant: str | None = None):
        self._check_common(req, {"echo": "echo is not implemented for chat completions"})
        check_semantic(req, self.semantic is not None)
        if req.tools:
            raise APIError("tools are not supported by kvserve; remove tools/tool_choice", param="tools")
        if req.tool_choice not in (None, "none"):  # vLLM: "When using `tool_choice`, `tools` must be set."
            raise APIError(f"tool_choice {req.tool_choice!r} needs tools, and kvserve serves none; remove "
                           "tool_choice (or send \"none\")", param="tool_choice")
        for i, m in enumerate(req.messages):
            if m.tool_calls:
                raise APIError(f"messages[{i}].tool_calls: tool calls are not supported by kvserve (no tools are "
                               "served), and a template would render the turn without them; remove them",
                               param=f"messages.{i}.tool_calls")
        try:
            check_chat_template_kwargs(req.chat_template_kwargs)
        except TokenizerError as e:
            raise APIError(str(e), param="chat_template_kwargs") from None
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(f"response_format {req.response_format.type!r} is not supported; only 'text'",
                           param="response_format")
        if req.top_logprobs and not req.logprobs:  # 0 is vLLM's default, sent by clients that send every field
            raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
        ids = self._truncated(await self.off_loop(self.chat_prompt, req), req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._check_length(len(ids), requested, "messages")
        params = [self._sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                        prompt_logprobs=req.prompt_logprobs)]
        semantic = self.semantic.plan(req, cache_salt, tenant, self._served_name(req), params[0]) if self.semantic else None
        if semantic is not None:
            hit = await self.semantic.lookup(semantic)
            if hit is not None:
                return self.semantic.hit_response(req, hit, self._served_name(req), self.config.response_role, len(ids))
        transfer = self.kv_transfer.plan(req, 1) if self.kv_transfer else None
        admitted = await self._admit([ids], self.kv_transfer.sampling(transfer, params, req) if transfer else params,
                                     req, cache_salt, "chatcmpl")
        if req.stream:
            stream = self._stream_chat(req, admitted, len(ids), transfer, semantic)
            return stream if semantic is None else Headed(stream, {SEMANTIC_HEADER: "miss"})
        out = (await self._collect(admitted))[0]
        if semantic is not None:
            o = out.outputs[0]
            self.semantic.store(semantic, o.text, o.finish_reason, o.stop_reason)
        choices = [P.ChatChoice(index=o.index, message=P.AssistantMessage(role=self.config.response_role, content=o.text),
                                finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                logprobs=chat_logprobs(o.token_ids, o.logprobs, req.top_logprobs))
                   for o in out.outputs]
        response = P.ChatCompletionResponse(id=admitted.request_id, model=self._served_name(req), choices=choices,
                                            usage=self._usage([out]), prompt_logprobs=prompt_logprobs(out))
        body = self._with_transfer(response.model_dump(), transfer, [out])
        return body if semantic is None else Headed(body, {SEMANTIC_HEADER: "miss"})

    async def _stream_chat(self, req: P.ChatCompletionRequest, admitted: _Admitted,
                           prompt_len: int, transfer=None, semantic=None) -> AsyncIterator[str]:
        try:
            text: list[str] = []  # the answer, for the semantic cache
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            rid, model, created = admitted.request_id, self._served_name(req), int(time.time())
            for i in range(req.n):  # the role comes first, as OpenAI sends it
                role = P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[P.ChatStreamChoice(
                    index=i, delta=P.DeltaMessage(role=self.config.response_role, content=""))])
                if include_usage and continuous:
                    role.usage = self._choice_usage(prompt_len, 0, 0)
                yield sse_event(chat_chunk(role))
            last = None
            template = ChunkTemplate(rid, created, model, chat=True)
            finished: set[int] = set()  # a choice's outputs keep coming while its siblings run (n > 1)
            async for _, out in _merge(admitted):
                last = out
                for o in out.outputs:
                    if o.index in finished:
                        continue
                    if o.finish_reason:
                        finished.add(o.index)
                    if semantic is not None:
                        text.append(o.delta_text)
                        if o.finish_reason:
                            self.semantic.store(semantic, "".join(text), o.finish_reason, o.stop_reason)
                    if not o.delta_text and not o.finish_reason and not o.delta_logprobs:
                        continue
                    if o.delta_logprobs is None and not (include_usage and continuous):
                        yield template.event(o.index, o.delta_text, o.finish_reason, o.stop_reason)
                        continue
                    chunk = P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[P.ChatStreamChoice(
                        index=o.index, delta=P.DeltaMessage(content=o.delta_text), finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        logprobs=chat_logprobs(o.delta_token_ids, o.delta_logprobs, req.top_logprobs))])
                    if include_usage and continuous:
                        chunk.usage = self._choice_usage(len(out.prompt_token_ids), len(o.token_ids), out.num_cached_tokens,
                                                         out.num_cache_write_tokens)
                    yield sse_event(chat_chunk(chunk))
            if include_usage and last is not None:
                yield sse_event(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                                 usage=self._usage([last])).model_dump())
            if transfer:
                self.kv_transfer.finish(transfer, [last])
            yield "data: [DONE]\n\n"
        finally:
            admitted.abort()  # idempotent; covers a client that leaves between chunks

    # ----- shared -----

    async def _collect(self, admitted: _Admitted) -> list:
        finals: list = [None] * len(admitted.streams)
        async for i, out in _merge(admitted):
            finals[i] = out
        return finals

    @staticmethod
    def _choice_usage(prompt: int, completion: int, cached: int, written: int = 0) -> P.UsageInfo:
        """continuous_usage_stats: one choice's counts so far, as vLLM reports them per chunk."""
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached,
                                                                       cache_write_tokens=written))

    def _usage(self, finals: list) -> P.UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals)
        written = sum(o.num_cache_write_tokens for o in finals)
        attended = [c.num_attended_tokens for o in finals for c in o.outputs if c.num_attended_tokens is not None]
        extra = {"kv_attended_tokens": sum(attended)} if attended else {}
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached, cache_write_tokens=written),
                           **extra)


async def _merge(admitted: _Admitted) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, RequestOutput) from all of a call's streams as they arrive; leaving aborts all."""
    if len(admitted.streams) == 1:
        try:
            async for out in admitted.streams[0]:
                yield 0, out
        finally:
            admitted.abort()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(admitted.streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        admitted.abort()
