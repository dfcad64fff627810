"""What the scheduler hands the model runner for one step, and what comes back.

Plain data: the scheduler fills it without touching tensors, the model runner reads it
without knowing the policy that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.engine.request import Request


class BlockCopy(NamedTuple):
    """Copy the K/V of the first `num_tokens` slots of block `src` into block `dst`
    (copy-on-write of a cached partial block). Runs before the step's forward pass."""
    src: int
    dst: int
    num_tokens: int


@dataclass
class ScheduledRequest:
    request: Request  # read-only for the runner: token ids, sampling params
    start_pos: int  # == request.num_computed_tokens before this step
    num_new_tokens: int  # tokens request.all_token_ids[start_pos:start_pos+num_new_tokens]
    block_table: list[int]  # covers at least start_pos + num_new_tokens slots
    sample: bool  # this chunk ends at the last known token: sample the next one

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start_pos:self.start_pos + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Requests that left since the previous step: the runner drops per-request state (generators).
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SampledToken(NamedTuple):
    token_id: int
    logprob: float | None = None  # log-probability of token_id (when logprobs were requested)
    top_logprobs: dict[int, float] | None = None  # top-k alternatives (when logprobs > 0)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # only for sample=True entries
