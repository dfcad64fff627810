"""`kvserve plan`: how many tokens of KV cache fit, and how many requests that serves.

The arithmetic lives in plain functions returning dataclasses (`plan_kv`, `memory_budget`,
`build_plan_report`). Bytes per block come from the engine's own sizing function
(kvserve.cache.factory.kv_cache_bytes_per_block, which counts quantization scales), so the
startup log and this tool agree by construction; the engine may call `plan_kv` for its figures.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace

from kvserve.config import (DEFAULT_CPU_KV_CACHE_MEMORY, KV_CACHE_DTYPES, ConfigError, ModelConfig, check_block_size,
                            check_writable, parse_size)
from kvserve.tools.presets import ModelSpec, count_parameters, resolve_model

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

# Weight storage per parameter. int4 is GPTQ/AWQ-style: groups of 128 with an fp16 scale and a
# packed 4-bit zero point; q4_1 is GGUF's block of 32 weights with fp16 d and m (20 bytes).
WEIGHT_QUANT_BYTES = {"fp8": 1.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2.5 / 128, "q4_1": 20 / 32}
QUANTIZATIONS = ("auto", "none", "fp8", "int8", "int4", "q4_1", "gguf")

TABLE_KV_DTYPES = ("auto", "fp8", "int8", "int4")
TABLE_MODEL_LENS = (4096, 8192, 32768, 131072)
FIXED_GPU_OVERHEAD = 1024**3  # CUDA context, cuBLAS/NCCL workspaces, CUDA graphs: vLLM-sized, not profiled


def normalize_dtype(dtype) -> str:
    """'bf16', 'bfloat16' or a torch.dtype -> 'bfloat16' (and so on)."""
    name = str(dtype).replace("torch.", "").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ConfigError(f"--dtype must be one of float32, bfloat16, float16 (got {dtype!r})")
    return name


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype="bfloat16",
                       tensor_parallel_size: int = 1) -> int:
    """True bytes one block takes on one GPU (all layers, K and V, scales and zero points).

    Delegates to the engine's own sizing function, the one startup divides the budget by, with
    the KV heads of one tensor-parallel rank: the planner cannot drift from the engine.
    """
    import torch

    from kvserve.cache.factory import kv_cache_bytes_per_block

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {kv_cache_dtype!r})")
    check_block_size(block_size)
    rank_cfg = replace(cfg, num_key_value_heads=kv_heads_per_gpu(cfg, tensor_parallel_size))
    try:
        return kv_cache_bytes_per_block(rank_cfg, block_size, kv_cache_dtype, getattr(torch, normalize_dtype(model_dtype)))
    except ConfigError:
        raise
    except ValueError as e:  # the quantizer's own setting errors (group size vs block size, odd head_dim)
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype} with --block-size {block_size}: {e}") from None


def kv_reserved_bytes(cfg: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype="bfloat16",
                      tensor_parallel_size: int = 1, max_num_seqs: int = 256) -> int:
    """Bytes a quantized cache keeps in full precision besides its blocks (the engine's own rule)."""
    import torch

    from kvserve.cache.factory import kv_cache_reserved_bytes

    rank_cfg = replace(cfg, num_key_value_heads=kv_heads_per_gpu(cfg, tensor_parallel_size))
    return kv_cache_reserved_bytes(rank_cfg, block_size, kv_cache_dtype,
                                   getattr(torch, normalize_dtype(model_dtype)), max_num_seqs)


def kv_heads_per_gpu(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """KV heads each rank stores; ranks beyond the KV head count hold a replica (as vLLM does)."""
    tp, kv = tensor_parallel_size, cfg.num_key_value_heads
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1 (got {tp})")
    if cfg.num_attention_heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {cfg.num_attention_heads} "
                          "attention heads; pick a divisor of it")
    if kv % tp and tp % kv:
        raise ConfigError(f"--tensor-parallel-size {tp} and the model's {kv} KV heads: one must divide the other")
    return max(1, kv // tp)


@dataclass
class KVPlan:
    """KV cache sizing for one GPU (one rank under tensor parallelism)."""
    model: str
    kv_cache_dtype: str
    model_dtype: str
    tensor_parallel_size: int
    num_kv_heads_per_gpu: int
    block_size: int
    max_model_len: int
    bytes_per_token: float   # per GPU, block metadata amortized; times tensor_parallel_size for the model
    bytes_per_block: int
    blocks_per_request: int  # at max_model_len
    bytes_per_request: int
    kv_cache_memory: int
    num_blocks: int
    num_tokens: int
    max_concurrency: float   # requests of max_model_len tokens that fit at once
    fits: bool
    max_fitting_len: int     # longest single request the pool can hold
    mean_context_len: int | None = None
    max_concurrency_at_mean: float | None = None
    reserved_bytes: int = 0  # the full-precision residual pool a quantized cache builds beside its blocks


def plan_kv(model_config: ModelConfig, kv_cache_memory: int, block_size: int, kv_cache_dtype: str = "auto",
            model_dtype="bfloat16", max_model_len: int | None = None, *, tensor_parallel_size: int = 1,
            mean_context_len: int | None = None, max_num_seqs: int = 256) -> KVPlan:
    """The engine's startup arithmetic: bytes per token/block, blocks and tokens that fit, concurrency."""
    cfg = model_config
    if kv_cache_memory < 0:
        raise ConfigError(f"--kv-cache-memory must be >= 0 bytes (got {kv_cache_memory})")
    max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
    if max_model_len < 1:
        raise ConfigError(f"--max-model-len must be >= 1 (got {max_model_len})")
    if max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1 (got {max_num_seqs})")
    kv_heads = kv_heads_per_gpu(cfg, tensor_parallel_size)
    dtype = normalize_dtype(model_dtype)
    bytes_per_block = kv_bytes_per_block(cfg, block_size, kv_cache_dtype, dtype, tensor_parallel_size)
    from kvserve.cache.factory import blocks_in_budget, residual_pool_bytes
    reserved = kv_reserved_bytes(cfg, block_size, kv_cache_dtype, dtype, tensor_parallel_size, max_num_seqs)
    num_blocks = blocks_in_budget(kv_cache_memory, bytes_per_block, reserved, max_num_seqs)
    blocks_per_request = -(-max_model_len // block_size)
    at_mean = None
    if mean_context_len is not None:
        if mean_context_len < 1:
            raise ConfigError(f"--mean-context-len must be >= 1 (got {mean_context_len})")
        at_mean = num_blocks / -(-mean_context_len // block_size)
    return KVPlan(
        model=cfg.name, kv_cache_dtype=kv_cache_dtype, model_dtype=dtype,
        tensor_parallel_size=tensor_parallel_size, num_kv_heads_per_gpu=kv_heads, block_size=block_size,
        max_model_len=max_model_len, bytes_per_token=bytes_per_block / block_size,
        bytes_per_block=bytes_per_block, blocks_per_request=blocks_per_request,
        bytes_per_request=blocks_per_request * bytes_per_block, kv_cache_memory=kv_cache_memory,
        num_blocks=num_blocks, num_tokens=num_blocks * block_size,
        max_concurrency=num_blocks / blocks_per_request, fits=num_blocks >= blocks_per_request,
        max_fitting_len=num_blocks * block_size, mean_context_len=mean_context_len,
        max_concurrency_at_mean=at_mean, reserved_bytes=residual_pool_bytes(reserved, max_num_seqs, num_blocks))


@dataclass
class WeightEstimate:
    bytes_per_gpu: int
    quantization: str   # what was assumed: none / fp8 / int8 / int4 / q4_1 / gguf
    num_params: int
    note: str


def estimate_weights(spec: ModelSpec, dtype: str, quantization: str, tensor_parallel_size: int) -> WeightEstimate:
    """Weight bytes per GPU. Quantized schemes touch decoder linears only (embeddings and lm_head
    stay in `dtype`, as GPTQ/AWQ/fp8 checkpoints ship them) except q4_1, which llama.cpp applies
    to every matrix."""
    params = count_parameters(spec.config)
    tp = tensor_parallel_size
    q = (spec.quantization or "none") if quantization == "auto" else quantization
    if q == "gguf":
        if spec.file_weight_bytes is None:
            raise ConfigError("--quantization gguf needs a .gguf --model (it sizes weights as stored in the file)")
        return WeightEstimate(math.ceil(spec.file_weight_bytes / tp), "gguf", params.total,
                              "tensor bytes as stored in the GGUF file")
    dense = DTYPE_BYTES[dtype]
    if q == "none":
        total = params.total * dense
        note = f"{dtype}, {dense} bytes/param"
        if spec.file_weight_bytes is not None:
            note += " (kvserve dequantizes GGUF at load; --quantization gguf sizes the file as stored)"
    elif q == "q4_1":
        total = (params.embedding + params.lm_head + params.decoder_linear) * WEIGHT_QUANT_BYTES[q] + params.other * dense
        note = f"q4_1 on every matrix, {WEIGHT_QUANT_BYTES[q]:.3f} bytes/param"
    elif q in WEIGHT_QUANT_BYTES:
        total = params.decoder_linear * WEIGHT_QUANT_BYTES[q] + (params.total - params.decoder_linear) * dense
        note = f"{q} decoder linears ({WEIGHT_QUANT_BYTES[q]:.3f} bytes/param), embeddings and lm_head in {dtype}"
    else:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} (got {quantization!r})")
    # Megatron-style TP splits every matrix, the vocab-parallel embedding and lm_head included.
    return WeightEstimate(math.ceil(total / tp), q, params.total, note)


def kvserve_rank_weights(spec: ModelSpec, dtype: str, tensor_parallel_size: int) -> int:
    """The weight bytes one of kvserve's tensor-parallel ranks holds: the decoder's projections
    split N ways in `dtype` (an upper bound for a GGUF model: on AMX CPUs its ranks hold their
    share of the codes instead), the embedding, lm_head and norms whole on every rank (model/shard.py)."""
    params = count_parameters(spec.config)
    return (math.ceil(params.decoder_linear / tensor_parallel_size)
            + params.total - params.decoder_linear) * DTYPE_BYTES[dtype]


def estimate_activation_reserve(cfg: ModelConfig, dtype: str, tensor_parallel_size: int,
                                max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak non-KV memory of one forward, a stand-in for the profiling run the engine does.

    Residual stream and its norms (4 x hidden), this rank's q/k/v and MLP gate/up activations for
    max_num_batched_tokens tokens, fp32 logits of the full vocabulary for max_num_seqs sampled
    rows, plus FIXED_GPU_OVERHEAD.
    """
    tp, b = tensor_parallel_size, DTYPE_BYTES[dtype]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim // tp
    per_token = (4 * cfg.hidden_size + qkv + 2 * cfg.intermediate_size // tp) * b
    return FIXED_GPU_OVERHEAD + max_num_batched_tokens * per_token + max_num_seqs * cfg.vocab_size * 4


@dataclass
class MemoryBudget:
    """Where the per-GPU KV budget comes from."""
    kv_cache_memory: int
    source: str  # kv-cache-memory | gpu-memory | default
    gpu_memory: int | None = None
    gpu_memory_utilization: float | None = None
    weights: WeightEstimate | None = None
    activation_reserve: int | None = None
    reserve_note: str = ""
    lora_bytes: int = 0  # --enable-lora: the adapter slots, charged before the KV cache
    lora_note: str = ""


def memory_budget(args: argparse.Namespace, spec: ModelSpec) -> MemoryBudget:
    dtype = normalize_dtype(spec.dtype if args.dtype == "auto" else args.dtype)
    tp = args.tensor_parallel_size
    if args.kv_cache_memory is not None:
        kv = _size(args.kv_cache_memory, "--kv-cache-memory")
        return MemoryBudget(kv_cache_memory=kv, source="kv-cache-memory")
    if args.gpu_memory is None:
        return MemoryBudget(kv_cache_memory=DEFAULT_CPU_KV_CACHE_MEMORY, source="default")
    util = args.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1] (got {util})")
    gpu = _size(args.gpu_memory, "--gpu-memory")
    weights = estimate_weights(spec, dtype, args.quantization, tp)
    if args.activation_reserve is not None:
        reserve, note = _size(args.activation_reserve, "--activation-reserve"), "given with --activation-reserve"
    else:
        reserve = estimate_activation_reserve(spec.config, dtype, tp, args.max_num_batched_tokens, args.max_num_seqs)
        note = (f"estimated: 1 GiB fixed + one forward of {args.max_num_batched_tokens} tokens + fp32 logits "
                f"for {args.max_num_seqs} sequences; set --activation-reserve to override")
    kv = int(gpu * util) - weights.bytes_per_gpu - reserve
    if kv <= 0:
        raise ConfigError(
            f"no room for KV cache: {fmt_bytes(gpu)} x {util} = {fmt_bytes(gpu * util)} per GPU, but weights take "
            f"{fmt_bytes(weights.bytes_per_gpu)} and the activation reserve {fmt_bytes(reserve)}; raise "
            "--tensor-parallel-size or --gpu-memory-utilization, or use --quantization")
    return MemoryBudget(kv_cache_memory=kv, source="gpu-memory", gpu_memory=gpu, gpu_memory_utilization=util,
                        weights=weights, activation_reserve=reserve, reserve_note=note)


def lora_charge(args: argparse.Namespace, cfg: ModelConfig, dtype: str, device: str) -> tuple[int, str]:
    """The engine's charge for --max-loras adapter slots of --max-lora-rank (runner/build.py's
    lora_slot_bytes, packed copy included where this CPU's AMX kernels would hold one), and what it is."""
    if not getattr(args, "enable_lora", False):
        return 0, ""
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise ConfigError(f"--max-loras and --max-lora-rank must be >= 1 (got {args.max_loras}, {args.max_lora_rank})")
    import torch

    from kvserve.model.lora import packing_kernels
    from kvserve.runner.build import lora_dtype, lora_slot_bytes
    torch_dtype, dev = getattr(torch, dtype), torch.device(device)
    charge = lora_slot_bytes(args, cfg, torch_dtype, dev)
    slots_dtype = lora_dtype(args, torch_dtype, dev)
    packed = packing_kernels(cfg, torch_dtype, slots_dtype, dev) is not None
    return charge, (f"--max-loras {args.max_loras} x --max-lora-rank {args.max_lora_rank}, "
                    f"{str(slots_dtype).removeprefix('torch.')}{', also packed for the AMX kernels' if packed else ''}")


def _size(value: str, flag: str) -> int:
    n = parse_size(value, flag)
    if n < 1024**2:
        bare = str(value).strip().replace(".", "", 1).isdigit() and float(value) > 0
        example = f"{value}GiB" if bare else "80GiB"  # "1KiB" + "GiB" would be no help
        raise ConfigError(f"{flag} {value!r} is only {n} bytes, too little to plan anything; "
                          f"give a size with a unit, e.g. {example}")
    return n


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


@dataclass
class TableRow:
    kv_cache_dtype: str
    bytes_per_token: float
    num_blocks: int
    num_tokens: int
    max_concurrency: list[dict]  # [{"max_model_len": L, "max_concurrency": c}]


@dataclass
class PlanReport:
    model: str
    source: str
    architecture: str
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    budget: MemoryBudget
    plan: KVPlan
    table: list[TableRow]
    warnings: list[str] = field(default_factory=list)
    fatal: bool = False  # max-model-len cannot fit (exit 1 under --strict)
    curves: list[TableRow] = field(default_factory=list)  # the table on a finer grid of lengths, for --plot
    rank_weights: int | None = None  # tensor parallelism: what one of kvserve's ranks holds
    model_dtype: str = "bfloat16"


def curve_lens(table_lens: list[int], block_size: int, longest: int) -> list[int]:
    """Lengths for the plot: powers of two from 256 tokens (or one block) up to the longest, and
    the table's own lengths (concurrency is ~ 1 / length: straight on the plot's log-log axes)."""
    lens = set(table_lens) | {longest}
    n = max(block_size, 256)
    while n < longest:
        lens.add(n)
        n *= 2
    return sorted(lens)


def build_plan_report(args: argparse.Namespace) -> PlanReport:
    spec = resolve_model(args.model or "SmolLM2-135M")
    cfg = spec.config
    dtype = normalize_dtype(spec.dtype if args.dtype == "auto" else args.dtype)
    budget = memory_budget(args, spec)
    budget.lora_bytes, budget.lora_note = lora_charge(args, cfg, dtype, "cuda" if budget.source == "gpu-memory"
                                                      else "cpu")
    if budget.lora_bytes:
        if budget.lora_bytes >= budget.kv_cache_memory:
            raise ConfigError(f"the LoRA adapter slots ({budget.lora_note}: {fmt_bytes(budget.lora_bytes)}) take the "
                              f"whole KV budget of {fmt_bytes(budget.kv_cache_memory)}; give the cache more memory "
                              f"or lower --max-loras / --max-lora-rank")
        budget.kv_cache_memory -= budget.lora_bytes  # what the blocks get, as the engine sizes its pool
    plan = plan_kv(cfg, budget.kv_cache_memory, args.block_size, args.kv_cache_dtype, dtype, args.max_model_len,
                   tensor_parallel_size=args.tensor_parallel_size, mean_context_len=args.mean_context_len,
                   max_num_seqs=args.max_num_seqs)
    lens = sorted({n for n in TABLE_MODEL_LENS if n <= cfg.max_position_embeddings} | {plan.max_model_len})

    def rows(lens: list[int]) -> list[TableRow]:
        out = []
        for kv_dtype in TABLE_KV_DTYPES:
            row = [plan_kv(cfg, budget.kv_cache_memory, args.block_size, kv_dtype, dtype, n,
                           tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs)
                   for n in lens]
            out.append(TableRow(kv_dtype, row[0].bytes_per_token, row[0].num_blocks, row[0].num_tokens,
                                [{"max_model_len": p.max_model_len, "max_concurrency": p.max_concurrency}
                                 for p in row]))
        return out

    report = PlanReport(model=cfg.name, source=spec.source, architecture=cfg.architecture,
                        num_hidden_layers=cfg.num_hidden_layers, num_key_value_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                        budget=budget, plan=plan, table=rows(lens), model_dtype=dtype,
                        rank_weights=(kvserve_rank_weights(spec, dtype, args.tensor_parallel_size)
                                      if args.tensor_parallel_size > 1 else None))
    if getattr(args, "plot", None):
        report.curves = rows(curve_lens(lens, args.block_size, max(cfg.max_position_embeddings, plan.max_model_len)))
    residual = (f" (the {args.kv_cache_dtype} cache's full-precision residual pool takes "
                f"{fmt_bytes(plan.reserved_bytes)} of the budget first, one open block per sequence of "
                f"--max-num-seqs {args.max_num_seqs})" if plan.reserved_bytes else "")
    if not plan.fits:
        report.fatal = True
        if plan.reserved_bytes > plan.kv_cache_memory // 10:  # the residual pool is what crowds blocks out
            fixes = "lower --max-num-seqs"
        else:
            fixes = "use --kv-cache-dtype int4" if plan.reserved_bytes else "use --kv-cache-dtype fp8/int8/int4"
        report.warnings.append(
            f"--max-model-len {plan.max_model_len} does not fit: one such request needs {plan.blocks_per_request} "
            f"blocks ({fmt_bytes(plan.bytes_per_request)}) but only {plan.num_blocks} fit{residual}; the largest "
            f"length that fits is {plan.max_fitting_len} tokens. Lower --max-model-len, give the cache more memory, "
            f"{fixes}, or raise --tensor-parallel-size")
    auto_tokens = next((row.num_tokens for row in report.table if row.kv_cache_dtype == "auto"), None)
    if plan.reserved_bytes and auto_tokens is not None and plan.num_tokens < auto_tokens:
        report.warnings.append(
            f"--kv-cache-dtype {args.kv_cache_dtype} holds {plan.num_tokens} tokens in this budget, fewer than "
            f"auto's {auto_tokens}{residual}; raise --kv-cache-memory or lower --max-num-seqs for "
            f"quantization to pay off")
    if plan.max_model_len > cfg.max_position_embeddings:
        report.warnings.append(f"--max-model-len {plan.max_model_len} exceeds the model's max_position_embeddings "
                               f"({cfg.max_position_embeddings}); the engine will refuse it")
    if plan.max_concurrency_at_mean is not None and plan.max_concurrency_at_mean > args.max_num_seqs:
        report.warnings.append(f"at the mean length the cache holds {plan.max_concurrency_at_mean:.0f} requests, more "
                               f"than --max-num-seqs {args.max_num_seqs}: the scheduler, not KV, is the limit")
    if cfg.sliding_window:
        report.warnings.append(f"the model declares a {cfg.sliding_window}-token sliding window; this plan keeps "
                               "every token's KV (as kvserve does), so it is an upper bound on memory")
    return report


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by plan and analyze: model, memory, parallelism, cache layout."""
    g = p.add_argument_group("model and memory")
    g.add_argument("--model", help="preset, config.json, model directory or .gguf (default: SmolLM2-135M, the embedded model)")
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GiB; the KV budget is what weights and activations leave")
    mem.add_argument("--kv-cache-memory", help="KV budget per GPU, e.g. 4GiB (default 4GiB, the engine's CPU default)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--dtype", default="auto", help="weight dtype: auto (as published), float32, bfloat16, float16")
    g.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="weight quantization; auto: from config.json's quantization_config, else none")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="for the activation estimate")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--activation-reserve", help="non-KV, non-weight memory per GPU, e.g. 2GiB (default: estimated)")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="KV cache capacity planner",
                              description="How many tokens of KV cache fit, and how many concurrent requests that serves.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    add_model_arguments(p)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--mean-context-len", type=int, default=None, help="expected mean prompt+output tokens per request")
    lora = p.add_argument_group("LoRA adapters (their slots are charged before the KV cache, as the engine does)")
    lora.add_argument("--enable-lora", action="store_true")
    lora.add_argument("--max-loras", type=int, default=1, help="adapter slots (default 1, vLLM's)")
    lora.add_argument("--max-lora-rank", type=int, default=16)
    lora.add_argument("--lora-dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"))
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when --max-model-len cannot fit")
    p.add_argument("--plot", metavar="PNG", help="draw max concurrency against --max-model-len for each KV dtype "
                   "(the table's figures on a finer grid of lengths) into a PNG")
    p.set_defaults(func=run)


def format_plan_report(r: PlanReport) -> str:
    p, b = r.plan, r.budget
    kv_dtype = p.kv_cache_dtype if p.kv_cache_dtype != "auto" else f"auto ({p.model_dtype})"
    lines = [f"kvserve plan: {r.model} ({'preset' if r.source == r.model else r.source})",
             f"  {r.architecture}: {r.num_hidden_layers} layers, {r.num_key_value_heads} KV heads "
             f"({p.num_kv_heads_per_gpu} per GPU at TP {p.tensor_parallel_size}), head_dim {r.head_dim}, "
             f"max_position_embeddings {r.max_position_embeddings:,}", "", "Memory per GPU"]
    if b.source == "gpu-memory":
        w = b.weights
        lines += [f"  GPU memory x utilization      {fmt_bytes(b.gpu_memory)} x {b.gpu_memory_utilization} = "
                  f"{fmt_bytes(b.gpu_memory * b.gpu_memory_utilization)}",
                  f"  weights                       -{fmt_bytes(w.bytes_per_gpu)}  ({w.num_params / 1e9:.2f}B params, {w.note})",
                  f"  activation/overhead reserve   -{fmt_bytes(b.activation_reserve)}  ({b.reserve_note})"]
    source = {"gpu-memory": "what is left", "kv-cache-memory": "--kv-cache-memory",
              "default": "default: the engine's CPU budget; set --gpu-memory or --kv-cache-memory"}[b.source]
    if b.lora_bytes:
        lines += [f"  budget                        {fmt_bytes(b.kv_cache_memory + b.lora_bytes)}  ({source})",
                  f"  LoRA adapter slots            -{fmt_bytes(b.lora_bytes)}  ({b.lora_note})"]
        source = "what the slots leave"
    if r.rank_weights is not None:
        lines.append(f"  kvserve weights per rank      {fmt_bytes(r.rank_weights)}  ({r.model_dtype}: projections / "
                     f"{p.tensor_parallel_size}, embedding, lm_head and norms on every rank)")
    lines += [f"  KV cache budget               {fmt_bytes(b.kv_cache_memory)}  ({source})", "",
              f"KV cache (kv-cache-dtype {kv_dtype}, block size {p.block_size})",
              f"  bytes per token               {p.bytes_per_token:,.0f} per GPU"
              + (f" ({p.bytes_per_token * p.tensor_parallel_size:,.0f} across {p.tensor_parallel_size} GPUs)"
                 if p.tensor_parallel_size > 1 else ""),
              f"  bytes per block               {p.bytes_per_block:,} ({fmt_bytes(p.bytes_per_block)})",
              f"  per request (max-model-len)   {fmt_bytes(p.bytes_per_request)} ({p.blocks_per_request:,} blocks for "
              f"{p.max_model_len:,} tokens)",
              f"  blocks that fit               {p.num_blocks:,}",
              f"  tokens that fit               {p.num_tokens:,}",
              f"  max concurrency               {p.max_concurrency:,.2f} requests of {p.max_model_len:,} tokens"]
    if p.max_concurrency_at_mean is not None:
        lines.append(f"  max concurrency at mean       {p.max_concurrency_at_mean:,.2f} requests of {p.mean_context_len:,} tokens")
    lens = [c["max_model_len"] for c in r.table[0].max_concurrency]
    lines += ["", "Max concurrent requests by kv-cache-dtype and max-model-len (same budget)",
              f"  {'kv dtype':<9}{'bytes/token':>12}{'tokens':>13}" + "".join(f"{n:>10,}" for n in lens)]
    for row in r.table:
        lines.append(f"  {row.kv_cache_dtype:<9}{row.bytes_per_token:>12,.0f}{row.num_tokens:>13,}"
                     + "".join(f"{c['max_concurrency']:>10,.1f}" for c in row.max_concurrency))
    lines += [""] + [f"WARNING: {w}" for w in r.warnings]
    return "\n".join(lines).rstrip()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "model_pos", None):
        if args.model and args.model != args.model_pos:
            print(f"kvserve plan: error: model given twice ({args.model_pos!r} and --model {args.model!r})", file=sys.stderr)
            return 2
        args.model = args.model_pos
    try:
        check_writable(args.plot, "--plot")
        report = build_plan_report(args)
    except ConfigError as e:
        print(f"kvserve plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=2) if args.json else format_plan_report(report))
    if args.plot:
        from kvserve.tools.plan_plot import plot_plan
        from kvserve.tools.plotting import PlotUnavailable
        try:
            plot_plan(report, args.plot, max_num_seqs=args.max_num_seqs)
        except PlotUnavailable as e:
            print(f"kvserve plan: {e}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot: {args.plot}")
    return 1 if (args.strict and report.fatal) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers())
    return run(parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
