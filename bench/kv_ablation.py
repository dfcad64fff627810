"""Perplexity ablation of KV block encodings (fake quantization through the real residual pool).

Each variant is a function `encode(layer, name, x) -> x'` applied to whole sealed blocks
`[nb, block_size, H, D]` (name is "k" or "v"); the open block stays full precision exactly as in
kvserve.cache.quantized. Only perplexity/KL of bench/kv_quality.py's text metric is computed
(no greedy runs), so a variant costs one forward over the text.

    python bench/kv_ablation.py --tokens 1024 fp8 fp8_k_only fp8_v_only fp8_center_k
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quality  # noqa: E402

from kvserve.cache import quantizers as quant  # noqa: E402
from kvserve.cache.quantized import QuantizedKVCache  # noqa: E402


def fp8(x, kind="fp8_e4m3", dims=(1, 2, 3)):
    return quant.dequantize_fp8(quant.quantize_fp8(x, kind, reduce_dims=dims))


def center(x, meta_dtype=torch.bfloat16):
    """Per block, head and channel mean over the block's tokens, stored in meta_dtype."""
    return x.float().mean(1, keepdim=True).to(meta_dtype).float()


def fp8_centered(x, meta_dtype=torch.bfloat16, dims=(1, 2, 3)):
    mu = center(x, meta_dtype)
    return fp8(x.float() - mu, dims=dims) + mu


def fp8_center_chan_p2(x):
    """Centered keys (e4m3 mean) with a power-of-two scale per block, head and channel."""
    mu = center(x, torch.float8_e4m3fn)
    c = x.float() - mu
    amax = c.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448.0))), torch.ones_like(amax))
    return (c / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale + mu


def int_sym(x, group, scale_fmt="e4m3"):
    """Symmetric int4 groups along the last dim: codes in [-8, 7], one (outward) scale per group."""
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    amax = g.abs().amax(-1, keepdim=True)
    scale = _round(amax / 7.5, scale_fmt, "up").clamp_min(1e-12)
    return ((g / scale).round().clamp(-8, 7) * scale).flatten(-2)


def fp8_static(scales):
    def enc(layer, name, x):
        return quant.dequantize_fp8(quant.quantize_fp8(x, "fp8_e4m3", scale=scales[(layer, name)]))
    return enc


def int_groups(x, bits, group, axis):
    return quant.dequantize_groups(quant.quantize_groups(x, bits, group, axis))


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def rotated(fn):
    def enc(x):
        h = hadamard(x.shape[-1])
        return fn(x.float() @ h) @ h.T
    return enc


def int_meta(x, bits, group, axis, scale_fmt, zero_fmt):
    """Asymmetric min/max groups with scale/zero stored in reduced formats, rounded outward
    (zero down, scale up) so the stored pair still covers the group; codes use the stored pair."""
    qmax = (1 << bits) - 1
    axis %= x.dim()
    xf = x.float()
    n = xf.shape[axis]
    g = xf.unflatten(axis, (n // group, group))
    mn, mx = g.amin(axis + 1, keepdim=True), g.amax(axis + 1, keepdim=True)
    zero = _round(mn, zero_fmt, "down")
    scale = _round((mx - zero) / qmax, scale_fmt, "up").clamp_min(1e-12)
    if scale_fmt != "fp32":
        # an outward-rounded scale might still miss mx after zero was rounded: re-check
        scale = torch.maximum(scale, _round((mx - zero) / qmax, scale_fmt, "up"))
    codes = ((g - zero) / scale).round().clamp(0, qmax)
    return (codes * scale + zero).flatten(axis, axis + 1)


def _round(t, fmt, direction):
    if fmt == "fp32":
        return t
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
          "e5m2": torch.float8_e5m2}[fmt]
    r = t.to(dt)
    if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        # no nextafter for fp8: step through the halved/doubled grid via bf16 and re-round
        rf = r.float()
        bad = (rf > t) if direction == "down" else (rf < t)
        for _ in range(4):
            if not bool(bad.any()):
                break
            step = rf.abs().clamp_min(2.0 ** -9) * (2.0 ** -3 if dt == torch.float8_e4m3fn else 2.0 ** -2)
            rf = torch.where(bad, (rf - step if direction == "down" else rf + step).to(dt).float(), rf)
            bad = (rf > t) if direction == "down" else (rf < t)
        return rf
    rf = r.float()
    inf = torch.full_like(r, float("-inf") if direction == "down" else float("inf"))
    nxt = torch.nextafter(r, inf).float()
    bad = (rf > t) if direction == "down" else (rf < t)
    return torch.where(bad, nxt, rf)


def per_name(k_fn, v_fn):
    return lambda layer, name, x: (k_fn if name == "k" else v_fn)(x)


def same(fn):
    return per_name(fn, fn)


ident = lambda x: x.float()  # noqa: E731

VARIANTS = {
    "fp8": same(fp8),
    "fp8_k_only": per_name(fp8, ident),
    "fp8_v_only": per_name(ident, fp8),
    "fp8_head": same(lambda x: fp8(x, dims=(1, 3))),
    "fp8_center_k": per_name(fp8_centered, fp8),
    "fp8_center_k_fp16": per_name(lambda x: fp8_centered(x, torch.float16), fp8),
    "fp8_center_kv": same(fp8_centered),
    "fp8_center_k_head": per_name(lambda x: fp8_centered(x, dims=(1, 3)), lambda x: fp8(x, dims=(1, 3))),
    "fp8_center_k_mu_e4m3": per_name(lambda x: fp8_centered(x, torch.float8_e4m3fn), fp8),
    "fp8_center_k_e4m3_head": per_name(lambda x: fp8_centered(x, torch.float8_e4m3fn, dims=(1, 3)),
                                       lambda x: fp8(x, dims=(1, 3))),
    "fp8_center_k_chanscale": per_name(lambda x: fp8_centered(x, dims=(1,)), fp8),
    "int4_rot_e4m3meta_tok64": same(rotated(lambda x: int_meta(x, 4, 64, 3, "e4m3", "e4m3"))),
    "int4_rot_fp16s_e4m3z_tok64": same(rotated(lambda x: int_meta(x, 4, 64, 3, "fp16", "e4m3"))),
    "fp8_center_k_chanp2": per_name(fp8_center_chan_p2, fp8),
    "int4_kivi_e4m3meta_vsym64": per_name(lambda x: int_meta(x, 4, 16, 1, "e4m3", "e4m3"),
                                          lambda x: int_sym(x, 64)),
    "int4_kivi_e4m3meta_vrotsym64": per_name(lambda x: int_meta(x, 4, 16, 1, "e4m3", "e4m3"),
                                             rotated(lambda x: int_sym(x, 64))),
    "int4_kivi_e4m3meta_vrot64": per_name(lambda x: int_meta(x, 4, 16, 1, "e4m3", "e4m3"),
                                          rotated(lambda x: int_meta(x, 4, 64, 3, "e4m3", "e4m3"))),
    "int4_kivi_fp16meta_vrotsym64": per_name(lambda x: int_groups(x, 4, 16, 1),
                                             rotated(lambda x: int_sym(x, 64))),
    # per-channel scale for keys (per block, head, channel): tests whether scales help at all
    "fp8_k_chanscale": per_name(lambda x: fp8(x, dims=(1,)), fp8),
    "fp8_v_chanscale": per_name(fp8, lambda x: fp8(x, dims=(1,))),
    "e5m2": same(lambda x: fp8(x, "fp8_e5m2")),
    "int4_kivi": per_name(lambda x: int_groups(x, 4, 16, 1), lambda x: int_groups(x, 4, 32, 3)),
    "int4_kivi_v64": per_name(lambda x: int_groups(x, 4, 16, 1), lambda x: int_groups(x, 4, 64, 3)),
    "int4_tok64": same(lambda x: int_groups(x, 4, 64, 3)),
    "int4_rot_tok64": same(rotated(lambda x: int_groups(x, 4, 64, 3))),
    "int4_rotk_tok64": per_name(rotated(lambda x: int_groups(x, 4, 64, 3)), lambda x: int_groups(x, 4, 64, 3)),
    "int4_rot_tok32": same(rotated(lambda x: int_groups(x, 4, 32, 3))),
    # KIVI keys with 1-byte meta (fp8 scale + fp8 zero, outward), values g64 fp8 meta
    "int4_kivi_e4m3meta_v64": per_name(lambda x: int_meta(x, 4, 16, 1, "e4m3", "e4m3"),
                                       lambda x: int_meta(x, 4, 64, 3, "e4m3", "e4m3")),
    "int4_kivi_fp16z_e4m3s_v64": per_name(lambda x: int_meta(x, 4, 16, 1, "e4m3", "fp16"),
                                          lambda x: int_meta(x, 4, 64, 3, "e4m3", "e4m3")),
    "int4_kivi_fp16_v64_e4m3": per_name(lambda x: int_meta(x, 4, 16, 1, "fp16", "fp16"),
                                        lambda x: int_meta(x, 4, 64, 3, "e4m3", "e4m3")),
    "int4_kivi_v32_e4m3": per_name(lambda x: int_meta(x, 4, 16, 1, "fp16", "fp16"),
                                   lambda x: int_meta(x, 4, 32, 3, "e4m3", "e4m3")),
}


class FakeQuantCache(QuantizedKVCache):
    """Staged cache whose sealed blocks hold encode(x) in float32."""

    def __init__(self, model_config, *, num_blocks, block_size, dtype, device="cpu",
                 kv_cache_dtype="int4", encode=None, num_residual_blocks=None):
        self.kind, self.staged, self.encode = "fake", True, encode
        self._init_common(model_config, num_blocks, block_size, dtype, device, num_residual_blocks)
        for name in ("k", "v"):
            self._add_field(name, (block_size, self.num_kv_heads, self.head_dim), torch.float32)

    @staticmethod
    def bytes_per_block(*a):
        return 0

    def _store_blocks(self, layer, block_ids, k, v):
        for name, x in (("k", k), ("v", v)):
            self.fields[name][layer, block_ids] = self.encode(layer, name, x).float()

    def _load_blocks(self, layer, block_ids):
        return (self.fields["k"][layer, block_ids].to(self.dtype),
                self.fields["v"][layer, block_ids].to(self.dtype))


def calibrate_static(model, cfg, ids, block_size, chunk):
    """Per-layer amax of K and V over the text (vLLM's calibrated k_scale / v_scale)."""
    amax = {}

    def enc(layer, name, x):
        a = float(x.abs().max())
        amax[(layer, name)] = max(amax.get((layer, name), 0.0), a)
        return x.float()
    v = kv_quality.Variant("calib", "int4", {"encode": enc})
    kv_quality.text_metrics(model, cfg, [kv_quality.Variant("auto (float32)", "auto"), v], ids, block_size, chunk)
    fmax = quant.fp8_max("fp8_e4m3")
    return {key: a / fmax for key, a in amax.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = kv_quality.load_model(None, torch.float32)
    cfg, tok = loaded.config, loaded.tokenizer
    model = kv_quality.LlamaModel(cfg, loaded.weights, torch.float32, "cpu")
    ids = tok.encode(kv_quality.TEXT.read_text())[:args.tokens]
    real = kv_quality.kv_cache_class
    kv_quality.kv_cache_class = lambda d: real(d) if d == "auto" else FakeQuantCache
    variants = [kv_quality.Variant("auto (float32)", "auto")]
    for name in args.variants:
        if name == "fp8_static":
            enc = fp8_static(calibrate_static(model, cfg, ids, args.block_size, args.chunk))
        else:
            enc = VARIANTS[name]
        variants.append(kv_quality.Variant(name, "int4", {"encode": enc}))
    t = time.time()
    res = kv_quality.text_metrics(model, cfg, variants, ids, args.block_size, args.chunk)
    base = res["auto (float32)"].perplexity
    print(f"{len(ids)} tokens, block {args.block_size}, {time.time() - t:.0f}s")
    for name, m in res.items():
        print(f"{name:<28}{m.perplexity:9.3f}{100 * (m.perplexity / base - 1):+8.2f}%  KL {m.mean_kl:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
