"""What the scheduler hands the model runner for one step, and what comes back.

Plain data: the scheduler fills it without touching tensors, the model runner reads it
without knowing the policy that produced it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.core.cache_retention import DEFAULT_PRIORITY
from kvserve.core.request import Request


class BlockCopy(NamedTuple):
    """Copy the K/V of the first `num_tokens` slots of block `src` into block `dst`
    (copy-on-write of a cached partial block). Runs before the step's forward pass."""
    src: int
    dst: int
    num_tokens: int


class BlockOffload(NamedTuple):
    """Copy block `block_id` down to the offload tiers under `key` before anything this step
    writes into it (it was just evicted or freed, and may already be handed to someone else).
    held=True: a swapped-out request's block, kept in host memory until the request resumes.
    `token_ids` (the block's tokens) are stored with it: a restore checks them, so a hash that
    collides can never bring back another prefix's K/V. `priority` and `expires` (wall-clock
    seconds, inf: none) are the block's retention, which orders what a full tier drops first."""
    block_id: int
    key: bytes
    token_ids: tuple[int, ...] = ()
    held: bool = False
    priority: int = DEFAULT_PRIORITY
    expires: float = math.inf


class BlockRestore(NamedTuple):
    """Write a block fetched from an offload tier into `block_id` before the forward. `data` is
    opaque here: the runner-side transfer decoded and checked it when the lookup hit."""
    block_id: int
    data: object
    tier: str
    stored_key: bytes | None = None  # its hash when read from a lower tier's storage (that tier holds it)


@dataclass
class ScheduledRequest:
    request: Request  # read-only for the runner: token ids, sampling params
    start_pos: int  # == request.num_computed_tokens before this step
    num_new_tokens: int  # tokens request.all_token_ids[start_pos:start_pos+num_new_tokens]
    block_table: list[int]  # covers at least start_pos + num_new_tokens slots
    sample: bool  # this chunk ends at the last known token: sample the next one
    # Speculative decoding: guessed tokens after the last known one, the last len(spec_token_ids)
    # of the num_new_tokens (sched/spec_decode.py). The runner returns the greedy token at each.
    spec_token_ids: list[int] = field(default_factory=list)
    # Positions missing from block_table (released by a sliding window or KV compression), all
    # before the new tokens: those sit at table position start_pos - num_released_tokens onward
    # and keep their rotary positions from start_pos.
    num_released_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[self.start_pos:self.start_pos + known] + self.spec_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Requests that left since the previous step: the runner drops per-request state (generators).
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Offload tiers. Order in the step: offload reads first (the ids may be reused this step),
    # then restores, then block_copies, then the forward (see kvserve.cache.offload).
    # A copy source is never a restore target: the manager pins it while it schedules.
    kv_offloads: list[BlockOffload] = field(default_factory=list)
    kv_restores: list[BlockRestore] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SampledToken(NamedTuple):
    token_id: int
    logprob: float | None = None  # log-probability of token_id (when logprobs were requested)
    top_logprobs: dict[int, float] | None = None  # top-k alternatives, best first (when logprobs > 0)
    rank: int | None = None  # token_id's 1-based place in the vocabulary by logprob (with logprobs)


class PromptLogprobs(NamedTuple):
    """Logprobs of prompt tokens [start, start + n) given the tokens before each (positions >= 1)."""
    start: int
    logprobs: list[float]  # of the prompt token at each position
    ranks: list[int]
    top: list[dict[int, float]]  # top-k alternatives per position, best first (empty when k = 0)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # sample=True entries without guesses
    # Entries with spec_token_ids: the greedy token at each of their positions (1 + guesses).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # requests that ask
    # h2o: attention each block of the entry's block table received this step, summed over
    # layers, heads and the step's queries (only for requests that ask for it).
    kv_block_scores: dict[str, list[float]] = field(default_factory=dict)
