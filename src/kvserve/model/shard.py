"""One tensor-parallel rank's share of a decoder's weights (Megatron's split, as vLLM's).

Column-parallel (each rank a slice of the output features): q, k, v, gate and up; row-parallel
(a slice of the input features, the partial products summed by an all-reduce): o and down. A
rank holds heads_per_rank query heads and the KV heads they read: KV heads split when the rank
count divides them, and are replicated (each KV head held by tp / num_kv_heads ranks) when the
KV heads divide the rank count, as vLLM does. The embedding, norms and lm_head stay whole on
every rank: the vocabulary split would need a gather of the logits for one matrix of the model.

A GGUF checkpoint's codes (model/weight_codes.py) split the same way: whole rows of blocks for a
column-parallel projection; for a row-parallel one, columns in whole 32-weight blocks, so each
rank's input width must be a multiple of 32. A rank's fused q/k/v or gate/up rows must also fill
the AMX kernel's 64-row panels (model/linear.py). A projection whose share fails either keeps no
codes (codes_split_problems says which and why): with --quantization gguf the engine refuses to
start, unset it runs that projection on the rank's bf16 shard and logs why.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.model.weight_codes import BLOCK, GGUFBlocks


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """KV heads each rank holds; ConfigError (naming both numbers) where the split is impossible."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1 (got {tp})")
    if hq % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {hq} attention heads; "
                          f"pick a divisor of {hq}")
    if hkv % tp and tp % hkv:
        raise ConfigError(f"--tensor-parallel-size {tp} and the model's {hkv} KV heads: one must divide the other "
                          f"(KV heads split across ranks, or each held by several); pick a divisor or a multiple "
                          f"of {hkv} that divides {hq}")
    if cfg.intermediate_size % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's MLP width "
                          f"{cfg.intermediate_size}; pick a divisor of it")
    return max(1, hkv // tp)


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model as one rank sees it: its heads and its slice of the MLP (hidden size and vocabulary whole)."""
    if tp == 1:
        return cfg
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                   num_key_value_heads=kv_heads_per_rank(cfg, tp), intermediate_size=cfg.intermediate_size // tp)


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    # A copy: a view would keep the whole matrix alive on every rank.
    return t[start:start + count].clone()


def _row_parallel_width(proj: str, cfg: ModelConfig, tp: int) -> int:
    """The input features of a row-parallel projection each rank holds."""
    return cfg.num_attention_heads // tp * cfg.head_dim if proj == "o_proj" else cfg.intermediate_size // tp


def _slice(proj: str, w: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s part of a projection's matrix: rows (outputs) of a column-parallel one,
    columns (inputs) of a row-parallel one (o, down); a 1-D tensor is a bias of the former."""
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    q_local, kv_local = cfg.num_attention_heads // tp, kv_heads_per_rank(cfg, tp)
    inter = cfg.intermediate_size // tp
    if proj == "q_proj":
        return _rows(w, rank * q_local * d, q_local * d)
    if proj in ("k_proj", "v_proj"):
        # The KV heads this rank's query heads read: its own slice, or (replicated) the one its group shares.
        kv_first = rank * kv_local if hkv >= tp else rank // (tp // hkv)
        return _rows(w, kv_first * d, kv_local * d)
    if proj in ("gate_proj", "up_proj"):
        return _rows(w, rank * inter, inter)
    width = q_local * d if proj == "o_proj" else inter
    return w[:, rank * width:(rank + 1) * width].contiguous()


_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _projection(name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'q_proj' ('' for a name of fewer parts)."""
    part = name.rsplit(".", 2)
    return part[-2] if len(part) == 3 else ""


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int
                  ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors under the same HF names, for a LlamaModel built from rank_config."""
    if tp == 1:
        return weights
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        proj = _projection(name)
        if proj in ROW_PARALLEL and name.endswith(".bias"):
            if rank == 0:  # added once, to the all-reduced sum
                out[name] = w
        elif proj in _SPLIT:
            out[name] = _slice(proj, w, cfg, rank, tp)
        else:
            out[name] = w
    return out


# The fused projections (model/llama.py) whose rank shares must fill the codes kernel's panels.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PANEL_ROWS = 64  # model/linear.py packs (and reads codes) only for a multiple of 64 output rows


def codes_split_problems(cfg: ModelConfig, tp: int, codes: dict[str, GGUFBlocks]) -> dict[str, str]:
    """The projections of `codes` (HF weight names) whose rank share cannot be read as codes
    although the whole matrix could, each with why; empty at TP=1 or where every split fits."""
    if tp == 1 or not codes:
        return {}
    rank_cfg = rank_config(cfg, tp)
    problems: dict[str, str] = {}
    for proj in ROW_PARALLEL:
        width = _row_parallel_width(proj, cfg, tp)
        whole = cfg.num_attention_heads * cfg.head_dim if proj == "o_proj" else cfg.intermediate_size
        if width % BLOCK and any(_projection(n) == proj for n in codes):
            problems[proj] = (f"{proj}'s {whole} inputs split {tp} ways are {width} per rank, not a whole number "
                              f"of {BLOCK}-weight GGUF blocks")
    d = cfg.head_dim
    rows = {"qkv_proj": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d,
                         (rank_cfg.num_attention_heads + 2 * rank_cfg.num_key_value_heads) * d),
            "gate_up_proj": (2 * cfg.intermediate_size, 2 * rank_cfg.intermediate_size)}
    for fused, (whole, local) in rows.items():
        if whole % _PANEL_ROWS == 0 and local % _PANEL_ROWS and any(_projection(n) in _FUSED[fused] for n in codes):
            problems[fused] = (f"{fused}'s {whole} output rows split {tp} ways are {local} per rank, not a multiple "
                               f"of the {_PANEL_ROWS}-row panels the GGUF codes kernel reads")
    return problems


def _unsplit(problems: dict[str, str]) -> set[str]:
    """The projection names (q_proj, ...) whose codes a rank does not keep."""
    out = set()
    for what in problems:
        out.update(_FUSED[what] if what in _FUSED else (what,))
    return out


def shard_codes(codes: dict[str, GGUFBlocks], cfg: ModelConfig, rank: int, tp: int) -> dict[str, GGUFBlocks]:
    """Rank `rank`'s GGUF codes, split as shard_weights splits the dequantized matrices (whole
    32-weight blocks along the inputs of o and down); projections codes_split_problems names are
    left out, so they run on the rank's bf16 shard."""
    if tp == 1:
        return codes
    dropped = _unsplit(codes_split_problems(cfg, tp, codes))
    out: dict[str, GGUFBlocks] = {}
    for name, c in codes.items():
        proj = _projection(name)
        if proj in dropped:
            continue
        if proj in ROW_PARALLEL:  # whole blocks of the rank's input columns, bytes per block along a row
            width, nbytes = _row_parallel_width(proj, cfg, tp), c.blocks.shape[1] // (c.cols // BLOCK)
            span = width // BLOCK * nbytes
            out[name] = GGUFBlocks(c.qtype, c.blocks[:, rank * span:(rank + 1) * span].contiguous(), width)
        elif proj in _SPLIT:
            out[name] = GGUFBlocks(c.qtype, _slice(proj, c.blocks, cfg, rank, tp), c.cols)
        else:
            out[name] = c
    return out


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig, rank: int, tp: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA pair (A `[r, in]`, B `[out, r]`) split as its projection is: B's rows for a
    column-parallel projection (A whole), A's columns for a row-parallel one (B whole: each rank's
    partial delta is summed by the projection's own all-reduce)."""
    if tp == 1:
        return a, b
    if module in ROW_PARALLEL:
        return _slice(module, a, cfg, rank, tp), b
    return a, _slice(module, b, cfg, rank, tp)
