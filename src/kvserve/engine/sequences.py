"""A request's n output sequences as the engine tracks them, and the RequestOutput built from them.

n > 1 runs as n scheduler requests; a SequenceGroup ties them back to the one request the caller
made, and `build_output` turns the group's state into vLLM's RequestOutput (cumulative, delta or
final-only; or deltas only, when a front end rebuilds the cumulative view itself).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvserve.core.kv_compression import active as active_compression
from kvserve.core.request import Request
from kvserve.core.sampling_params import RequestOutputKind
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestProgress


@dataclass
class Sequence:
    """One of a request's n output sequences."""
    req: Request
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    reported_finish: bool = False
    # vLLM's prompt_logprobs (sequence 0 only): None for the first token, then one dict per token
    # as the prefill chunks compute them; `prompt_scored` counts the filled positions.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_scored: int = 0


@dataclass
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prompt_logprobs_sent: bool = False  # send_deltas: the complete prompt logprobs went out once


def logprobs_entry(text: Callable[[int], str], token_id: int, logprob: float, rank: int | None,
                   top: dict[int, float] | None) -> dict[int, Logprob]:
    """vLLM's per-token dict: the token itself first, then the top-k (best first) by rank."""
    entry = {token_id: Logprob(logprob, rank, text(token_id))}
    for r, (t, lp) in enumerate((top or {}).items(), start=1):
        entry.setdefault(t, Logprob(lp, r, text(t)))
    return entry


def progress(group: SequenceGroup) -> RequestProgress:
    if len(group.seqs) == 1:
        r = group.seqs[0].req
        return RequestProgress(group.request_id, r.num_output_tokens, group.arrival_time,
                               r.first_token_time, r.last_token_time)
    firsts = [s.req.first_token_time for s in group.seqs if s.req.first_token_time is not None]
    lasts = [s.req.last_token_time for s in group.seqs if s.req.last_token_time is not None]
    return RequestProgress(group.request_id, sum(s.req.num_output_tokens for s in group.seqs),
                           group.arrival_time, min(firsts, default=None), max(lasts, default=None))


def _metrics(group: SequenceGroup, done: bool) -> RequestMetrics:
    seqs = group.seqs
    first = seqs[0].req
    return RequestMetrics(
        arrival_time=group.arrival_time,
        first_scheduled_time=min((s.req.first_scheduled_time for s in seqs
                                  if s.req.first_scheduled_time is not None), default=None),
        first_token_time=min((s.req.first_token_time for s in seqs if s.req.first_token_time is not None),
                             default=None),
        last_token_time=max((s.req.last_token_time for s in seqs if s.req.last_token_time is not None),
                            default=None),
        finished_time=time.monotonic() if done else None,
        num_cached_tokens=max(first.num_cached_tokens, 0), max_tokens=first.sampling_params.max_tokens,
        num_cache_write_tokens=sum(s.req.num_cache_write_tokens for s in seqs),
        cache_retention=first.sampling_params.cache_retention)


def build_output(group: SequenceGroup, deltas_only: bool) -> RequestOutput:
    """The group's output now; takes the sequences' new tokens and logprobs (they are sent once).

    deltas_only: text, token ids and logprobs are left out (the front end rebuilds them from the
    deltas), and the prompt logprobs go out once, the first time they are complete."""
    outputs = []
    # DELTA (vLLM's): text, token_ids and logprobs hold only what is new since the last output.
    delta_kind = group.output_kind == RequestOutputKind.DELTA
    for s in group.seqs:
        r = s.req
        finished = r.is_finished
        delta = s.detok.take_delta(finished)
        with_lp = s.logprobs is not None
        outputs.append(CompletionOutput(
            index=s.index, text=None if deltas_only else delta if delta_kind else s.detok.emitted_text,
            token_ids=None if deltas_only else list(s.new_token_ids) if delta_kind else list(r.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if with_lp else None,
            logprobs=None if deltas_only or not with_lp else list(s.new_logprobs) if delta_kind else list(s.logprobs),
            finish_reason=r.status.finish_reason, stop_reason=r.stop_reason,
            delta_text=delta, delta_token_ids=s.new_token_ids,
            delta_logprobs=s.new_logprobs if with_lp else None,
            num_attended_tokens=(r.num_computed_tokens - r.num_released_tokens
                                 if active_compression(r.sampling_params.kv_compression) else None)))
        s.new_token_ids = []
        s.new_logprobs = []
    done = all(s.req.is_finished for s in group.seqs)
    metrics = _metrics(group, done)
    first_seq = group.seqs[0]
    prompt_lps = first_seq.prompt_logprobs
    if prompt_lps is not None and first_seq.prompt_scored < len(prompt_lps) - 1:
        prompt_lps = None  # still being computed (an abort mid-prefill ends here too)
    if deltas_only:
        if group.prompt_logprobs_sent:
            prompt_lps = None
        elif prompt_lps is not None:
            group.prompt_logprobs_sent = True
        return RequestOutput(group.request_id, None, None, outputs, done, metrics.num_cached_tokens, metrics,
                             prompt_logprobs=prompt_lps, num_cache_write_tokens=metrics.num_cache_write_tokens)
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, done,
                         metrics.num_cached_tokens, metrics, prompt_logprobs=prompt_lps,
                         num_cache_write_tokens=metrics.num_cache_write_tokens)
