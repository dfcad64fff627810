"""What the engine returns: per-request outputs and an engine-wide stats snapshot."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.core.cache_retention import CacheRetention


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the limit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Logprob:
    """One token's log-probability, as vLLM's `vllm.logprobs.Logprob`: `rank` is its 1-based place
    in the vocabulary by probability, `decoded_token` its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token, as vLLM: the sampled token and the top `logprobs` alternatives, by id.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # The sum of the sampled tokens' logprobs; None unless the request asked for logprobs (vLLM).
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None
    # What this output adds to the previous one of the same request (streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None
    # With kv_compression: the tokens whose KV the sequence still held at its last step, what
    # attention covered once compression was in force (None without compression).
    num_attended_tokens: int | None = None

    def finished(self) -> bool:  # a method, as vLLM's
        return self.finish_reason is not None


class RequestProgress(NamedTuple):
    """A request that gained tokens in a step: what per-token metrics (TTFT, inter-token latency)
    need, without building its output (a FINAL_ONLY request has none until it finishes)."""
    request_id: str
    num_tokens: int  # output tokens so far, over all its sequences
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0  # see RequestOutput
    # The request's effective cache_retention (a tenant's default applied; None: the default):
    # for the request log, which `kvserve simulate` replays with it.
    cache_retention: CacheRetention | None = None
    max_tokens: int | None = None  # the request's max_tokens after defaulting / capping at the context

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # vLLM's: with SamplingParams.prompt_logprobs, None for the first prompt token, then per token
    # {token_id: Logprob} (the prompt token and the top prompt_logprobs alternatives).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Beside vLLM's num_cached_tokens (prompt tokens read from the prefix cache): prompt tokens
    # this request wrote to it, i.e. its full prompt blocks the cache did not hold before (with
    # n > 1, what all its sequences wrote). A partial last block is never a write.
    num_cache_write_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return self.metrics.time_to_first_token

    def merged_after(self, earlier: "RequestOutput") -> "RequestOutput":
        """This (cumulative) output with the deltas of an `earlier` one nobody read prepended: one
        output that says what both said."""
        before = {o.index: o for o in earlier.outputs}
        outputs = []
        for o in self.outputs:
            e = before.get(o.index)
            if e is not None:
                o = dataclasses.replace(
                    o, delta_text=e.delta_text + o.delta_text, delta_token_ids=e.delta_token_ids + o.delta_token_ids,
                    delta_logprobs=None if o.delta_logprobs is None else (e.delta_logprobs or []) + o.delta_logprobs)
            outputs.append(o)
        return dataclasses.replace(self, outputs=outputs)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    # LoRA adapters (names) of running and waiting requests (vllm:lora_requests_info)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    lora_slot_loads: int = 0  # adapters copied into a device slot (first loads and LRU swaps)
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    kv_usage: float = 0.0
    cached_usage: float = 0.0
    token_occupancy: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    resume_prefix_cache_queries: int = 0
    resume_prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_cached_block_evictions: int = 0
    # The same by the evicted block's retention class: expired, low, default, high (kv/block_pool.py)
    evictions_by_class: dict[str, int] = field(default_factory=dict)
    num_pinned_blocks: int = 0  # blocks held by pinned prefixes (POST /v1/cache/pins); part of num_blocks_used
    pinned_bytes: int = 0
    prompt_tokens_total: int = 0
    # Prompt tokens at first admission: from the prefix cache / to prefill (vllm:prompt_tokens_by_source)
    prompt_tokens_cached_total: int = 0
    prompt_tokens_computed_total: int = 0
    num_waiting_deferred: int = 0  # of num_waiting: passed over on purpose (Scheduler.num_waiting_deferred)
    generation_tokens_total: int = 0
    host_tier_usage: float = 0.0
    # Prompt tokens served by source: 'device' (pool) and each offload tier ('host', 'disk', 'redis').
    tier_hits: dict[str, int] = field(default_factory=dict)
    # Offload tiers, by tier name; counters are cumulative since start. Lookups count blocks.
    tier_usage: dict[str, float] = field(default_factory=dict)  # used / capacity (0 when unknown)
    tier_used_bytes: dict[str, int] = field(default_factory=dict)
    tier_lookup_hits: dict[str, int] = field(default_factory=dict)
    tier_misses: dict[str, int] = field(default_factory=dict)  # includes corrupt / incompatible
    tier_corrupt: dict[str, int] = field(default_factory=dict)  # bad checksum, truncated, not a block
    tier_incompatible: dict[str, int] = field(default_factory=dict)  # another engine fingerprint
    tier_errors: dict[str, int] = field(default_factory=dict)  # backend failures (I/O, Redis down)
    tier_token_mismatches: dict[str, int] = field(default_factory=dict)  # a block's hash, other tokens
    tier_bytes_read: dict[str, int] = field(default_factory=dict)
    tier_bytes_written: dict[str, int] = field(default_factory=dict)
    kv_restored_blocks: int = 0
    kv_restore_seconds: float = 0.0  # tier lookups + writes into the pool
    kv_offloaded_blocks: int = 0
    kv_offload_seconds: float = 0.0  # engine-thread time spent reading + packing evicted blocks
    kv_offload_dropped_blocks: int = 0  # the writer queue was full: those blocks were not kept
    # evicted blocks not written down: below --kv-offload-min-priority, or past their TTL
    kv_offload_below_priority_blocks: int = 0
    num_swapped_preemptions: int = 0  # preemptions whose KV went to the host tier
    # blocks released from running sequences, by policy: sliding_window, streaming, h2o, snapkv
    kv_released_blocks: dict[str, int] = field(default_factory=dict)
    num_swap_fallbacks: int = 0  # swap preemptions that recomputed: no room in the host tier
    num_steps: int = 0  # engine steps that ran a forward
    spec_decode_num_drafts: int = 0  # speculated request-steps (--speculative-config)
    spec_decode_num_draft_tokens: int = 0  # guesses fed to the model
    spec_decode_num_accepted_tokens: int = 0  # guesses the model agreed with (kept)
    last_step_tokens: int = 0  # tokens the latest of them computed (prefill chunks + decodes)


# Fractions that are means over the replicas rather than sums (the pool ones are recomputed).
_MEAN_FIELDS = ("host_tier_usage", "token_occupancy")


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Several data-parallel replicas' stats as one engine's: counts and byte totals summed, the
    pool's fractions recomputed over the summed pool, other fractions averaged."""
    if len(stats) == 1:
        return stats[0]
    total = EngineStats()
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if isinstance(values[0], dict):
            merged: dict = {}
            for v in values:
                for k, x in v.items():
                    merged[k] = merged.get(k, 0) + x
            if f.name == "tier_usage":
                merged = {k: x / len(values) for k, x in merged.items()}
            setattr(total, f.name, merged)
        elif isinstance(values[0], tuple):
            setattr(total, f.name, tuple(sorted({x for v in values for x in v})))
        elif f.name in _MEAN_FIELDS:
            setattr(total, f.name, sum(values) / len(values))
        else:
            setattr(total, f.name, sum(values))
    if total.num_blocks_total:
        total.kv_usage = total.num_blocks_used / total.num_blocks_total
        total.cached_usage = total.num_blocks_cached / total.num_blocks_total
    else:
        total.kv_usage = total.cached_usage = 0.0
    total.last_step_tokens = max(s.last_step_tokens for s in stats)
    return total
