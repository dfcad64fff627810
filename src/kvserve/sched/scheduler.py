"""Scheduler: iteration-level continuous batching with chunked prefill and preemption.

Each step spends a token budget (`max_num_batched_tokens`) first on running requests — a decode
costs one token, an unfinished prefill its next chunk — then admits waiting requests in policy
order. When the KV pool runs out of blocks, running requests are preempted (all blocks freed,
requeued at the front, resumed by prefill, which hits the prefix cache for whatever survived).
Victim: the lowest priority first, then the one that loses the least computed work. With
preemption_mode="swap" the victim's blocks are first copied to the host tier and restored on
resume; when the host tier has no room the preemption recomputes instead.

No tensors here: the same class drives the real model runner, the cost-model simulator and the
property-based tests.
"""
from __future__ import annotations

import logging
from collections import deque

from kvserve.config import SchedulerConfig
from kvserve.core.request import Request, RequestStatus
from kvserve.core.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.spec_decode import NgramProposer, speculation_allowed

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # since the last schedule(), for the runner
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions whose blocks went to the host tier
        # Prompt tokens at first admission (one sequence per request, as vllm:prompt_tokens counts):
        # served from the prefix cache (vLLM's cached_tokens) and left to prefill.
        self.num_cached_prompt_tokens = self.num_computed_prompt_tokens = 0
        # Waiting requests the last schedule() passed over on purpose (vLLM's "deferred" reason):
        # an n > 1 sequence until the first one's prompt is cached, a request whose next block
        # another request is computing this step. The rest wait for capacity.
        self.num_waiting_deferred = 0
        self.proposer = NgramProposer(config.speculative_config) if config.speculative_config else None
        # vLLM's spec_decode counters: steps that carried guesses, guesses, guesses kept
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    # -- queue management -----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (abort, or a stop found by the detokenizer) and free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.forget(req)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        self._finished_ids.append(request_id)
        return req

    def preempt_request(self, request_id: str) -> bool:
        """Preempt a running request now (operators and tests); False if it is not running."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return False
        self.running.remove(req)
        self._preempt(req, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        budget = cfg.max_num_batched_tokens
        self.num_waiting_deferred = 0

        if cfg.scheduling_policy == "priority":
            self._preempt_for_priority(out)
        # Preemptions for a more urgent waiting request still let it in this step; preemptions
        # for lack of room among running requests mean there is no room to admit anyone.
        num_priority_preemptions = len(out.preempted_req_ids)
        # Victims are taken from the end, which is scheduled last.
        self.running.sort(key=self._keep_order)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._draft(req, budget) if n == 1 and self.proposer is not None else []
            if draft and self.kv.allocate_slots(req, n + len(draft)):
                n += len(draft)
            else:
                draft = []  # guesses never cost another request its blocks
                while not self.kv.allocate_slots(req, n):
                    victim = self.running.pop()
                    self._preempt(victim, out)
                    if victim is req:
                        break
            if req.status != RequestStatus.RUNNING:
                break
            out.scheduled.append(self._entry(req, n, draft))
            budget -= n
            i += 1

        if len(out.preempted_req_ids) == num_priority_preemptions:
            budget = self._admit_waiting(out, budget)
        out.block_copies = self.kv.take_copies()
        out.kv_offloads, out.kv_restores = self.kv.take_transfers()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        cfg = self.config
        # In-step prefix sharing (SGLang's in-batch prefix caching): a request whose next block is
        # being computed this step by another request waits one step and then hits it, instead of
        # computing the same KV twice (64 requests arriving with one uncached 1,024-token prefix:
        # the second would otherwise recompute it beside the first).
        pending = self._blocks_completed_by(out.scheduled) if self.kv.enable_caching else None
        # A step's adapters must fit the runner's --max-loras slots: a request of another
        # adapter waits until one of the running adapters has no request left (as vLLM).
        loras = {r.lora_id for r in self.running if r.lora_id is not None} if cfg.max_loras else None
        for req in self._waiting_in_policy_order():
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if (loras is not None and req.lora_id is not None and req.lora_id not in loras
                    and len(loras) >= cfg.max_loras):
                continue
            if req.parent_id is not None and not self._parent_prompt_cached(req):
                self.num_waiting_deferred += 1
                continue  # n > 1: wait for the first sequence's prompt to reach the cache
            hit = self.kv.get_computed_blocks(req)
            if pending and self._next_block_pending(req, hit.num_tokens, pending):
                self.num_waiting_deferred += 1
                continue
            n = req.num_tokens - hit.num_tokens
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = min(hit.num_tokens, req.num_prompt_tokens)
                if req.parent_id is None:  # n > 1: the other sequences reuse the first one's prompt
                    self.num_cached_prompt_tokens += req.num_cached_tokens
                    self.num_computed_prompt_tokens += req.num_prompt_tokens - req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if loras is not None and req.lora_id is not None:
                loras.add(req.lora_id)
            out.scheduled.append(self._entry(req, n))
            if pending is not None:
                pending |= self._blocks_completed_by(out.scheduled[-1:])
            budget -= n
        return budget

    def _blocks_completed_by(self, entries: list[ScheduledRequest]) -> set[bytes]:
        """Hashes of the prompt blocks these scheduled chunks fill (committed after the step)."""
        bs = self.kv.block_size
        done: set[bytes] = set()
        for e in entries:
            if e.num_new_tokens > 1 and not e.spec_token_ids:  # decodes fill blocks of generated text: not shareable yet
                done.update(e.request.block_hashes[e.start_pos // bs:(e.start_pos + e.num_new_tokens) // bs])
        return done

    def _next_block_pending(self, req: Request, hit_tokens: int, pending: set[bytes]) -> bool:
        bs = self.kv.block_size
        i = hit_tokens // bs
        return (i + 1) * bs < req.num_tokens and i < len(req.block_hashes) and req.block_hashes[i] in pending

    def _waiting_in_policy_order(self) -> list[Request]:
        cfg = self.config
        if cfg.scheduling_policy == "priority":
            order = sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        else:
            order = list(self.waiting)
        if cfg.cache_aware_scheduling and len(order) > 1 and self.kv.enable_caching:
            window = order[:cfg.cache_aware_window]
            # Device pool only: ranking must not read disk / Redis for a whole window.
            hits = {r.request_id: self.kv.get_computed_blocks(r, use_tiers=False).num_tokens for r in window}
            # Stable: among equal hits (and for priority, equal priority) arrival order stands.
            key = (lambda r: (r.priority, -hits[r.request_id])) if cfg.scheduling_policy == "priority" \
                else (lambda r: -hits[r.request_id])
            order = sorted(window, key=key) + order[cfg.cache_aware_window:]
        return order

    def _parent_prompt_cached(self, req: Request) -> bool:
        parent = self.requests.get(req.parent_id)
        return parent is None or parent.num_computed_tokens >= parent.num_prompt_tokens

    @staticmethod
    def _keep_order(req: Request) -> tuple:
        # Most worth keeping first: highest priority, then most computed work, then oldest.
        return (req.priority, -req.num_computed_tokens, req.arrival_time)

    def _entry(self, req: Request, n: int, draft: list[int] | None = None) -> ScheduledRequest:
        draft = draft or []
        return ScheduledRequest(request=req, start_pos=req.num_computed_tokens, num_new_tokens=n,
                                block_table=self.kv.block_table(req),
                                sample=req.num_computed_tokens + n - len(draft) == req.num_tokens,
                                spec_token_ids=draft, num_released_tokens=self.kv.released_tokens(req))

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Guesses for a decoding request's next tokens: no more than the step's budget, its
        max_tokens or max_model_len leave room for besides the token the step samples anyway."""
        p = req.sampling_params
        if not speculation_allowed(p, req.num_output_tokens):
            return []
        room = min(budget, self.config.max_model_len - req.num_tokens) - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return self.proposer.propose(req, room) if room > 0 else []

    def _preempt(self, req: Request, out: SchedulerOutput | None) -> None:
        num_blocks = len(self.kv.req_blocks.get(req.request_id, ()))
        swapped = self.config.preemption_mode == "swap" and self.kv.swap_out(req)
        self.num_swaps += swapped
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if out is not None:
            out.preempted_req_ids.append(req.request_id)
        logger.debug("preempted request %s (%s), freed %d blocks", req.request_id,
                     "swap" if swapped else "recompute", num_blocks)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Make room for the most urgent waiting request by preempting strictly less urgent
        running ones, while that is what stands in its way."""
        if not self.waiting or not self.running:
            return
        head = min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        hit = self.kv.get_computed_blocks(head)
        chunk = min(head.num_tokens - hit.num_tokens, self.config.max_num_batched_tokens)
        while self.running and not self.kv.can_allocate(head, chunk, hit):
            worst = max(self.running, key=lambda r: (r.priority, -r.num_computed_tokens))
            if worst.priority <= head.priority:
                return
            self.running.remove(worst)
            self._preempt(worst, out)
            hit = self.kv.get_computed_blocks(head)

    # -- after the step -------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply token-level stop rules.
        Returns the requests that got a new token (finished ones included)."""
        touched: list[Request] = []
        for entry in sched.scheduled:
            req = entry.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if entry.spec_token_ids:
                self._verify(entry, result.spec_tokens[req.request_id])
                touched.append(req)
                continue
            req.num_computed_tokens += entry.num_new_tokens
            scores = result.kv_block_scores.get(req.request_id) if result.kv_block_scores else None
            if scores is not None:
                self.kv.add_scores(req, scores)
            self.kv.commit(req)
            if not entry.sample:
                continue
            tok = result.sampled[req.request_id]
            req.append_output_token(tok.token_id)
            touched.append(req)
            status = self._check_stop(req, tok.token_id)
            if status is not None:
                self.finish_request(req.request_id, status)
        return touched

    def _verify(self, entry: ScheduledRequest, greedy: list[int]) -> None:
        """Keep the guesses the model agrees with, then its own token after them; stop rules
        apply token by token, so a stop among them ends the output there as without guesses."""
        req, draft = entry.request, entry.spec_token_ids
        accepted = 0
        while accepted < len(draft) and greedy[accepted] == draft[accepted]:
            accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        status = None
        appended = 0
        for tok in greedy[:accepted + 1]:
            req.append_output_token(tok)
            appended += 1
            status = self._check_stop(req, tok)
            if status is not None:
                break
        # The K/V written is right for the last known token and the guesses kept, one per token
        # appended but the last (the rest is overwritten next step).
        req.num_computed_tokens = entry.start_pos + appended
        self.kv.commit(req)
        if status is not None:
            self.finish_request(req.request_id, status)

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
