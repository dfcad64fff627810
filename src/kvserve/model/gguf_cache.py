"""A disk cache of dequantized GGUF checkpoints.

Reading a GGUF's metadata (49k-token vocabularies, 49k merges) and dequantizing every tensor takes
tens of seconds in Python; loading the same weights back from safetensors takes about one. The
first load of a file stores its float32 weights, the raw blocks of the tensors the GEMM can read
as codes (model/weight_codes.py), ModelConfig and tokenizer under
`$KVSERVE_CACHE_DIR` (default ~/.cache/kvserve), keyed by the file's path, size and mtime, so an
edited or replaced file is never served stale. A cache that cannot be written is skipped with a
warning: it only ever saves time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvserve import envs
from kvserve.config import ModelConfig
from kvserve.model.weight_codes import GGUFBlocks

logger = logging.getLogger(__name__)

_FORMAT = "kvserve-gguf-cache-v2"


def cache_root() -> Path:
    return Path(envs.KVSERVE_CACHE_DIR)


def entry_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{_FORMAT}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return cache_root() / "gguf" / key


def _codes_key(name: str, codes: GGUFBlocks) -> str:
    return f"{name}|{codes.qtype}|{codes.cols}"


def load_cached(gguf_path: Path):
    """(config, float32 weights, codes, tokenizer) from the cache, or None."""
    from safetensors.torch import load_file

    from kvserve.model.tokenizer import Tokenizer

    d = entry_dir(gguf_path)
    if not (d / "complete").is_file():
        return None
    try:
        config = ModelConfig(**json.loads((d / "model_config.json").read_text()))
        weights = load_file(str(d / "model.safetensors"))
        codes = {}
        for key, blocks in load_file(str(d / "codes.safetensors")).items():
            name, qtype, cols = key.split("|")
            codes[name] = GGUFBlocks(qtype, blocks, int(cols))
        tokenizer = Tokenizer.from_pretrained(d, extra_eos_token_ids=config.eos_token_ids)
    except Exception as e:  # a damaged entry is a miss; it is rebuilt below
        logger.warning("ignoring damaged GGUF cache entry %s (%s)", d, e)
        shutil.rmtree(d, ignore_errors=True)
        return None
    return config, weights, codes, tokenizer


def store(gguf_path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], codes: dict[str, GGUFBlocks],
          tokenizer) -> None:
    from safetensors.torch import save_file

    d = entry_dir(gguf_path)
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=".tmp-"))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        save_file({_codes_key(k, c): c.blocks.contiguous() for k, c in codes.items()}, str(tmp / "codes.safetensors"))
        (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))
        tokenizer.save_pretrained(tmp)
        (tmp / "complete").write_text(str(gguf_path))
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
    except OSError as e:
        logger.warning("could not write the GGUF cache under %s (%s); set KVSERVE_CACHE_DIR to a "
                       "writable directory to make later loads fast", d.parent, e)
        shutil.rmtree(locals().get("tmp", d / "nonexistent"), ignore_errors=True)
