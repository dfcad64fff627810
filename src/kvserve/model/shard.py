"""One tensor-parallel rank's share of a decoder's weights (Megatron's split, as vLLM's).

Column-parallel (each rank a slice of the output features): q, k, v, gate and up; row-parallel
(a slice of the input features, the partial products summed by an all-reduce): o and down. A
rank holds heads_per_rank query heads and the KV heads they read: KV heads split when the rank
count divides them, and are replicated (each KV head held by tp / num_kv_heads ranks) when the
KV heads divide the rank count, as vLLM does. The embedding, norms and lm_head stay whole on
every rank: the vocabulary split would need a gather of the logits for one matrix of the model.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.config import ConfigError, ModelConfig


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


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int
                  ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors under the same HF names, for a LlamaModel built from rank_config."""
    if tp == 1:
        return weights
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        part = name.rsplit(".", 2)
        proj = part[-2] if len(part) == 3 else ""
        if proj in ROW_PARALLEL and name.endswith(".bias"):
            if rank == 0:  # added once, to the all-reduced sum
                out[name] = w
        elif proj in _SPLIT:
            out[name] = _slice(proj, w, cfg, rank, tp)
        else:
            out[name] = w
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
