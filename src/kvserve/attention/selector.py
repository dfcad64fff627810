"""`--attention-backend` -> the backend that runs attention for every layer."""
from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.attention.triton import TritonAttentionBackend, triton_support
from kvserve.config import ConfigError, ModelConfig

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def select_attention_backend(name: str, model_config: ModelConfig, device: torch.device | str,
                             cascade: bool = True) -> AttentionBackend:
    """`--attention-backend` -> backend instance. "auto": triton on a CUDA device when triton is
    installed, torch otherwise. `cascade` (off: --disable-cascade-attn) applies to the torch
    backend's CPU kernel; the Triton kernels have no cascade path yet."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                          f"(got {name!r})")
    c = model_config
    args = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim ** -0.5)
    if name == "auto":
        dev = torch.device(device)
        use_triton = dev.type == "cuda" and triton_support(dev).mode == "cuda"
        name = "triton" if use_triton else "torch"
    if name == "torch":
        return CPUAttentionBackend(*args, sliding_window=c.sliding_window, cascade=cascade)
    return TritonAttentionBackend(*args, sliding_window=c.sliding_window, device=device)
