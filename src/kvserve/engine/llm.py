"""Offline API, as vLLM's:

    from kvserve import LLM, SamplingParams
    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
"""
from __future__ import annotations

import itertools
from typing import Sequence

from kvserve.config import EngineArgs
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestError, RequestOutput
from kvserve.engine.sampling_params import SamplingParams

# As vLLM: a string, token ids, or its TextPrompt / TokensPrompt dicts.
Prompt = str | list[int] | dict
Message = dict[str, str]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _prompt_input(prompt: Prompt) -> str | list[int]:
    """vLLM's `{"prompt": text}` and `{"prompt_token_ids": ids}` to what the engine takes."""
    if not isinstance(prompt, dict):
        return prompt
    given = [k for k in _PROMPT_KEYS if k in prompt]
    other = sorted(set(prompt) - set(_PROMPT_KEYS))
    if other:
        raise RequestError(f"prompt dict keys {other} are not supported; give 'prompt' (text) or "
                           f"'prompt_token_ids'", "prompt")
    if len(given) != 1:
        raise RequestError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'",
                           "prompt")
    return prompt[given[0]]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        unknown = set(engine_kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {sorted(unknown)}; "
                            f"valid ones are the fields of kvserve.EngineArgs")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Prompts as strings, token-id lists or vLLM's prompt dicts; results in the order given."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) \
            else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            try:
                self.engine.add_request(rid, _prompt_input(prompt), p, priority=priority[i] if priority else 0)
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
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt),
            add_special_tokens=False) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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
