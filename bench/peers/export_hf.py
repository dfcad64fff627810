"""Write the embedded SmolLM2 GGUF as an HF directory (config.json, model.safetensors, tokenizer)
so peers that cannot read GGUF (vLLM) serve exactly the weights kvserve serves.

    python bench/peers/export_hf.py [--out bench/.venvs/smollm2-hf] [--dtype float32] [--verify]

Runs in kvserve's own environment (it uses kvserve's loader: Q4_1 dequantisation and the undo of
llama.cpp's Q/K row permutation). Idempotent: a directory already written from the same GGUF
(same path, size and mtime, recorded in kvserve_export.json) is left as is.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvserve.model.loader import embedded_model_path, hf_config_dict, load_hf_directory, load_model  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / ".venvs" / "smollm2-hf"
STAMP = "kvserve_export.json"


def hf_config(c, dtype: torch.dtype) -> dict:
    return {**hf_config_dict(c), "torch_dtype": str(dtype).replace("torch.", "")}


def source_stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"source": str(gguf), "size": st.st_size, "mtime": st.st_mtime}


def export(out: Path, dtype: torch.dtype) -> Path:
    from safetensors.torch import save_file

    gguf = embedded_model_path()
    stamp = source_stamp(gguf) | {"dtype": str(dtype)}
    stamp_file = out / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        print(f"{out} already holds {gguf.name} ({dtype}); nothing to do")
        return out
    loaded = load_model(None, torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.to(dtype).contiguous() for name, t in loaded.weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(loaded.config, dtype), indent=2))
    gen = {"bos_token_id": loaded.config.bos_token_id, "eos_token_id": loaded.config.eos_token_ids}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    loaded.tokenizer.save_pretrained(out)
    stamp_file.write_text(json.dumps(stamp, indent=2))
    print(f"wrote {out} ({len(weights)} tensors, {dtype}) from {gguf}")
    return out


def verify(out: Path) -> None:
    """The directory must load back through kvserve's HF path to the same tensors as the GGUF."""
    ref = load_model(None, torch.float32)
    back = load_hf_directory(out, torch.float32)
    if set(ref.weights) != set(back.weights):
        raise SystemExit(f"weight names differ: {sorted(set(ref.weights) ^ set(back.weights))[:5]}")
    worst = max((ref.weights[k] - back.weights[k]).abs().max().item() for k in ref.weights)
    text = "The capital of France is"
    if ref.tokenizer.encode(text) != back.tokenizer.encode(text):
        raise SystemExit("tokenizer round trip differs")
    print(f"verified {out}: {len(ref.weights)} tensors, max |diff| {worst:.3g}, tokenizer identical")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="stored dtype; the peer casts to its own --dtype at load")
    ap.add_argument("--verify", action="store_true", help="reload through kvserve's HF loader and compare")
    args = ap.parse_args(argv)
    out = export(args.out, getattr(torch, args.dtype))
    if args.verify:
        verify(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
