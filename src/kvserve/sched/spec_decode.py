"""Speculative decoding with an n-gram ("prompt lookup") proposer, as vLLM's `--speculative-config
'{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}'`.

Why: a decode step reads every sequence's whole K/V and every weight to produce one token each.
When the text repeats itself (code edits, summaries quoting their source, extraction, and small
models looping under greedy decoding), the tokens that followed the last n tokens the previous
time they appeared are a good guess for what comes next. A step then feeds the last token plus K
guesses; the K/V is read once for all of them, and the target model's own greedy choice at each
position says how many guesses to keep (all those that match, plus the model's token after the
last match). The output is the greedy output; only the number of steps changes.

Scope: requests that decode greedily with no logprobs, penalties, min_tokens ban or stop strings
(their next-token rule would depend on the guesses). Others in the same batch decode as before.

No tensors here: the scheduler proposes and verifies, the model runner only returns the greedy
token at every position of a speculated request.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import SpeculativeConfig
from kvserve.core.request import Request
from kvserve.core.sampling_params import GREEDY_EPS, SamplingParams


def speculation_allowed(p: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the next token of a request with these parameters is the plain argmax of the
    logits at every position, so that guesses can be checked against it."""
    return (p.temperature < GREEDY_EPS and p.logprobs is None and not p.stop
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and num_output_tokens >= p.min_tokens)


@dataclass
class _Index:
    """One request's n-gram tables (one per n, largest first): n tokens -> where the tokens after
    their latest occurrence start; `length`: how many of its tokens they cover."""
    length: int
    tables: list[dict[tuple, int]]


class NgramProposer:
    """The tokens that followed the latest earlier occurrence of a request's last n tokens, for
    the longest n in [prompt_lookup_min, prompt_lookup_max] that occurred before; where fewer than
    K tokens follow it (a loop shorter than K), the loop continued.

    Per request, a table per n maps each n-gram to where its latest continuation starts; it is
    extended by the tokens appended since the last call, so a step costs O(new tokens x n), not
    a scan of the whole history (64 requests of ~400 tokens: a scan in Python took ~10 ms a step)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._index: dict[str, _Index] = {}

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to min(K, max_tokens) guesses for the tokens after req.all_token_ids."""
        k = min(self.k, max_tokens)
        if k <= 0:
            return []
        tokens = req.all_token_ids
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = _Index(0, [{} for _ in self.sizes])
        # n-grams ending before position j, recorded once token j exists (so each has a continuation)
        for j in range(max(index.length, 1), len(tokens)):
            for n, table in zip(self.sizes, index.tables):
                if j >= n:
                    table[tuple(tokens[j - n:j])] = j
        index.length = end = len(tokens)  # a request's tokens only grow (preemption keeps them)
        for n, table in zip(self.sizes, index.tables):
            if end >= n:
                start = table.get(tuple(tokens[end - n:]))
                if start is not None:
                    draft = tokens[start:start + k]
                    # The match is end - start tokens back: a shorter loop than K is guessed to go
                    # on with the same period (a token repeated: K copies, not one).
                    while len(draft) < k:
                        draft.append(draft[len(draft) - (end - start)])
                    return draft
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
