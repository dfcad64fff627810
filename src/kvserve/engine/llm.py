"""Offline API, as vLLM's:

    from kvserve import LLM, SamplingParams
    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
import random
from typing import Sequence

from kvserve.config import ConfigError, EngineArgs, vllm_only_args
from kvserve.core.lora import LoRARequest
from kvserve.core.sampling_params import RequestOutputKind, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestError, RequestOutput

# As vLLM: a string, token ids, or its TextPrompt / TokensPrompt dicts.
Prompt = str | list[int] | dict
Message = dict[str, str]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _prompt_input(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """vLLM's `{"prompt": text}` and `{"prompt_token_ids": ids}` (each with an optional
    `cache_salt`, vLLM's too) to what the engine takes: the prompt and its cache salt."""
    if not isinstance(prompt, dict):
        return prompt, None
    given = [k for k in _PROMPT_KEYS if k in prompt]
    other = sorted(set(prompt) - {*_PROMPT_KEYS, "cache_salt"})
    if other:
        raise RequestError(f"prompt dict keys {other} are not supported; give 'prompt' (text) or "
                           f"'prompt_token_ids', and optionally 'cache_salt'", "prompt")
    if len(given) != 1:
        raise RequestError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'",
                           "prompt")
    value = prompt[given[0]]
    if given[0] == "prompt_token_ids" and isinstance(value, str):
        raise RequestError("prompt_token_ids is a string; give token ids (apply_chat_template returns them "
                           "unless tokenize=False), or the text as 'prompt'", "prompt")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError(f"cache_salt must be a non-empty string (got {salt!r})", "cache_salt")
    return value, salt


# vLLM's dtype spellings beyond EngineArgs' (which takes auto / float32 / bfloat16 / float16).
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}


def _engine_args(model: str | None, kwargs: dict) -> EngineArgs:
    kwargs = dict(kwargs)
    if "kv_cache_memory_bytes" in kwargs:  # vLLM's name for the KV budget in bytes
        if "kv_cache_memory" in kwargs:
            raise TypeError("LLM() got both kv_cache_memory and kv_cache_memory_bytes; they are the same budget, "
                            "give one")
        kwargs["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
    for name in vllm_only_args({k: v for k, v in kwargs.items() if k not in EngineArgs.field_names()}):
        del kwargs[name]
    unknown = set(kwargs) - set(EngineArgs.field_names())
    if unknown:
        raise TypeError(f"LLM() got unknown engine arguments {sorted(unknown)}; "
                        f"valid ones are the fields of kvserve.EngineArgs")
    dtype = kwargs.get("dtype")
    if dtype is not None and not isinstance(dtype, str):  # torch.float16 and friends
        dtype = str(dtype).removeprefix("torch.")
    if dtype is not None:
        kwargs["dtype"] = _DTYPE_ALIASES.get(dtype, dtype)
    if "seed" in kwargs and kwargs["seed"] is None:  # vLLM: no fixed seed
        kwargs["seed"] = random.SystemRandom().randrange(2**31)
    return EngineArgs(model=model, **kwargs)


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        """`engine_kwargs` are kvserve.EngineArgs fields (vLLM's names); vLLM arguments with
        nothing to do here (trust_remote_code, tensor_parallel_size=1, ...) are
        accepted, and those kvserve does not implement refused with the reason."""
        args = _engine_args(model, engine_kwargs)
        if args.data_parallel_size > 1:
            raise ConfigError(f"data_parallel_size={args.data_parallel_size}: offline LLM runs one engine in this "
                              "process; serve several replicas with `kvserve serve --data-parallel-size N`")
        self.engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:  # vLLM's name
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` samples with: vLLM's defaults, overridden (unless
        generation_config="vllm") by the model's generation_config.json, as vLLM does."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Prompts as strings, token-id lists or vLLM's prompt dicts; results in the order given.
        `lora_request`: one adapter for every prompt, or a list of one per prompt (None: the base model)."""
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of "
                            f"those; got {type(prompts).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) \
            else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if any(not isinstance(p, SamplingParams) for p in params):
            bad = next(p for p in params if not isinstance(p, SamplingParams))
            raise TypeError(f"sampling_params must be SamplingParams (or a list of them), got "
                            f"{type(bad).__name__}; e.g. SamplingParams(max_tokens=16)")
        # Only the finished outputs are returned, so only those are made (vLLM does the same);
        # the caller's objects stay as they were.
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
            if any(priority) and self.engine.args.scheduling_policy != "priority":  # as vLLM: 0 is no priority
                raise ValueError(f"got priority {next(p for p in priority if p)} but the scheduling policy is "
                                 f"fcfs; create the LLM with scheduling_policy='priority'")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests; give one LoRARequest, "
                             f"or a list of one (or None) per prompt")
        ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            try:
                text_or_ids, salt = _prompt_input(prompt)
                self.engine.add_request(rid, text_or_ids, p, priority=priority[i] if priority else 0, cache_salt=salt,
                                        lora_request=loras[i])
            except RequestError as e:
                # All or nothing, as vLLM: the call's requests added so far must not stay queued.
                self.engine.abort_request(ids)
                where = f"prompt {i} of {len(prompts)}: " if len(prompts) > 1 else ""
                raise RequestError(f"{where}{e}", e.param) from e
            except BaseException:
                self.engine.abort_request(ids)
                raise
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: each conversation rendered with the model's chat template."""
        if chat_template is not None:
            raise ValueError("chat_template: custom chat templates are not implemented; the model's own is used")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, **(chat_template_kwargs or {})) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine stopped with requests unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
