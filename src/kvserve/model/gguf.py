"""GGUF checkpoints: metadata, dequantized weights under HF names, and a ModelConfig.

llama.cpp stores every tensor quantized in blocks (Q4_1, Q8_0, ...) and, for the llama
architecture, with the rows of q/k permuted so that its rotary kernel can rotate adjacent pairs.
kvserve's forward follows the HF layout (rotate-half), so the permutation is undone here once,
at load time, and nothing downstream needs to know the weights came from a GGUF file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.model import weight_codes
from kvserve.model.weight_codes import GGUFBlocks


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF checkpoint of a supported architecture."""


# GGUF architectures kvserve can run, and the ModelConfig.architecture each becomes.
# llama.cpp writes Mistral-7B style models as "llama", so there is no separate mistral entry.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass
class GGUFFile:
    """A parsed GGUF file: scalar/array metadata by key and the reader that owns the tensors."""
    path: Path
    metadata: dict[str, Any]
    reader: Any  # gguf.GGUFReader; kept so tensors are read lazily from the memory map

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]


def read_gguf(path: str | Path) -> GGUFFile:
    """Open and parse a GGUF file; any structural problem becomes one GGUFFormatError line."""
    from gguf import GGUFReader  # imported here: it is only needed for GGUF checkpoints

    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFFormatError(f"cannot read GGUF file {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise GGUFFormatError(
            f"{path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF'); "
            f"pass a .gguf checkpoint or an HF model directory")
    try:
        reader = GGUFReader(path, "r")
        metadata = {name: _field_value(field) for name, field in reader.fields.items()}
        # Touch every tensor's extent so a truncated file fails here, not mid-forward.
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} extends past the end of the file")
    except GGUFFormatError:
        raise
    except Exception as e:  # the reader raises assorted ValueError/IndexError/struct errors
        raise GGUFFormatError(
            f"{path} is a corrupt or truncated GGUF file ({type(e).__name__}: {e}); re-download it") from None
    return GGUFFile(path=path, metadata=metadata, reader=reader)


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, (float, np.floating)):
        # Metadata floats are float32: 1e-5 arrives as 9.999999747e-06. Print-and-parse at float32
        # precision gives back the number the config author wrote.
        value = float(str(np.float32(value)))
    return value


def config_from_gguf(gguf_file: GGUFFile) -> ModelConfig:
    """ModelConfig from the `{arch}.*` keys llama.cpp writes."""
    arch = gguf_file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFFormatError(
            f"GGUF architecture {arch!r} is not supported; kvserve reads "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} GGUF files")
    md = gguf_file.metadata

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in md:
            if required:
                raise GGUFFormatError(f"{gguf_file.path} lacks the GGUF metadata key {full!r}; the file is incomplete")
            return default
        return md[full]

    names = set(gguf_file.tensor_names())
    if "rope_freqs.weight" in names:
        raise GGUFFormatError(
            f"{gguf_file.path} carries rope_freqs (llama3-style rope scaling baked into a tensor), which kvserve's "
            f"GGUF reader does not support; load the HF checkpoint directory instead")
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise GGUFFormatError(
            f"{gguf_file.path} uses rope scaling {scaling_type!r}, which kvserve's GGUF reader does not support; "
            f"load the HF checkpoint directory instead")

    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = key("attention.head_count_kv", heads)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab_size is None:
        raise GGUFFormatError(f"{gguf_file.path} states no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    eos = md.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_hidden_layers=int(key("block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=None,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        sliding_window=None,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        name=str(md.get("general.name") or gguf_file.path.stem),
    )


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF name (e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise GGUFFormatError(f"unexpected GGUF tensor {gguf_name!r}; kvserve knows the llama/qwen2 tensor set only")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def unpermute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf q/k permutation.

    The converter reorders each head's rows from [first half | second half] (HF rotate-half) to
    interleaved pairs (x0, x_{d/2}, x1, x_{d/2+1}, ...). Viewing each head as (d/2, 2) and
    transposing to (2, d/2) restores the halves.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; numpy (and HF) list them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def _restore_rows(name: str, w: torch.Tensor, config: ModelConfig, permuted: bool) -> torch.Tensor:
    if permuted and ".self_attn.q_proj." in name:
        return unpermute_rotary_rows(w, config.num_attention_heads)
    if permuted and ".self_attn.k_proj." in name:
        return unpermute_rotary_rows(w, config.num_key_value_heads)
    return w


def codes_from_gguf(gguf_file: GGUFFile, config: ModelConfig) -> dict[str, GGUFBlocks]:
    """The 2-D tensors stored in a block format the GEMM can expand itself (Q4_1, Q8_0), as their
    raw blocks under HF names, rows restored as for the dequantized weights."""
    permuted = gguf_file.architecture == "llama"
    codes: dict[str, GGUFBlocks] = {}
    for tensor in gguf_file.reader.tensors:
        qtype = tensor.tensor_type.name
        if not weight_codes.supported(qtype) or len(tensor.shape) != 2:
            continue
        name = hf_tensor_name(tensor.name)
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True).reshape(rows, -1))
        codes[name] = GGUFBlocks(qtype, _restore_rows(name, blocks, config, permuted), cols)
    return codes


def weights_from_gguf(gguf_file: GGUFFile, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, renamed to HF, q/k rows restored, then cast to `dtype`."""
    permuted = gguf_file.architecture == "llama"  # llama.cpp permutes only for the llama arch
    weights: dict[str, torch.Tensor] = {}
    for tensor in gguf_file.reader.tensors:
        name = hf_tensor_name(tensor.name)
        try:
            w = torch.from_numpy(np.array(_dequantize(tensor), copy=True))
        except Exception as e:
            raise GGUFFormatError(
                f"cannot dequantize GGUF tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from None
        weights[name] = _restore_rows(name, w, config, permuted).to(dtype)
    return weights
