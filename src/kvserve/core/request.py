"""A request's state as the scheduler and KV cache manager see it (token ids only, no tensors)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, resumes by recompute (or swap-in)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the `priority` policy
    cache_salt: str | None = None  # tenant isolation: part of every block hash of this request
    lora_id: str | None = None
    # n > 1: children wait until this request's prompt is in the cache, then share its blocks.
    parent_id: str | None = None
    # Prompt logprobs need the logits of every prompt position: no prefix-cache reads until they
    # are all computed (a swap-in still resumes; its positions were computed before).
    skip_prefix_cache: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt + output; tokens [0, num_computed_tokens) have their K/V in the cache.
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when first scheduled (-1 until then).
    num_cached_tokens: int = -1
    # Prompt tokens this request wrote to the prefix cache: its full prompt blocks whose chain
    # hash the device pool's index did not hold until this request committed them (a block it
    # read from the cache or restored from a tier is not a write).
    num_cache_write_tokens: int = 0
    num_preemptions: int = 0
    # Set by the KV cache manager: chain hashes of this request's full blocks, in order.
    block_hashes: list[bytes] = field(default_factory=list)
    # Set by the KV cache manager: positions whose blocks left the block table (sliding window,
    # KV compression); the tokens computed next attend to num_computed_tokens - this many.
    num_released_tokens: int = 0

    # Timing for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
