"""ModelRunner: one SchedulerOutput -> forward over the paged KV cache -> sample -> ModelRunnerOutput.

Owns the model, the KV cache tensors and the sampler; knows nothing of scheduling policy. The
scheduler decides which tokens run and which blocks hold them; the runner only turns that into
tensors (vectorised: numpy over the step's sequences, never a Python loop per token).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvserve.attention.base import AttentionMetadata, build_attention_metadata
from kvserve.attention.selector import select_attention_backend
from kvserve.cache.factory import create_kv_cache
from kvserve.cache.quantizers import KVScales
from kvserve.config import ModelConfig
from kvserve.core.kv_compression import active
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.step import ModelRunnerOutput, PromptLogprobs, ScheduledRequest, SchedulerOutput
from kvserve.kv.compression import method_for
from kvserve.model.llama import LlamaModel
from kvserve.ops.host_alloc import tune_malloc_for_inference
from kvserve.runner.cuda_graph import DecodeGraphs, graphs_unsupported
from kvserve.runner.lora import LoRAManager
from kvserve.runner.sampler import Sampler, SamplingRow, row_argmax, token_logprobs

logger = logging.getLogger(__name__)

# Rows of prompt logits computed at a time for prompt logprobs: 256 x 49,152 float32 is 50 MB.
PROMPT_LOGITS_ROWS = 256


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner builds from, under EngineArgs' names where the engine has a flag for it."""
    dtype: torch.dtype  # the model's compute dtype (--dtype, resolved)
    device: torch.device
    block_size: int
    num_blocks: int  # the KV pool, sized by runner/build.py
    kv_cache_dtype: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    disable_cascade_attn: bool = False
    # Decode batch sizes captured as CUDA graphs (empty: always eager), their block tables
    # max_model_len tokens wide.
    cuda_graph_sizes: tuple[int, ...] = ()
    max_model_len: int | None = None
    # Quantized caches: the full-precision residual pool's entries (one open block per running
    # sequence), and the checkpoint's static fp8 scales when it ships them.
    num_residual_blocks: int | None = None
    kv_scales: KVScales | None = None
    # LoRA (--enable-lora): adapter slots of max_lora_rank preallocated for max_loras adapters
    # (0: no LoRA), max_cpu_loras kept in host memory, in lora_dtype (None: the model's dtype).
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: torch.dtype | None = None
    # A tensor-parallel rank: (the whole model's config, rank, size), by which adapters are split.
    lora_shard: tuple | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor], config: RunnerConfig,
                 weight_codes: dict | None = None) -> None:
        """`weight_codes`: a GGUF checkpoint's Q4_1 / Q8_0 matrices kept as codes (model/weight_codes.py)."""
        self.model_config = model_config
        self.config = config
        self.dtype = config.dtype
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        if self.device.type == "cpu":
            tune_malloc_for_inference()
        backend = select_attention_backend(config.attention_backend, model_config, self.device,
                                           cascade=not config.disable_cascade_attn)
        self.model = LlamaModel(model_config, weights, self.dtype, self.device, attention_backend=backend,
                                weight_codes=weight_codes)
        options: dict = {}
        if config.kv_cache_dtype != "auto":
            options = {"num_residual_blocks": config.num_residual_blocks, "seal_at_step_end": True}
            if config.kv_scales is not None:
                options["kv_scales"] = config.kv_scales
        self.kv_cache = create_kv_cache(model_config, num_blocks=self.num_blocks, block_size=self.block_size,
                                        kv_cache_dtype=config.kv_cache_dtype, dtype=self.dtype, device=self.device,
                                        layout=backend.kv_cache_layout(config.kv_cache_dtype, self.dtype,
                                                                       self.block_size, self.device),
                                        **options)
        self.bytes_per_block: int = self.kv_cache.bytes_per_block(model_config, self.block_size,
                                                                  config.kv_cache_dtype, self.dtype)
        self.sampler = Sampler(config.seed, self.device)
        self.lora: LoRAManager | None = None
        if config.max_loras:
            from kvserve.model.lora import packing_kernels
            layer = self.model.layers[0]  # its epilogues' column orders, which the deltas follow
            orders = {"qkv": layer.qkv_proj.order if layer.qkv_proj.epilogue else None,
                      "gate_up": layer.gate_up_proj.order if layer.gate_up_proj.epilogue else None}
            lora_dtype = config.lora_dtype or self.dtype
            self.lora = LoRAManager(model_config, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, lora_dtype, self.device, orders,
                                    packing_kernels(model_config, self.dtype, lora_dtype, self.device),
                                    shard=config.lora_shard)
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graph_sizes:
            self.capture_graphs(list(config.cuda_graph_sizes),
                                config.max_model_len or model_config.max_position_embeddings)

    def capture_graphs(self, sizes: list[int], max_model_len: int) -> None:
        """Capture the decode step for each batch size in `sizes` (none: stay eager). A
        tensor-parallel rank calls this itself once its group is joined (engine/tp_executor.py)."""
        if not sizes:
            return
        reason = graphs_unsupported(self.model, self.kv_cache)
        if reason:
            logger.info("decode steps run eagerly: %s", reason)
            return
        t = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size,
                              -(-max_model_len // self.block_size), sizes)
        graphs.capture()
        self.graphs = graphs
        logger.info("captured CUDA graphs of the decode step for %d batch sizes (1 to %d) in %.1f s",
                    len(graphs.sizes), graphs.max_size, time.perf_counter() - t)

    def build_metadata(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        """Flattened input ids and the step's attention metadata."""
        sched = out.scheduled
        # Attention works in block-table positions: a sequence missing released blocks starts
        # its chunk that much earlier in its table (its rotary positions stay, see rope_positions).
        meta = build_attention_metadata([s.start_pos - s.num_released_tokens for s in sched],
                                        [s.num_new_tokens for s in sched],
                                        [s.block_table for s in sched], self.block_size, self.device)
        if meta.block_tables.numel() and int(meta.block_tables.max()) >= self.num_blocks:
            raise ValueError(f"a block table names block {int(meta.block_tables.max())}, but the KV "
                             f"cache has only {self.num_blocks} blocks")
        ids = np.fromiter(chain.from_iterable(s.token_ids for s in sched), dtype=np.int64)
        if ids.size != meta.num_tokens:
            bad = next(s for s in sched if len(s.token_ids) != s.num_new_tokens)
            raise ValueError(f"request {bad.request.request_id}: scheduled tokens "
                             f"[{bad.start_pos}, {bad.start_pos + bad.num_new_tokens}) but it has only "
                             f"{bad.request.num_tokens} tokens")
        return torch.from_numpy(ids).to(self.device), meta

    def rope_positions(self, out: SchedulerOutput, meta: AttentionMetadata) -> torch.Tensor:
        """Each new token's rotary position: its table position plus the positions released
        before it. Keys keep the rotation of their original position (rotating cached keys to
        re-index them would rewrite blocks the prefix cache shares), so a query keeps its own."""
        shift = [s.num_released_tokens for s in out.scheduled]
        if not any(shift):
            return meta.positions
        return meta.positions + torch.repeat_interleave(
            torch.tensor(shift, dtype=torch.long), torch.tensor(meta.query_lens, dtype=torch.long)).to(self.device)

    def warm_up(self, prompt_len: int) -> None:
        """A prefill of `prompt_len` tokens, then a decode, over the pool's first blocks, their
        outputs dropped: the kernels' first calls, the activations' first pages and the sampler's
        buffers are paid here, before the server says it is ready, not by its first request.
        Only a full-precision cache: its blocks hold nothing but the tensors, which the KV
        manager (which never handed these blocks out) lets the next writer overwrite; a quantized
        cache also tracks open blocks, which this would leave behind."""
        if self.config.kv_cache_dtype != "auto":
            return
        prompt_len = min(prompt_len, self.num_blocks * self.block_size - 1)
        if prompt_len < 1:
            return
        table = list(range(-(-(prompt_len + 1) // self.block_size)))
        req = Request("warm-up", [i % self.model_config.vocab_size for i in range(prompt_len)],
                      SamplingParams(temperature=1.0, max_tokens=2))
        out = self.execute(SchedulerOutput([ScheduledRequest(req, 0, prompt_len, table, True)]))
        req.append_output_token(out.sampled[req.request_id].token_id)
        self.execute(SchedulerOutput([ScheduledRequest(req, prompt_len, 1, table, True)]))
        self.sampler.forget([req.request_id])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample: bool = True) -> ModelRunnerOutput:
        """`sample=False`: the forward only (a tensor-parallel rank above 0: its all-reduces are
        the step's; rank 0 alone scores and samples)."""
        if out.block_copies:
            self.kv_cache.copy_blocks(out.block_copies)
        if out.finished_req_ids:
            self.sampler.forget(out.finished_req_ids)
        if out.is_empty:
            return ModelRunnerOutput()
        lora_slots: dict[str, int] = {}
        if self.lora is not None:
            out, lora_slots = self.lora.arrange(out)
        sampling = [(i, s) for i, s in enumerate(out.scheduled) if s.sample and not s.spec_token_ids]
        guessing = [(i, s) for i, s in enumerate(out.scheduled) if s.spec_token_ids]
        if self._replays(out):
            sched = out.scheduled
            hidden = self.graphs.run(np.fromiter((s.request.all_token_ids[s.start_pos] for s in sched), np.int64,
                                                 len(sched)),
                                     np.fromiter((s.start_pos for s in sched), np.int64, len(sched)),
                                     [s.block_table for s in sched])
            logit_rows, trimmed = self._logit_rows(sampling, guessing, range(len(sched) + 1)), False
            prompt_lps, block_scores = {}, {}
        else:
            input_ids, meta = self.build_metadata(out)
            scored = [(i, r) for i, r in enumerate(map(_score_rows, out.scheduled)) if r is not None]
            meta.score_seqs, meta.score_rows = [i for i, _ in scored], [r for _, r in scored]
            logit_rows = self._logit_rows(sampling, guessing, meta.query_start_loc)
            trimmed = self._trims(out, logit_rows, meta.num_tokens)
            lora = self.lora.step(out.scheduled, meta.query_start_loc, lora_slots, self.device) if lora_slots else None
            hidden = self.model.forward(input_ids, self.rope_positions(out, meta), meta, self.kv_cache,
                                        torch.tensor(logit_rows, dtype=torch.long, device=self.device) if trimmed else None,
                                        **({"lora": lora} if lora is not None else {}))
            prompt_lps = {} if trimmed or not sample else self._prompt_logprobs(out, hidden, meta)
            block_scores = {out.scheduled[i].request.request_id: t.tolist() for i, t in meta.block_scores.items()}
        self.kv_cache.finish_step()

        if not sample or (not sampling and not guessing):
            return ModelRunnerOutput(prompt_logprobs=prompt_lps, kv_block_scores=block_scores)
        if not trimmed:
            hidden = hidden[torch.tensor(logit_rows, device=self.device)]
        logits = self.model.compute_logits(hidden, float32=False)
        rows = [SamplingRow(s.request.request_id, s.request.sampling_params, s.request.prompt_token_ids,
                            s.request.output_token_ids, s.request.eos_token_ids) for _, s in sampling]
        tokens = self.sampler(logits[:len(rows)], rows)
        result = ModelRunnerOutput(sampled={r.request_id: t for r, t in zip(rows, tokens)}, prompt_logprobs=prompt_lps,
                                   kv_block_scores=block_scores)
        if guessing:
            greedy = row_argmax(logits[len(rows):]).tolist()
            at = 0
            for _, s in guessing:
                result.spec_tokens[s.request.request_id] = greedy[at:at + s.num_new_tokens]
                at += s.num_new_tokens
        return result

    @staticmethod
    def _logit_rows(sampling: list[tuple[int, ScheduledRequest]], guessing: list[tuple[int, ScheduledRequest]],
                    query_start_loc: Sequence[int]) -> list[int]:
        """The rows lm_head scores: sampled rows first, then every row of each speculated entry
        (the greedy token at each position checks the guess there), so that both are row slices
        of one lm_head call."""
        rows = [query_start_loc[i + 1] - 1 for i, _ in sampling]
        for i, _ in guessing:
            rows.extend(range(query_start_loc[i], query_start_loc[i + 1]))
        return rows

    @staticmethod
    def _trims(out: SchedulerOutput, logit_rows: list[int], num_tokens: int) -> bool:
        """Whether the forward returns only logit_rows (LlamaModel.forward's out_rows): where
        they are fewer than the step's rows (a prompt chunk's other rows), no request scores
        its prompt, and they ascend (the compiled layer loop gathers them in place)."""
        return (len(logit_rows) < num_tokens
                and all(s.request.sampling_params.prompt_logprobs is None for s in out.scheduled)
                and all(a < b for a, b in zip(logit_rows, logit_rows[1:])))

    def _replays(self, out: SchedulerOutput) -> bool:
        """Whether this step replays a decode graph: one token per sequence, a captured batch
        size, and no prompt logprobs (those score prompt rows the graph does not return)."""
        return (self.graphs is not None and self.graphs.size_for(len(out.scheduled)) is not None
                and all(s.num_new_tokens == 1 and s.request.sampling_params.prompt_logprobs is None
                        and not s.num_released_tokens and _score_rows(s) is None and s.request.lora_id is None
                        for s in out.scheduled))

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata
                         ) -> dict[str, PromptLogprobs]:
        """For requests with prompt_logprobs: the logprob of each prompt token this chunk can
        score (row j's logits score token j + 1), computed PROMPT_LOGITS_ROWS rows at a time."""
        result = {}
        for i, s in enumerate(out.scheduled):
            k = s.request.sampling_params.prompt_logprobs
            prompt = s.request.prompt_token_ids
            end = min(s.start_pos + s.num_new_tokens, len(prompt) - 1)
            if k is None or end <= s.start_pos:
                continue
            first_row = int(meta.query_start_loc[i])
            chunk = PromptLogprobs(s.start_pos + 1, [], [], [])
            for lo in range(s.start_pos, end, PROMPT_LOGITS_ROWS):
                hi = min(lo + PROMPT_LOGITS_ROWS, end)
                rows = hidden[first_row + lo - s.start_pos:first_row + hi - s.start_pos]
                targets = torch.tensor(prompt[lo + 1:hi + 1], device=self.device)
                logprobs = torch.log_softmax(self.model.compute_logits(rows), -1)
                lps, ranks, top = token_logprobs(logprobs, targets, k)
                chunk.logprobs.extend(lps)
                chunk.ranks.extend(ranks)
                chunk.top.extend(top)
            result[s.request.request_id] = chunk
        return result


def _score_rows(s: ScheduledRequest) -> tuple[int, int] | None:
    """Which query rows of the entry the forward scores for its compression method (h2o, snapkv:
    attention received decides which blocks stay), as (last, stride); None for none."""
    c = active(s.request.sampling_params.kv_compression)
    if c is None:
        return None
    return method_for(c).score_rows(s.start_pos, s.num_new_tokens, s.request.num_prompt_tokens)
