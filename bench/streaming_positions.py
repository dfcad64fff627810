"""StreamingLLM's positions, measured: keep each cached key's original rotary position (what kvserve
does) or re-index positions within the cache (the StreamingLLM paper: a key's position is its
index among the kept keys, and the query's is the count of kept keys before it).

    python bench/streaming_positions.py          # budgets 256 512 1024 2048, 8,000 tokens

A reference in torch over the engine's own SmolLM2 weights (the embedded GGUF, bf16), not the
engine: it keeps keys un-rotated and rotates them at every chunk with the positions of the mode,
which re-indexing needs (a kept key's position changes at every release) and which the engine's
paged cache, holding keys rotated once at their write, cannot do without rewriting kept blocks
(blocks the prefix cache may share with other requests). Everything else follows the engine's
streaming: the same text as `long_context.py perplexity` (Debian python3.11-doc's Functional
Programming HOWTO), the same 64-token chunks, blocks of 16 released after each chunk when wholly
before the window (sink_tokens 4, window budget - 16), scored the same way. The "original" column
should agree with the engine's streaming rows; the two columns differ only in positions.
Prints a table and writes bench/results/streaming_positions.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from kvserve.model.llama import rope_inv_freq  # noqa: E402
from kvserve.model.loader import load_model  # noqa: E402

TEXT = Path("/usr/share/doc/python3.11/html/_sources/howto/functional.rst.txt")
BS, CHUNK, SINKS = 16, 64, 4


class Reference:
    def __init__(self) -> None:
        loaded = load_model(None, dtype=torch.bfloat16)
        self.c = loaded.config
        self.w = loaded.weights
        self.tok = loaded.tokenizer
        self.inv_freq = rope_inv_freq(self.c)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        v = x.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)
        return self.w[name] * v.to(x.dtype)

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [n, H, D] float32
        f = pos.float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat((f.cos(), f.cos()), -1)[:, None], torch.cat((f.sin(), f.sin()), -1)[:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    @torch.inference_mode()
    def nll(self, ids: list[int], window: int | None, reindex: bool) -> list[float]:
        """Negative log-likelihood of ids[1:], in chunks, with streaming (window None: full cache)."""
        c = self.c
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        T = len(ids)
        K = [torch.empty(T, hkv, d) for _ in range(c.num_hidden_layers)]  # un-rotated, float32 of bf16
        V = [torch.empty(T, hkv, d) for _ in range(c.num_hidden_layers)]
        out = []
        sink_blocks = -(-SINKS // BS)
        for c0 in range(0, T, CHUNK):
            c1 = min(T, c0 + CHUNK)
            n = c1 - c0
            if window is None:
                kept = torch.arange(c0)
            else:  # the blocks streaming still holds when the chunk at c0 runs
                blk = torch.arange(c0) // BS
                kept = torch.nonzero((blk < sink_blocks) | ((blk + 1) * BS > c0 - window)).flatten()
            keys = torch.cat([kept, torch.arange(c0, c1)])
            if reindex:
                k_pos = torch.arange(len(keys))
                q_pos = torch.arange(len(kept), len(keys))
            else:
                k_pos, q_pos = keys, torch.arange(c0, c1)
            visible = keys[None, :] <= torch.arange(c0, c1)[:, None]  # [n, L]
            h = self.w["model.embed_tokens.weight"][torch.tensor(ids[c0:c1])]
            for i in range(c.num_hidden_layers):
                p = f"model.layers.{i}."
                x = self.norm(h, p + "input_layernorm.weight")
                q = (x @ self.w[p + "self_attn.q_proj.weight"].T).float().view(n, hq, d)
                K[i][c0:c1] = (x @ self.w[p + "self_attn.k_proj.weight"].T).float().view(n, hkv, d)
                V[i][c0:c1] = (x @ self.w[p + "self_attn.v_proj.weight"].T).float().view(n, hkv, d)
                k = self.rotate(K[i][keys], k_pos).repeat_interleave(hq // hkv, dim=1)  # [L, hq, d]
                v = V[i][keys].repeat_interleave(hq // hkv, dim=1)
                q = self.rotate(q, q_pos)
                s = torch.einsum("nhd,lhd->hnl", q, k) * d ** -0.5
                a = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
                o = torch.einsum("hnl,lhd->nhd", a, v).reshape(n, hq * d).to(h.dtype)
                h = h + o @ self.w[p + "self_attn.o_proj.weight"].T
                x = self.norm(h, p + "post_attention_layernorm.weight")
                g = x @ self.w[p + "mlp.gate_proj.weight"].T
                u = x @ self.w[p + "mlp.up_proj.weight"].T
                h = h + (F.silu(g) * u) @ self.w[p + "mlp.down_proj.weight"].T
            logits = (self.norm(h, "model.norm.weight") @ self.w["model.embed_tokens.weight"].T).float()
            lp = torch.log_softmax(logits, -1)
            targets = torch.tensor(ids[c0 + 1:c1 + 1])
            out.extend((-lp[torch.arange(len(targets)), targets]).tolist())
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--max-tokens", type=int, default=8000)
    args = ap.parse_args(argv)
    ref = Reference()
    ids = ref.tok.encode(TEXT.read_text())[:args.max_tokens]
    split = 2048

    def ppl(nll: list[float]) -> tuple[float, float]:
        tail = nll[split - 1:]
        return math.exp(sum(nll) / len(nll)), math.exp(sum(tail) / len(tail))

    t = time.perf_counter()
    full = ppl(ref.nll(ids, None, False))
    print(f"full: {full[0]:.3f}, after {split}: {full[1]:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    rows = [{"budget": None, "original": full, "reindexed": full}]
    for b in args.budgets:
        row = {"budget": b}
        for mode in ("original", "reindexed"):
            t = time.perf_counter()
            row[mode] = ppl(ref.nll(ids, b - BS, mode == "reindexed"))
            print(f"streaming {b} {mode}: {row[mode][0]:.3f}, after {split}: {row[mode][1]:.3f} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
        rows.append(row)
    print()
    print(f"| KV budget | original positions | re-indexed | original, after {split} | re-indexed, after {split} |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        o, x = r["original"], r["reindexed"]
        rel = [f"{o[0]:.3f}", f"{x[0]:.3f}", f"{o[1]:.3f}", f"{x[1]:.3f}"] if r["budget"] is None else [
            f"{o[0]:.3f} ({o[0] / full[0] - 1:+.1%})", f"{x[0]:.3f} ({x[0] / full[0] - 1:+.1%})",
            f"{o[1]:.3f} ({o[1] / full[1] - 1:+.1%})", f"{x[1]:.3f} ({x[1] / full[1] - 1:+.1%})"]
        print(f"| {r['budget'] or 'full'} | " + " | ".join(rel) + " |")
    out = HERE / "results" / "streaming_positions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"text": str(TEXT), "tokens": len(ids), "chunk": CHUNK, "block_size": BS,
                               "sink_tokens": SINKS, "split": split, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
