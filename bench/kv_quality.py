"""What quantized KV costs in quality, and what it buys in memory, on the embedded SmolLM2-135M.

For every KV variant, against float32 KV (`auto`) on the same weights, through the engine's own
path (LlamaModel.forward -> CPUAttentionBackend -> the paged KV cache, scattered block ids):
  - perplexity of bench/data/lighthouse_keepers.txt (~4.4k tokens) and its relative change,
  - mean KL(P_float32 || P_quant) of the next-token distributions over the same positions,
  - greedy agreement: 16 prompts x 256 new tokens; fraction identical, mean first divergence,
  - KV bytes per token and max concurrent sequences in 1 GiB at max_model_len 8192 and 2048.

The text is fed as chunked prefill: a first chunk of one block, then `--chunk` tokens at a time
(a multiple of the block size). A chunk that starts after position 0 writes its K/V and then
gathers *all* its keys back from the cache, its own blocks included, so every token after the
first block attends only to quantized KV. (One prefill of the whole text would measure nothing:
a chunk starting at 0 attends to the fresh K/V and never reads the cache.) Greedy decoding is
where KIVI's residual shows: there the newest, still-open block is read in full precision.

    python bench/kv_quality.py            # full run (~30 min of 2 idle CPU cores)
    python bench/kv_quality.py --quick    # 1024 text tokens, 4 prompts x 64 tokens
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.attention.base import build_attention_metadata
from kvserve.cache.base import KVCache
from kvserve.cache.factory import kv_cache_class
from kvserve.cache.quantized import QuantizedKVCache
from kvserve.config import ModelConfig
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "lighthouse_keepers.txt"
RESULTS = HERE / "results" / "kv_quality.json"
GIB = 1 << 30

PROMPTS = [
    "Explain how a Fresnel lens works in simple terms.",
    "Write a short story about a cat who learns to swim.",
    "What are the main causes of the seasons on Earth?",
    "Give three tips for writing clear technical documentation.",
    "Describe the water cycle to a ten-year-old.",
    "Why do leaves change colour in autumn?",
    "Write a polite email declining a meeting invitation.",
    "What is the difference between weather and climate?",
    "List some healthy breakfast ideas and explain why they are good.",
    "How does a bicycle stay upright while moving?",
    "Summarize the plot of a classic adventure novel of your choice.",
    "What should I pack for a three-day hiking trip?",
    "Explain what a hash table is and when to use one.",
    "Write a haiku about the ocean, then explain its imagery.",
    "How do vaccines help the immune system?",
    "Describe a busy market in a small town on a Saturday morning.",
]


@dataclass(frozen=True)
class Variant:
    label: str
    kv_cache_dtype: str
    options: dict = field(default_factory=dict)  # extra constructor arguments of the cache class


VARIANTS = [
    Variant("auto (float32)", "auto"),
    Variant("fp8_e4m3", "fp8_e4m3"),  # centered keys, per-head scales (the default)
    Variant("fp8_e4m3 uncentered", "fp8_e4m3", {"center_keys": False}),
    Variant("fp8_e4m3 per-block", "fp8_e4m3", {"center_keys": False, "scale_granularity": "tensor"}),
    Variant("fp8_e5m2", "fp8_e5m2"),
    Variant("int8 g32", "int8"),  # float16 scales/zeros, groups of 32 (the default)
    Variant("int4", "int4"),  # compact: e4m3 scales/zeros, symmetric value groups of 64 (the default)
    Variant("int4 fp16-meta g32", "int4", {"group_size": 32, "compact": False}),
    Variant("int4 no-residual", "int4", {"residual": False}),
    Variant("int8 g32 no-residual", "int8", {"residual": False}),
]


class PagedSession:
    """One KV cache driven by the model forward; sequences get scattered block tables."""

    def __init__(self, model: LlamaModel, cfg: ModelConfig, variant: Variant, num_blocks: int,
                 block_size: int, num_seqs: int) -> None:
        cls = kv_cache_class(variant.kv_cache_dtype)
        kwargs = dict(variant.options)
        if issubclass(cls, QuantizedKVCache):
            kwargs.setdefault("num_residual_blocks", max(num_seqs, 1))
        self.cache: KVCache = cls(cfg, num_blocks=num_blocks, block_size=block_size, dtype=model.dtype,
                                  device=model.device, kv_cache_dtype=variant.kv_cache_dtype, **kwargs)
        self.model, self.block_size = model, block_size
        # A fixed permutation scatters every sequence's blocks over the whole pool.
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        per_seq = num_blocks // max(num_seqs, 1)
        self.tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)]

    def step(self, seq_ids: list[int], starts: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Run one forward over chunks of several sequences -> float32 logits of every token."""
        meta = build_attention_metadata(starts, [len(t) for t in tokens], [self.tables[i] for i in seq_ids],
                                        self.block_size, self.model.device)
        ids = torch.tensor([t for chunk in tokens for t in chunk], device=self.model.device)
        hidden = self.model.forward(ids, meta.positions, meta, self.cache)
        return self.model.compute_logits(hidden)


@dataclass
class TextMetrics:
    perplexity: float
    mean_kl: float
    max_kl: float
    num_tokens: int


def text_metrics(model, cfg, variants, ids: list[int], block_size: int, chunk: int) -> dict[str, TextMetrics]:
    """Perplexity and KL for all variants in lockstep (no variant's logits need storing)."""
    n_blocks = -(-len(ids) // block_size) + 1
    sessions = {v.label: PagedSession(model, cfg, v, n_blocks, block_size, 1) for v in variants}
    ref_label = variants[0].label
    nll = {k: 0.0 for k in sessions}
    kl_sum = {k: 0.0 for k in sessions}
    kl_max = {k: 0.0 for k in sessions}
    count = 0
    if chunk % block_size:
        raise SystemExit(f"--chunk {chunk} must be a multiple of --block-size {block_size}")
    bounds = [0, *range(block_size, len(ids) - 1, chunk), len(ids) - 1]
    for start, end in zip(bounds, bounds[1:]):
        toks = ids[start:end + 1] if end == len(ids) - 1 else ids[start:end]
        targets = torch.tensor(ids[start + 1:start + 1 + len(toks)])
        valid = targets.numel()  # the last chunk's final token has no target
        ref_lp = None
        for label, sess in sessions.items():
            lp = torch.log_softmax(sess.step([0], [start], [toks])[:valid], dim=-1)
            nll[label] += float(-lp.gather(1, targets[:, None]).sum())
            if label == ref_label:
                ref_lp = lp
            else:
                kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
                kl_sum[label] += float(kl.sum())
                kl_max[label] = max(kl_max[label], float(kl.max()))
        count += valid
    return {k: TextMetrics(math.exp(nll[k] / count), kl_sum[k] / count, kl_max[k], count) for k in sessions}


def greedy(model, cfg, variant, prompts: list[list[int]], new_tokens: int, block_size: int) -> list[list[int]]:
    """Batched greedy decoding of every prompt: one prefill step, then one decode step per token."""
    longest = max(len(p) for p in prompts) + new_tokens
    per_seq = -(-longest // block_size) + 1
    sess = PagedSession(model, cfg, variant, per_seq * len(prompts), block_size, len(prompts))
    seqs = list(range(len(prompts)))
    logits = sess.step(seqs, [0] * len(prompts), prompts)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    out = [[t] for t in logits[last].argmax(-1).tolist()]
    for _ in range(new_tokens - 1):
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]
        logits = sess.step(seqs, starts, [[o[-1]] for o in out])
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    return sum(f == len(r) for f, r in zip(firsts, ref)) / len(ref), sum(firsts) / len(firsts)


def memory_row(cfg: ModelConfig, variant: Variant, block_size: int, dtype: torch.dtype) -> dict:
    cls = kv_cache_class(variant.kv_cache_dtype)
    probe = cls(cfg, num_blocks=1, block_size=block_size, dtype=dtype,
                kv_cache_dtype=variant.kv_cache_dtype, **variant.options)
    bpb = probe.block_bytes if isinstance(probe, QuantizedKVCache) else cls.bytes_per_block(
        cfg, block_size, "auto", dtype)
    # Each running sequence of a staged cache also holds one full-precision residual block.
    residual = (probe.residual_pool_bytes // probe.num_residual_blocks
                if isinstance(probe, QuantizedKVCache) and probe.staged else 0)
    row = {"bytes_per_block": bpb, "kv_bytes_per_token": bpb / block_size,
           "residual_bytes_per_seq": residual}
    for max_len in (8192, 2048):
        per_seq = -(-max_len // block_size) * bpb + residual
        row[f"max_concurrency_1GiB_{max_len}"] = GIB // per_seq
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk for the text (multiple of block size)")
    ap.add_argument("--max-text-tokens", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", help="labels of variants to run (auto is always run)")
    ap.add_argument("--quick", action="store_true", help="1024 text tokens, 4 prompts x 64 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.max_text_tokens, args.num_prompts, args.new_tokens = 1024, 4, 64
    torch.set_num_threads(args.threads)
    variants = [v for v in VARIANTS if v.kv_cache_dtype == "auto" or not args.only or v.label in args.only]

    t0 = time.time()
    loaded = load_model(None, torch.float32)
    cfg, tok = loaded.config, loaded.tokenizer
    model = LlamaModel(cfg, loaded.weights, torch.float32, "cpu")
    ids = tok.encode(TEXT.read_text())[:args.max_text_tokens]
    print(f"model {cfg.name}: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} kv heads x "
          f"{cfg.head_dim}; text {len(ids)} tokens; loaded in {time.time() - t0:.0f}s", flush=True)

    t = time.time()
    text = text_metrics(model, cfg, variants, ids, args.block_size, args.chunk)
    print(f"text metrics: {time.time() - t:.0f}s", flush=True)

    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS[:args.num_prompts]]
    gens = {}
    for v in variants:
        t = time.time()
        gens[v.label] = greedy(model, cfg, v, prompts, args.new_tokens, args.block_size)
        print(f"greedy {v.label}: {time.time() - t:.0f}s", flush=True)

    ref = variants[0].label
    rows = []
    for v in variants:
        m = text[v.label]
        same, first = agreement(gens[ref], gens[v.label])
        rows.append({"label": v.label, "kv_cache_dtype": v.kv_cache_dtype, "options": v.options,
                     "perplexity": m.perplexity,
                     "perplexity_rel_change": m.perplexity / text[ref].perplexity - 1,
                     "mean_kl": m.mean_kl, "max_kl": m.max_kl,
                     "greedy_identical_fraction": same, "greedy_mean_first_divergence": first,
                     **memory_row(cfg, v, args.block_size, torch.float32),
                     "bf16_model": memory_row(cfg, v, args.block_size, torch.bfloat16)})

    hdr = (f"{'kv dtype':<22}{'ppl':>8}{'dppl':>8}{'mean KL':>10}{'same':>6}{'1st div':>8}"
           f"{'B/tok':>8}{'conc8k':>7}{'conc2k':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['label']:<22}{r['perplexity']:>8.3f}{100 * r['perplexity_rel_change']:>7.2f}%"
              f"{r['mean_kl']:>10.5f}{r['greedy_identical_fraction']:>6.2f}{r['greedy_mean_first_divergence']:>8.1f}"
              f"{r['kv_bytes_per_token']:>8.0f}{r['max_concurrency_1GiB_8192']:>7}{r['max_concurrency_1GiB_2048']:>7}")
    print(f"(B/tok: KV bytes per token, all {cfg.num_hidden_layers} layers, float32 model; conc: max "
          f"sequences in 1 GiB at max_model_len 8192 / 2048, one residual block per sequence counted)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": cfg.name, "text": str(TEXT.relative_to(HERE.parent)), "text_tokens": len(ids),
        "block_size": args.block_size, "chunk": args.chunk,
        "num_prompts": len(prompts), "new_tokens": args.new_tokens, "variants": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
