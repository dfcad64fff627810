"""OpenAI-compatible request/response models (pydantic), with vLLM's extra sampling fields.

Requests are strict (no "5" -> 5 coercion): a wrong type is the client's bug and gets a 400 naming
the field, as the OpenAI API does. Unknown fields are ignored, as vLLM does, so clients that send
newer OpenAI fields keep working. Range limits that do not depend on the loaded model live in the
schema (they show up in /openapi.json); limits that do (context length) are checked in serving.py.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # choices per request; each is a sequence in the batch


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI error object with `status`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers  # e.g. Retry-After on a 503

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class _Strict(BaseModel):
    # NaN / inf (Python's json reads them) are refused as such, not as "less than or equal to 2"
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(_Strict):
    """A request body. Unknown fields are kept (not an error, as in vLLM) so that the server can
    refuse the vLLM parameters it does not implement instead of silently ignoring them."""
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)  # int64, as vLLM
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM: score the prompt, top k per token (not streamed)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens (-1: max_model_len)
    # kvserve's: KV compression of this request (core/kv_compression.py), checked by SamplingParams
    kv_compression: dict | None = None
    # kvserve's: how long the blocks this request leaves in the prefix cache stay ahead of others
    # (core/cache_retention.py, {"priority": 0..100, "ttl_s": N}), checked by SamplingParams
    cache_retention: dict | None = None
    # vLLM's disaggregated prefill/decode handshake (server/kv_transfer.py)
    kv_transfer_params: dict | None = None


class CompletionRequest(_SamplingRequest):
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt alone (OpenAI, vLLM)
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# vLLM request parameters kvserve does not implement: a request that sets one (to anything but
# its off value) gets a 400 naming it, rather than a 200 whose output ignored it.
UNSUPPORTED_PARAMS = {
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                     "guided_whitespace_pattern", "structured_outputs", "whitespace_pattern"),
                    "structured output (guided decoding) is not implemented"),
    **dict.fromkeys(("use_beam_search", "length_penalty", "early_stopping"), "beam search is not implemented"),
    **dict.fromkeys(("allowed_token_ids", "bad_words", "logits_processors"),
                    "token masks and logits processors are not implemented"),
    **dict.fromkeys(("chat_template", "documents"), "the model's own chat template is always used"),
    **dict.fromkeys(("mm_processor_kwargs", "prompt_embeds", "multi_modal_data"), "only text models are served"),
    **dict.fromkeys(("vllm_xargs", "return_tokens_as_token_ids", "return_token_ids",
                     "functions", "function_call", "audio", "modalities", "prediction",
                     "web_search_options"), "not implemented by kvserve"),
}
# Their values that mean "not used" besides null / false / empty (clients that send every default).
OFF_VALUES = {"length_penalty": 1.0, "modalities": ["text"], "response_format": {"type": "text"}}
# What vllm-router (SGLang's gateway) adds to every body it forwards, at these values: they ask for
# what kvserve does anyway, so they are taken silently rather than logged as ignored on each request.
GATEWAY_DEFAULTS = {"no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True,
                    "stream_reasoning": True, "include_reasoning": True}
# /v1/completions: OpenAI chat fields that would constrain or route the output there too.
COMPLETION_REFUSED = {
    "response_format": "structured output (JSON mode, JSON schema) is not implemented; only plain text is generated",
    **dict.fromkeys(("tools", "tool_choice"), "tool calling is not implemented"),
    **dict.fromkeys(("semantic_cache", "semantic_cache_threshold", "semantic_cache_ttl"),
                    "the semantic cache serves chat completions (/v1/chat/completions) only"),
}
# (spaces_between_special_tokens and reasoning_effort change nothing for the fast tokenizers and
# chat templates kvserve serves: unknown to it, they are logged and ignored, as vLLM ignores them.)


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # refused unless empty: no tools are served


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (vLLM)
    parallel_tool_calls: bool | None = None  # OpenAI's default is sent by SDKs; no tools are served anyway
    # kvserve's semantic response cache (--semantic-cache): false bypasses it, true also lets a sampling
    # request use it; a threshold (cosine similarity) and a TTL (seconds) for this request
    semantic_cache: bool | None = None
    semantic_cache_threshold: float | None = None
    semantic_cache_ttl: float | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ----- responses -----

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (OpenAI's, vLLM's)
    cache_write_tokens: int = 0  # prompt tokens this request wrote to it (docs/serving.md: Usage)


class UsageInfo(BaseModel):
    # kvserve adds kv_attended_tokens for requests with kv_compression (absent otherwise)
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """vLLM's `Logprob` as its server sends it in `prompt_logprobs`."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: PromptLogprob} per token.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
