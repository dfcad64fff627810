"""vLLM's logprobs fields of completions and chat, from the engine's Logprob entries."""
from __future__ import annotations

from kvserve.server import protocol as P

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _top(entry: dict, n: int) -> list[tuple[str, float]]:
    """(text, logprob) of the first n tokens of a vLLM-shaped logprobs entry: the sampled
    token, then the top-k by rank. vLLM's completions send n = k + 1, its chat n = k."""
    return [(lp.decoded_token, max(lp.logprob, LOGPROB_FLOOR)) for lp in list(entry.values())[:n]]



def echoed(req: P.CompletionRequest, out, echo: str, text: str, token_ids: list[int], entries
            ) -> tuple[str, list[int], list | None]:
    """echo: the prompt's text before the output's and, with logprobs, the prompt's tokens and
    logprobs (None for the first) before the output's; max_tokens 0 sends the prompt alone."""
    if not req.echo:
        return text, token_ids, entries
    if req.max_tokens == 0:
        text, token_ids, entries = "", [], None if entries is None else []
    if entries is None or out.prompt_logprobs is None:
        return echo + text, token_ids, entries
    return echo + text, list(out.prompt_token_ids) + list(token_ids), list(out.prompt_logprobs) + list(entries)



def prompt_logprobs(out) -> list | None:
    """vLLM's prompt_logprobs field: -inf clamped, as its server does."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {t: P.PromptLogprob(logprob=max(lp.logprob, LOGPROB_FLOOR), rank=lp.rank,
                                                       decoded_token=lp.decoded_token) for t, lp in e.items()}
            for e in out.prompt_logprobs]



def completion_logprobs(token_text, token_ids: list[int], entries, k: int | None,
                         start_offset: int) -> P.CompletionLogprobs | None:
    if entries is None:
        return None
    lp = P.CompletionLogprobs()
    offset = start_offset
    for tid, e in zip(token_ids, entries):
        text = token_text(tid) if e is None else e[tid].decoded_token
        lp.tokens.append(text)
        lp.token_logprobs.append(None if e is None else max(e[tid].logprob, LOGPROB_FLOOR))
        lp.text_offset.append(offset)
        offset += len(text)
        lp.top_logprobs.append(None if e is None else dict(_top(e, (k or 0) + 1)))
    return lp



def chat_logprobs(token_ids: list[int], entries, k: int | None) -> P.ChatLogprobs | None:
    if entries is None:
        return None
    content = []
    for tid, e in zip(token_ids, entries):
        text = e[tid].decoded_token
        top = [P.TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in _top(e, k or 0)]
        content.append(P.ChatTokenLogprob(token=text, logprob=max(e[tid].logprob, LOGPROB_FLOOR),
                                          bytes=list(text.encode()), top_logprobs=top))
    return P.ChatLogprobs(content=content)
