"""A model runner with no model: it returns deterministic tokens and an estimated step time.

It stands in for ModelRunner wherever scheduling and KV accounting are the subject — the
`kvserve simulate` what-if tool and the property-based scheduler tests — so the real Scheduler and
KVCacheManager run unchanged, with no weights loaded.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvserve.core.step import ModelRunnerOutput, SampledToken, SchedulerOutput


@dataclass
class StepCost:
    """Roofline-style step time: max(compute, memory) plus a fixed per-step overhead."""
    flops_per_token: float = 2 * 135e6  # 2 x parameters
    weight_bytes: float = 270e6  # bf16 SmolLM2-135M
    kv_bytes_per_token: float = 23040.0
    peak_flops: float = 2.2e12
    mem_bandwidth: float = 26e9
    step_overhead_s: float = 2e-3

    def step_time(self, num_batched_tokens: int, num_context_tokens: int) -> float:
        compute = num_batched_tokens * self.flops_per_token / self.peak_flops
        memory = (self.weight_bytes + num_context_tokens * self.kv_bytes_per_token) / self.mem_bandwidth
        return max(compute, memory) + self.step_overhead_s


class CostModelRunner:
    def __init__(self, vocab_size: int = 49152, cost: StepCost | None = None,
                 eos_token_id: int | None = None, eos_every: int = 0) -> None:
        self.vocab_size = vocab_size
        self.cost = cost or StepCost()
        self.eos_token_id = eos_token_id
        self.eos_every = eos_every  # emit EOS when hash % eos_every == 0 (0: never)
        self.elapsed_s = 0.0
        self.num_steps = 0

    def token_for(self, request_id: str, position: int) -> int:
        """Same (request, position) -> same token, so runs with different configs agree."""
        d = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
        h = int.from_bytes(d, "little")
        if self.eos_token_id is not None and self.eos_every and h % self.eos_every == 0:
            return self.eos_token_id
        return h % self.vocab_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        context = 0
        for entry in sched.scheduled:
            context += entry.start_pos + entry.num_new_tokens
            if entry.sample:
                req = entry.request
                out.sampled[req.request_id] = SampledToken(self.token_for(req.request_id, req.num_tokens))
        if sched.scheduled:
            self.elapsed_s += self.cost.step_time(sched.num_batched_tokens, context)
            self.num_steps += 1
        return out
