"""A random checkpoint with the embedded model's shapes, for speed measurements where the
embedded GGUF cannot go (a GPU machine without a package registry; the GGUF is 98 MB).

    python bench/random_checkpoint.py DIR --no-weights   # here: config.json + tokenizer files
    python bench/random_checkpoint.py DIR                # there: adds random bf16 model.safetensors

Step one needs the embedded model (its config and tokenizer); step two needs only torch and
safetensors and reads DIR/config.json. A decode step's cost depends on the shapes, not on the
weights' values, so the timings hold for SmolLM2-135M-Instruct itself.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def write_skeleton(directory: Path) -> None:
    from kvserve.model.loader import hf_config_dict, load_model

    loaded = load_model(None, dtype=torch.bfloat16)
    cfg = hf_config_dict(loaded.config)
    cfg["torch_dtype"] = "bfloat16"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    loaded.tokenizer.save_pretrained(directory)


def write_weights(directory: Path, seed: int) -> None:
    from safetensors.torch import save_file

    c = json.loads((directory / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (0.02 * torch.randn(rows, cols, generator=gen)).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": mat(c["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not c.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(c["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(heads * d, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, heads * d)
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(w, str(directory / "model.safetensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--no-weights", action="store_true", help="write only config.json and the tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.directory / "config.json").exists():
        write_skeleton(args.directory)
    if not args.no_weights:
        write_weights(args.directory, args.seed)
    print(f"wrote {args.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
