"""Engine start-up: load the model, size the KV pool, check max_model_len fits, build the runner."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvserve import envs
from kvserve.cache import quantized
from kvserve.cache.factory import (blocks_in_budget, kv_cache_bytes_per_block, kv_cache_reserved_bytes,
                                   residual_pool_bytes)
from kvserve.cache.quantizers import KVScales
from kvserve.config import DEFAULT_CPU_KV_CACHE_MEMORY, ConfigError, EngineArgs, ModelConfig, host_memory

logger = logging.getLogger(__name__)


@dataclass
class KVBudget:
    num_blocks: int
    bytes_per_block: int
    kv_cache_memory: int  # bytes given to the pool
    max_model_len: int
    block_size: int
    residual_bytes: int = 0  # a quantized cache's full-precision residual pool, beside the blocks
    lora_bytes: int = 0  # --max-loras adapter slots of --max-lora-rank, charged before the blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        # vLLM's figure: whole blocks per request, since a request never shares its last block.
        return self.num_blocks / -(-self.max_model_len // self.block_size)


@dataclass
class EngineSetup:
    model_config: ModelConfig
    tokenizer: object
    runner: object  # kvserve.runner.model_runner.ModelRunner
    budget: KVBudget
    # Identity of the KV block bytes (kvserve.kv.tiers.EngineFingerprint); set when tiers are on.
    fingerprint: object | None = None

    @property
    def num_blocks(self) -> int:
        return self.budget.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.budget.max_model_len


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return torch.device(device)


def size_kv_pool(args: EngineArgs, model_config: ModelConfig, bytes_per_block: int,
                 device: torch.device, gpu_budget_bytes: int | None = None,
                 reserved_bytes: int = 0, lora_bytes: int = 0) -> KVBudget:
    """How many blocks the budget buys, and a clear error if max_model_len cannot fit.
    `reserved_bytes` (a quantized cache's residual pool) and `lora_bytes` (the adapter slots)
    come out of the budget first."""
    max_model_len = args.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        # As vLLM: positions past what the model was trained on give garbage, so refuse unless asked.
        allowed = envs.KVSERVE_ALLOW_LONG_MAX_MODEL_LEN or envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN
        if not allowed:
            raise ConfigError(
                f"--max-model-len {max_model_len} is larger than the model's context size "
                f"(max_position_embeddings {model_config.max_position_embeddings}); lower --max-model-len, "
                f"or set KVSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 if the model really handles longer inputs")
        logger.warning("--max-model-len %d exceeds the model's max_position_embeddings %d "
                       "(allowed by KVSERVE_ALLOW_LONG_MAX_MODEL_LEN)", max_model_len,
                       model_config.max_position_embeddings)
    if args.num_gpu_blocks_override is not None:
        memory = args.num_gpu_blocks_override * bytes_per_block
        num_blocks = args.num_gpu_blocks_override
    else:
        if device.type == "cuda" and args.kv_cache_memory is None:
            memory = gpu_budget_bytes or 0
            budget_flag = "--gpu-memory-utilization"
        else:
            memory = args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            budget_flag = "--kv-cache-memory"
        if lora_bytes >= memory:
            raise ConfigError(f"The LoRA adapter slots (--max-loras {args.max_loras} x --max-lora-rank "
                              f"{args.max_lora_rank}: {lora_bytes / 2**20:.1f} MiB) take the whole KV budget of "
                              f"{memory / 2**20:.1f} MiB; raise {budget_flag} or lower --max-loras / --max-lora-rank")
        memory -= lora_bytes
        num_blocks = blocks_in_budget(memory, bytes_per_block, reserved_bytes, args.max_num_seqs)
        if num_blocks < 1:
            residual = (f" after the quantized cache's full-precision residual pool ({reserved_bytes} "
                        f"bytes: one open block per sequence of --max-num-seqs {args.max_num_seqs})"
                        if reserved_bytes else "")
            raise ConfigError(
                f"No memory left for the KV cache: one block takes {bytes_per_block} bytes but the "
                f"budget is {memory} bytes{residual}; raise {budget_flag}"
                f"{' or lower --max-num-seqs' if reserved_bytes else ''}")
    available = host_memory("MemAvailable") if device.type == "cpu" else None
    if available is not None and memory > available:
        flag = "--num-gpu-blocks-override" if args.num_gpu_blocks_override is not None else "--kv-cache-memory"
        raise ConfigError(
            f"The KV cache would take {memory / 2**30:.1f} GiB but this machine has "
            f"{available / 2**30:.1f} GiB of memory available; lower {flag} (the weights need room too)")
    fits = num_blocks * args.block_size
    if max_model_len > fits:
        raise ConfigError(
            f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({fits}). Raise --kv-cache-memory (or "
            f"--gpu-memory-utilization on CUDA), use a smaller --kv-cache-dtype, or decrease "
            f"--max-model-len to at most {fits}.")
    return KVBudget(num_blocks, bytes_per_block, memory, max_model_len, args.block_size,
                    residual_pool_bytes(reserved_bytes, args.max_num_seqs, num_blocks), lora_bytes)


def lora_dtype(args: EngineArgs, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--lora-dtype resolved: auto is the model's dtype (float32 slots measured no faster on CPU
    end to end, at twice the memory: bench/NOTES.md)."""
    return dtype if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype)


def lora_slot_bytes(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """What the --max-loras adapter slots of --max-lora-rank take (0 without --enable-lora)."""
    if not args.enable_lora:
        return 0
    from kvserve.model.lora import packing_kernels, slot_bytes
    slots_dtype = lora_dtype(args, dtype, device)
    return args.max_loras * slot_bytes(cfg, args.max_lora_rank, slots_dtype,
                                       packing_kernels(cfg, dtype, slots_dtype, device))


def kv_budget_for(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  gpu_budget_bytes: int | None = None, static_fp8_scales: bool = False) -> KVBudget:
    """The pool the engine builds for these settings (`kvserve plan` reproduces this arithmetic).
    `static_fp8_scales`: the checkpoint's scales quantize each token as written, so no residual pool."""
    bpb = kv_cache_bytes_per_block(cfg, args.block_size, args.kv_cache_dtype, dtype)
    reserved = 0 if static_fp8_scales else kv_cache_reserved_bytes(cfg, args.block_size, args.kv_cache_dtype,
                                                                   dtype, args.max_num_seqs)
    return size_kv_pool(args, cfg, bpb, device, gpu_budget_bytes, reserved, lora_slot_bytes(args, cfg, dtype, device))


def _static_fp8_scales(args: EngineArgs, weights: dict) -> bool:
    """The checkpoint ships vLLM's per-layer k/v scales, which an fp8 cache then uses."""
    return args.kv_cache_dtype.startswith("fp8") and any(k.endswith(("k_scale", "v_scale", "kv_scale"))
                                                         for k in weights)


def make_runner(args: EngineArgs, cfg: ModelConfig, weights: dict, codes: dict | None, budget: KVBudget,
                dtype: torch.dtype, device: torch.device, kv_scales: KVScales | None, rank: int = 0):
    """The ModelRunner of one rank (the only one without tensor parallelism): its share of the
    weights and of the GGUF codes (model/shard.py) and a KV pool of `budget.num_blocks` blocks of its
    heads. A sharded model captures its CUDA graphs later, once its group is joined (their all-reduces
    need the group)."""
    from kvserve.model.shard import rank_config, shard_codes, shard_weights
    from kvserve.runner.model_runner import ModelRunner, RunnerConfig

    tp = args.tensor_parallel_size
    lora_shard = (cfg, rank, tp) if tp > 1 else None
    if tp > 1:
        codes = shard_codes(codes, cfg, rank, tp) if codes and args.quantization != "none" else None
        weights, cfg = shard_weights(weights, cfg, rank, tp), rank_config(cfg, tp)
    return ModelRunner(cfg, weights, RunnerConfig(
        dtype=dtype, device=device, block_size=args.block_size, num_blocks=budget.num_blocks,
        kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, attention_backend=args.attention_backend,
        disable_cascade_attn=args.disable_cascade_attn,
        cuda_graph_sizes=tuple(cuda_graph_sizes(args, device)) if tp == 1 else (),
        max_model_len=budget.max_model_len, num_residual_blocks=quantized.residual_blocks_for(args.max_num_seqs),
        kv_scales=kv_scales, max_loras=args.max_loras if args.enable_lora else 0, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, lora_dtype=lora_dtype(args, dtype, device), lora_shard=lora_shard),
        weight_codes=None if args.quantization == "none" else codes)


def build_engine_parts(args: EngineArgs, start_ranks=None) -> EngineSetup:
    """`start_ranks(args, loaded, budget, dtype, device, kv_scales)`: with --tensor-parallel-size
    above 1, starts the other ranks and returns rank 0's runner driving them (engine/tp_executor.py)."""
    from kvserve.model.loader import load_model, resolve_dtype
    from kvserve.model.shard import rank_config

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device.type)
    loaded = load_model(args.model, dtype=dtype)
    if args.quantization == "gguf" and not loaded.codes:
        raise ConfigError(f"--quantization gguf needs a GGUF checkpoint with Q4_1 or Q8_0 weights; {loaded.source} "
                          f"has none (leave --quantization unset to load it as stored)")
    if args.tensor_parallel_size > 1 and args.quantization != "none":
        _check_codes_split(args, loaded.config, loaded.codes)
    tokenizer = loaded.tokenizer
    if args.tokenizer:
        from kvserve.model.tokenizer import Tokenizer

        # The model's own stop ids (config.json / generation_config.json) apply whatever the tokenizer.
        tokenizer = Tokenizer.from_pretrained(args.tokenizer, extra_eos_token_ids=loaded.config.eos_token_ids)
    cfg = loaded.config
    gpu_budget = None
    if device.type == "cuda" and args.kv_cache_memory is None and args.num_gpu_blocks_override is None:
        gpu_budget = _cuda_kv_budget(args, loaded.weights)
    static_scales = _static_fp8_scales(args, loaded.weights)
    # Each rank's pool holds its own KV heads: the same budget buys tensor_parallel_size times the blocks.
    budget = kv_budget_for(args, rank_config(cfg, args.tensor_parallel_size), dtype, device, gpu_budget,
                           static_scales)
    bpb = budget.bytes_per_block
    kv_scales = None
    if static_scales:
        kv_scales = KVScales.from_weights(loaded.weights, cfg.num_hidden_layers)
        logger.info("fp8 KV cache: using the checkpoint's static k/v scales")
    if args.tensor_parallel_size > 1:
        if start_ranks is None:
            raise ConfigError("--tensor-parallel-size above 1 needs the engine to start its ranks: build the "
                              "engine with LLMEngine.from_engine_args")
        runner = start_ranks(args, loaded, budget, dtype, device, kv_scales)
    else:
        runner = make_runner(args, cfg, loaded.weights, loaded.codes, budget, dtype, device, kv_scales)
    start = time.perf_counter()
    runner.warm_up(min(args.resolved_max_num_batched_tokens(budget.max_model_len), budget.max_model_len - 1))
    logger.info("warm-up step: %.2f s", time.perf_counter() - start)
    logger.info("KV cache%s: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/block, kv dtype %s); "
                "maximum concurrency for %d tokens per request: %.2fx",
                f" (per rank, its {runner.model_config.num_key_value_heads} KV heads)"
                if args.tensor_parallel_size > 1 else "", budget.num_blocks, args.block_size, budget.num_tokens,
                budget.num_blocks * bpb / 2**20, bpb, args.kv_cache_dtype, budget.max_model_len,
                budget.max_concurrency)
    if budget.residual_bytes:
        _log_residual_pool(args, cfg, dtype, budget)
    if budget.lora_bytes:
        logger.info("LoRA: %d adapter slots of rank %d take %.1f MiB, charged before the KV cache",
                    args.max_loras, args.max_lora_rank, budget.lora_bytes / 2**20)
    fingerprint = None
    if args.has_kv_tiers:
        from kvserve.cache.offload import engine_fingerprint
        fingerprint = engine_fingerprint(args, cfg, loaded.weights, dtype, runner.kv_cache)
    return EngineSetup(cfg, tokenizer, runner, budget, fingerprint)


def _check_codes_split(args: EngineArgs, cfg: ModelConfig, codes: dict) -> None:
    """GGUF codes whose split by rank is not whole blocks: refused under --quantization gguf
    (which asks for the codes), else run as the rank's bf16 shard, logged."""
    from kvserve.model.shard import codes_split_problems, kv_heads_per_rank

    tp = args.tensor_parallel_size
    problems = codes_split_problems(cfg, tp, codes)
    if not problems:
        return
    why = "; ".join(problems.values())
    if args.quantization == "gguf":
        def fits(n: int) -> bool:
            try:
                kv_heads_per_rank(cfg, n)
            except ConfigError:
                return False
            return not codes_split_problems(cfg, n, codes)
        sizes = [str(n) for n in range(1, cfg.num_attention_heads + 1) if fits(n)]
        raise ConfigError(f"--quantization gguf with --tensor-parallel-size {tp}: {why}; use a "
                          f"--tensor-parallel-size that splits whole blocks ({', '.join(sizes)}), or leave "
                          f"--quantization unset to run {', '.join(problems)} on bf16 shards")
    logger.warning("--tensor-parallel-size %d: %s; %s run%s on bf16 shards (the other projections keep their "
                   "GGUF codes)", tp, why, ", ".join(problems), "" if len(problems) > 1 else "s")


def cuda_graph_sizes(args: EngineArgs, device: torch.device) -> list[int]:
    """Decode batch sizes to capture as CUDA graphs: none on CPU or with --enforce-eager."""
    if device.type != "cuda" or args.enforce_eager:
        return []
    from kvserve.runner.cuda_graph import capture_sizes
    return capture_sizes(min(args.max_num_seqs, args.max_cudagraph_capture_size))


def _log_residual_pool(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, budget: KVBudget) -> None:
    """Where a quantized cache's budget went besides its blocks, and a warning when the result
    holds fewer tokens than a full-precision cache would in the same budget."""
    logger.info("KV cache: the %s cache's full-precision residual pool (one open block per sequence of "
                "--max-num-seqs %d, plus one; at most one per block) takes %.1f MiB besides the blocks",
                args.kv_cache_dtype, args.max_num_seqs, budget.residual_bytes / 2**20)
    if args.num_gpu_blocks_override is None:
        auto_tokens = budget.kv_cache_memory // kv_cache_bytes_per_block(cfg, args.block_size, "auto", dtype) * args.block_size
        if budget.num_tokens < auto_tokens:
            logger.warning("--kv-cache-dtype %s holds %d tokens in this budget, fewer than auto's %d: its "
                           "residual pool outweighs what quantization saves at this size; raise "
                           "--kv-cache-memory or lower --max-num-seqs", args.kv_cache_dtype,
                           budget.num_tokens, auto_tokens)


def _cuda_kv_budget(args: EngineArgs, weights: dict) -> int:
    """vLLM's rule: total * utilization - (weights + peak activations). Activations are estimated
    from a max_num_batched_tokens forward's workspace; profile conservatively."""
    free, total = torch.cuda.mem_get_info()
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    used_by_others = total - free
    # Peak activation allowance: logits for max_num_seqs rows plus a 10% safety margin on weights.
    activation_reserve = int(0.1 * weight_bytes) + 512 * 2**20
    return int(total * args.gpu_memory_utilization) - used_by_others - weight_bytes - activation_reserve
