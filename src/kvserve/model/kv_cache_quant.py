"""Quantized paged KV caches: fp8 (e4m3 / e5m2) and KIVI-style int8 / int4.

Each class stores its blocks as a few named tensors `[num_layers, num_blocks, ...]` (codes,
scales, zero points) and dequantizes on read, only for the blocks `gather` is asked for.

Why a residual (KIVI): a dynamic per-block scale (fp8) or a per-channel key group along the
token axis (int) depends on every token of the block, but decode writes one token at a time.
Quantizing early would force either clipping later tokens or rescaling already-quantized ones.
So a block that is not yet full lives in a small full-precision *residual* pool; when its last
slot is written it is quantized once, with statistics over all its tokens, and its residual
entry is released. Residual entries are reclaimed least-recently-written first; an evicted
partial block is quantized as it stands (its unwritten slots padded with the channel mean so
they do not widen any group) and brought back to the residual if it is written again.
The residual is a fixed pool (`num_residual_blocks`, size it to max_num_seqs: one open block per
running sequence); its bytes are `residual_bytes(...)`, outside `bytes_per_block`.

fp8 with static scales (a checkpoint's k_scale / v_scale) and int with `residual=False` (keys
quantized per token like values) need no residual: every token is quantized when written.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.engine.scheduler_output import BlockCopy
from kvserve.kv import quant
from kvserve.kv.quant import KVScales
from kvserve.model.kv_cache import KVCache, _copy_slot_indices, register_kv_cache

# Measured (bench/kv_quality.py --quick, SmolLM2-135M): int4 perplexity +0.21 % at 32 vs +1.03 % at
# 64 for 4 % more bytes per token (value groups; key groups are clipped to the block anyway).
DEFAULT_GROUP_SIZE = 32
# int4 defaults to compact metadata (e4m3 scales/zeros, symmetric value groups of a whole head):
# 3.5x fewer bytes than bfloat16 at block 16 instead of 2.9x (bench/NOTES.md, 2026-11-21).
COMPACT_GROUP_SIZE = 64
COMPACT_BY_DEFAULT = {"int8": False, "int4": True}


def _int_defaults(kind: str, group_size: int | None, compact: bool | None) -> tuple[int, bool]:
    compact = COMPACT_BY_DEFAULT[kind] if compact is None else compact
    if group_size is None:
        group_size = COMPACT_GROUP_SIZE if compact else DEFAULT_GROUP_SIZE
    return group_size, compact
DEFAULT_NUM_RESIDUAL_BLOCKS = 256  # = EngineArgs.max_num_seqs default


def _residual_state_bytes(model_config: ModelConfig, block_size: int, model_dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=model_dtype).element_size()
    per_layer = 2 * block_size * model_config.num_key_value_heads * model_config.head_dim * elem
    return model_config.num_hidden_layers * (per_layer + block_size)  # + the fill mask (bool)


class QuantizedKVCache(KVCache):
    """Shared machinery: named storage fields, the residual pool, write / gather / copy."""

    kind: str  # canonical quant kind (fp8_e4m3, fp8_e5m2, int8, int4)
    staged: bool  # True: blocks pass through the residual pool and are quantized whole

    def _init_common(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device | str, num_residual_blocks: int | None) -> None:
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least 1 block, got num_blocks={num_blocks}; "
                              f"raise --kv-cache-memory or --num-gpu-blocks-override")
        self.num_layers = model_config.num_hidden_layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = model_config.num_key_value_heads, model_config.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.fields: dict[str, torch.Tensor] = {}
        if not self.staged:
            self.num_residual_blocks = 0
            return
        r = min(num_blocks, DEFAULT_NUM_RESIDUAL_BLOCKS if num_residual_blocks is None else num_residual_blocks)
        if r < 1:
            raise ConfigError(f"num_residual_blocks must be >= 1 (got {num_residual_blocks}); size it "
                              f"to --max-num-seqs")
        self.num_residual_blocks = r
        L, dev, H, D = self.num_layers, self.device, self.num_kv_heads, self.head_dim
        self.res_kv = torch.zeros(L, r, 2, block_size, H, D, dtype=dtype, device=dev)
        self.res_mask = torch.zeros(L, r, block_size, dtype=torch.bool, device=dev)
        self.res_owner = torch.full((L, r), -1, dtype=torch.long, device=dev)
        self.res_clock = torch.zeros(L, r, dtype=torch.long, device=dev)
        self.block_res = torch.full((L, num_blocks), -1, dtype=torch.long, device=dev)
        # Valid tokens in a block's quantized form (block_size once sealed full; fewer if evicted).
        self.sealed_fill = torch.zeros(L, num_blocks, dtype=torch.int16, device=dev)
        self._clock = [0] * L
        self.residual_evictions = 0  # open blocks quantized early because the pool was full

    def _add_field(self, name: str, per_block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.fields[name] = torch.zeros(self.num_layers, self.num_blocks, *per_block_shape,
                                        dtype=dtype, device=self.device)

    # -- what each format implements --

    def _store_blocks(self, layer: int, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks k, v `[nb, block_size, H, D]` into `block_ids` (staged mode)."""
        raise NotImplementedError

    def _store_tokens(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize tokens k, v `[T, H, D]` into flat `slots` (direct mode)."""
        raise NotImplementedError

    def _load_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize `block_ids` -> k, v `[nb, block_size, H, D]` in self.dtype."""
        raise NotImplementedError

    # -- accounting --

    @property
    def block_bytes(self) -> int:
        """Bytes per block actually allocated (all layers): the sum of the storage fields."""
        return sum(t[0, 0].numel() * t.element_size() for t in self.fields.values()) * self.num_layers

    @property
    def residual_pool_bytes(self) -> int:
        if not self.staged:
            return 0
        return self.res_kv.numel() * self.res_kv.element_size() + self.res_mask.numel()

    @staticmethod
    def residual_bytes(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                       model_dtype: torch.dtype, num_residual_blocks: int = DEFAULT_NUM_RESIDUAL_BLOCKS) -> int:
        """Fixed full-precision residual pool a cache of this dtype allocates besides its blocks:
        subtract it from the KV budget before dividing by bytes_per_block."""
        if kv_cache_dtype == "auto":
            return 0
        return num_residual_blocks * _residual_state_bytes(model_config, block_size, model_dtype)

    # -- KVCache interface --

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if slot_mapping.numel() == 0:
            return
        if not self.staged:
            self._store_tokens(layer, slot_mapping, k, v)
        else:
            self._write_staged(layer, slot_mapping, k.to(self.dtype), v.to(self.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_block_ids(block_ids)
        k, v = self._load_blocks(layer, block_ids)
        if self.staged:
            entry = self.block_res[layer, block_ids]
            open_ = entry >= 0
            if bool(open_.any()):
                e = entry[open_]
                k[open_] = self.res_kv[layer, e, 0]
                v[open_] = self.res_kv[layer, e, 1]
        shape = (block_ids.numel() * self.block_size, self.num_kv_heads, self.head_dim)
        return k.reshape(shape), v.reshape(shape)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        if not copies:
            return
        src_slots, dst_slots = _copy_slot_indices(copies, self.block_size, self.num_blocks)
        src_slots, dst_slots = src_slots.to(self.device), dst_slots.to(self.device)
        if not self.staged:
            # Direct formats keep everything per slot (static scales live outside the blocks).
            for name, t in self.fields.items():
                t = t.view(torch.uint8) if t.dtype in quant.FP8_DTYPES.values() else t
                flat = t.view(self.num_layers, self.num_blocks * self.block_size, *t.shape[3:])
                flat[:, dst_slots] = flat[:, src_slots]
            return
        bs = self.block_size
        src = torch.tensor([c.src for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=self.device)
        n = torch.tensor([c.num_tokens for c in copies], dtype=torch.long, device=self.device)
        rows = torch.repeat_interleave(torch.arange(len(copies), device=self.device), n)
        offs = src_slots % bs
        for layer in range(self.num_layers):
            # Read every source before any write so chains (a->b, b->c) see the old contents.
            k, v = self.gather(layer, src)
            k, v = k.view(-1, bs, *k.shape[1:]), v.view(-1, bs, *v.shape[1:])
            # A sealed full block copied whole: copy its codes, no second quantization.
            exact = (n == bs) & (self.block_res[layer, src] < 0)
            saved = {name: t[layer, src[exact]].clone() for name, t in self.fields.items()}
            rest = ~exact[rows]
            if bool(rest.any()):
                # Partial or still-open sources: written into dst like fresh tokens.
                self.write(layer, dst_slots[rest], k[rows[rest], offs[rest]], v[rows[rest], offs[rest]])
            if bool(exact.any()):
                for name, t in self.fields.items():
                    t[layer, dst[exact]] = saved[name]
                self._release(layer, dst[exact])
                self.sealed_fill[layer, dst[exact]] = bs

    # -- offload tiers and swap (stored form of whole blocks) --
    # A sealed block is its codes plus `fill` (valid tokens per layer). An *open* block's tokens
    # are still full precision in the residual pool, and re-quantizing them early would change
    # the numbers the sequence continues with; so its residual rows travel along, verbatim, and
    # a swapped-in sequence resumes exactly where it stopped, whatever block id it lands in.

    @property
    def open_block_layout(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per-block (shape, dtype) of the open state `read_blocks` appends when a block asked for
        is open: residual K/V `[L, 2, bs, H, D]`, then its written-slot mask `[L, bs]` (a block
        whose mask row is all False is not open and needs neither)."""
        if not self.staged:
            return []
        L = self.num_layers
        return [((L, *self.res_kv.shape[2:]), self.dtype), ((L, self.block_size), torch.bool)]

    @property
    def layout_tag(self) -> str:
        """What decides a stored block's bytes beyond the dtype (goes into the tier fingerprint)."""
        fields = ",".join(f"{n}{list(t.shape[2:])}:{t.dtype}" for n, t in self.fields.items())
        return f"{self.kind}/{'residual' if self.staged else 'direct'}/{fields}"

    def read_blocks(self, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """`[n, L, ...]` per storage field, then (residual caches) `fill` `[n, L]` int16, then -
        only when some block is open - the `open_block_layout` tensors, zero for sealed rows."""
        ids = block_ids.to(self.device)
        self.check_block_ids(ids)
        out = []
        for t in self.fields.values():
            raw = t.view(torch.uint8) if t.dtype in quant.FP8_DTYPES.values() else t
            out.append(raw.index_select(1, ids).movedim(1, 0).contiguous().view(t.dtype))
        if not self.staged:
            return out
        out.append(self.sealed_fill.index_select(1, ids).t().contiguous())
        entry = self.block_res.index_select(1, ids)  # [L, n]
        open_ = entry >= 0
        if bool(open_.any()):
            layers = torch.arange(self.num_layers, device=self.device)[:, None]
            e = entry.clamp_min(0)
            kv = torch.where(open_[..., None, None, None, None], self.res_kv[layers, e], 0)
            mask = self.res_mask[layers, e] & open_[..., None]
            out += [kv.movedim(1, 0).contiguous(), mask.movedim(1, 0).contiguous()]
        return out

    def write_blocks(self, block_ids: torch.Tensor, data: Sequence[torch.Tensor]) -> None:
        """Inverse of `read_blocks` (with or without the open state). Whatever the target blocks
        held before - codes or a residual entry of an earlier occupant - is replaced."""
        ids = block_ids.to(self.device)
        self.check_block_ids(ids)
        n_fields = len(self.fields)
        n_open = len(self.open_block_layout)
        expect = (n_fields,) if not self.staged else (n_fields + 1, n_fields + 1 + n_open)
        if len(data) not in expect:
            raise ValueError(f"{type(self).__name__}.write_blocks takes {' or '.join(map(str, expect))} "
                             f"tensors (read_blocks' output), got {len(data)}")
        for t, x in zip(self.fields.values(), data):
            raw = t.view(torch.uint8) if t.dtype in quant.FP8_DTYPES.values() else t
            raw[:, ids] = x.to(self.device).view(raw.dtype).movedim(0, 1)
        if not self.staged:
            return
        for layer in range(self.num_layers):
            self._release(layer, ids)
        self.sealed_fill[:, ids] = data[n_fields].to(self.device, torch.int16).t()
        if len(data) == n_fields + 1:
            return
        res_kv, res_mask = (x.to(self.device) for x in data[n_fields + 1:])
        for layer in range(self.num_layers):
            open_ = res_mask[:, layer].any(1)
            if not bool(open_.any()):
                continue
            e = self._allocate(layer, ids[open_], busy=ids)
            self.res_kv[layer, e] = res_kv[open_, layer].to(self.dtype)
            self.res_mask[layer, e] = res_mask[open_, layer]
            self._clock[layer] += 1
            self.res_clock[layer, e] = self._clock[layer]

    # -- the residual pool --

    def _release(self, layer: int, block_ids: torch.Tensor) -> None:
        e = self.block_res[layer, block_ids]
        e = e[e >= 0]
        self.res_owner[layer, e] = -1
        self.block_res[layer, block_ids] = -1

    def _seal(self, layer: int, entries: torch.Tensor) -> None:
        """Quantize residual entries into their blocks and free them."""
        owners = self.res_owner[layer, entries]
        kv = self.res_kv[layer, entries].float()  # [n, 2, bs, H, D]
        mask = self.res_mask[layer, entries]  # [n, bs]
        fill = mask.sum(1)
        if bool((fill < self.block_size).any()):
            # Pad unwritten slots with the channel mean of the written ones: inside every
            # group's [min, max], so padding never coarsens the quantization of real tokens.
            m = mask[:, None, :, None, None].float()
            mean = (kv * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp_min(1)
            kv = torch.where(m.bool(), kv, mean)
        self._store_blocks(layer, owners, kv[:, 0].to(self.dtype), kv[:, 1].to(self.dtype))
        self.sealed_fill[layer, owners] = fill.to(torch.int16)
        self.block_res[layer, owners] = -1
        self.res_owner[layer, entries] = -1

    def _allocate(self, layer: int, blocks: torch.Tensor, busy: torch.Tensor) -> torch.Tensor:
        """Residual entries for `blocks` (not yet in the pool); evicts LRU entries not in `busy`."""
        free = (self.res_owner[layer] < 0).nonzero().flatten()
        need = blocks.numel() - free.numel()
        if need > 0:
            owners = self.res_owner[layer]
            evictable = (owners >= 0) & ~torch.isin(owners, busy)
            cand = evictable.nonzero().flatten()
            if cand.numel() < need:
                raise RuntimeError(
                    f"KV residual pool exhausted: one write needs {blocks.numel()} open blocks but the "
                    f"pool has {self.num_residual_blocks} entries; build the cache with "
                    f"num_residual_blocks >= max_num_seqs (or lower --max-num-seqs)")
            victims = cand[self.res_clock[layer, cand].argsort()[:need]]
            self._seal(layer, victims)
            self.residual_evictions += int(victims.numel())
            free = (self.res_owner[layer] < 0).nonzero().flatten()
        e = free[:blocks.numel()]
        self.res_owner[layer, e] = blocks
        self.block_res[layer, blocks] = e
        return e

    def _write_staged(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        bs = self.block_size
        blocks, offs = slots // bs, slots % bs
        ub, inv = torch.unique(blocks, return_inverse=True)
        cover = torch.zeros(ub.numel(), bs, dtype=torch.bool, device=self.device)
        cover[inv, offs] = True
        whole = cover.all(1)
        if bool(whole.any()):
            # Blocks written entirely by this call skip the residual: quantize straight away.
            wb = ub[whole]
            widx = whole.long().cumsum(0) - 1
            tok = whole[inv]
            buf = torch.zeros(2, wb.numel(), bs, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                              device=self.device)
            buf[0, widx[inv[tok]], offs[tok]] = k[tok]
            buf[1, widx[inv[tok]], offs[tok]] = v[tok]
            self._release(layer, wb)
            self._store_blocks(layer, wb, buf[0], buf[1])
            self.sealed_fill[layer, wb] = bs
        part = ~whole
        if not bool(part.any()):
            return
        pb = ub[part]
        fresh = cover[part, 0]  # slot 0 written: a new occupant (or a recompute) starts the block
        entry = self.block_res[layer, pb]
        missing = entry < 0
        if bool(missing.any()):
            new = self._allocate(layer, pb[missing], busy=ub)
            entry[missing] = new
            # Re-opened blocks that already hold tokens bring them back from their quantized form.
            reopen = missing.clone()
            reopen[missing] = ~fresh[missing] & (self.sealed_fill[layer, pb[missing]] > 0)
            if bool(reopen.any()):
                rk, rv = self._load_blocks(layer, pb[reopen])
                self.res_kv[layer, entry[reopen], 0] = rk
                self.res_kv[layer, entry[reopen], 1] = rv
                filled = torch.arange(bs, device=self.device)[None, :] < \
                    self.sealed_fill[layer, pb[reopen]][:, None]
                self.res_mask[layer, entry[reopen]] = filled
            self.res_mask[layer, entry[missing & ~reopen]] = False
        self.res_mask[layer, entry[fresh]] = False
        self._clock[layer] += 1
        self.res_clock[layer, entry] = self._clock[layer]
        pidx = part.long().cumsum(0) - 1
        tok = part[inv]
        e_tok = entry[pidx[inv[tok]]]
        self.res_kv[layer, e_tok, 0, offs[tok]] = k[tok]
        self.res_kv[layer, e_tok, 1, offs[tok]] = v[tok]
        self.res_mask[layer, e_tok, offs[tok]] = True
        done = self.res_mask[layer, entry].all(1)
        if bool(done.any()):
            self._seal(layer, entry[done])


@register_kv_cache("fp8", "fp8_e4m3", "fp8_e5m2")
class Fp8PagedKVCache(QuantizedKVCache):
    """float8 K/V. Dynamic scales: per block and kv head (default) or one per block, computed
    when the block is sealed - per block because a per-tensor scale that grows would have to
    rescale every block already written. Static scales (`kv_scales`): per layer, from the
    checkpoint, applied at write time (no residual needed).

    `center_keys` (dynamic scales only, default on): each sealed block also stores the e4m3 mean
    of every key channel over its tokens and quantizes K minus that mean (quant.quantize_fp8).
    Measured on SmolLM2 (bench/NOTES.md, 2026-11-21 "fp8 key centering"): keys carry almost all
    of fp8's error; centering halves the KL to float32 KV and per-head scales (the head's largest
    key then lands exactly on e4m3's max) take a further third off."""

    def __init__(self, model_config: ModelConfig, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "fp8",
                 scale_granularity: str = "head", kv_scales: KVScales | None = None,
                 num_residual_blocks: int | None = None, center_keys: bool = True) -> None:
        self.kind = quant.canonical_kind(kv_cache_dtype)
        if self.kind not in quant.FP8_DTYPES:
            raise ConfigError(f"Fp8PagedKVCache takes fp8, fp8_e4m3 or fp8_e5m2, got {kv_cache_dtype!r}")
        if scale_granularity not in ("tensor", "head"):
            raise ConfigError(f"fp8 scale granularity must be 'tensor' or 'head' (got {scale_granularity!r})")
        self.scale_granularity = scale_granularity
        self.staged = kv_scales is None
        # Centering needs the block's statistics, i.e. the residual; static scales write per token.
        self.center_keys = center_keys and self.staged
        self._init_common(model_config, num_blocks, block_size, dtype, device, num_residual_blocks)
        H, D, fp8 = self.num_kv_heads, self.head_dim, quant.FP8_DTYPES[self.kind]
        for name in ("k", "v"):
            self._add_field(name, (block_size, H, D), fp8)
        if self.staged:
            n_scales = H if scale_granularity == "head" else 1
            self._add_field("k_scale", (n_scales,), torch.float32)
            self._add_field("v_scale", (n_scales,), torch.float32)
            if self.center_keys:
                self._add_field("k_mean", (H, D), quant.FP8_MEAN_DTYPE)
        else:
            self.static = {}
            for name, s in (("k", kv_scales.k_scale), ("v", kv_scales.v_scale)):
                s = s.to(torch.float32).to(self.device)
                if s.shape[0] != self.num_layers or s.dim() > 2 or (s.dim() == 2 and s.shape[1] != H):
                    raise ConfigError(f"static {name}_scale must be [num_layers] or [num_layers, "
                                      f"num_kv_heads] = [{self.num_layers}, {H}], got {list(s.shape)}")
                self.static[name] = s

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> int:
        # The engine's default construction: dynamic per-head scales with centered keys.
        return model_config.num_hidden_layers * quant.bytes_per_block_per_layer(
            kv_cache_dtype, model_config.num_key_value_heads, model_config.head_dim, block_size,
            fp8_scale_granularity="head", fp8_center_keys=True)

    def _scale_view(self, s: torch.Tensor) -> torch.Tensor:
        # [nb, n_scales] -> broadcast over [nb, bs, H, D]
        return s[:, None, :, None]

    def _store_blocks(self, layer, block_ids, k, v):
        dims = (1, 3) if self.scale_granularity == "head" else (1, 2, 3)
        for name, x in (("k", k), ("v", v)):
            center = (1,) if name == "k" and self.center_keys else None  # over the block's tokens
            q = quant.quantize_fp8(x, self.kind, reduce_dims=dims, center_dims=center)
            self.fields[name][layer, block_ids] = q.data
            self.fields[name + "_scale"][layer, block_ids] = q.scale.reshape(block_ids.numel(), -1)
            if center:
                self.fields["k_mean"][layer, block_ids] = q.mean.squeeze(1)

    def _static_scale(self, name: str, layer: int) -> torch.Tensor:
        s = self.static[name][layer]
        return s[:, None] if s.dim() == 1 else s  # per head: [H, 1] against [..., H, D]

    def _store_tokens(self, layer, slots, k, v):
        flat = self.num_blocks * self.block_size
        for name, x in (("k", k), ("v", v)):
            q = quant.quantize_fp8(x, self.kind, scale=self._static_scale(name, layer))
            # Viewed as bytes: CPU index_copy_ has no float8 kernel.
            dst = self.fields[name][layer].view(torch.uint8).view(flat, self.num_kv_heads, self.head_dim)
            dst.index_copy_(0, slots, q.data.view(torch.uint8))

    def _load_blocks(self, layer, block_ids):
        out = []
        for name in ("k", "v"):
            data = self.fields[name][layer, block_ids]
            mean = None
            if self.staged:
                scale = self._scale_view(self.fields[name + "_scale"][layer, block_ids])
                if name == "k" and self.center_keys:
                    mean = self.fields["k_mean"][layer, block_ids][:, None]  # [nb, 1, H, D]
            else:
                scale = self._static_scale(name, layer)
            out.append(quant.dequantize_fp8(quant.Fp8Quantized(data, scale, mean), self.dtype))
        return out[0], out[1]


@register_kv_cache("int8", "int4")
class IntPagedKVCache(QuantizedKVCache):
    """KIVI: asymmetric int8/int4 groups, keys per channel (groups of tokens within a block,
    so the block passes through the residual), values per token (groups along head_dim).
    `residual=False` quantizes keys per token too, so each token is final when written.
    `compact` (int4's default): scales and zero points in e4m3, values symmetric (scale only);
    group_size defaults to 64 then, 32 otherwise."""

    def __init__(self, model_config: ModelConfig, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "int4",
                 group_size: int | None = None, residual: bool = True,
                 num_residual_blocks: int | None = None, compact: bool | None = None) -> None:
        self.kind = quant.canonical_kind(kv_cache_dtype)
        if self.kind not in quant.INT_BITS:
            raise ConfigError(f"IntPagedKVCache takes int8 or int4, got {kv_cache_dtype!r}")
        self.bits = quant.INT_BITS[self.kind]
        group_size, self.compact = _int_defaults(self.kind, group_size, compact)
        self.staged = residual
        self._init_common(model_config, num_blocks, block_size, dtype, device, num_residual_blocks)
        H, D = self.num_kv_heads, self.head_dim
        try:
            self.groups = quant.effective_group_sizes(group_size, block_size, D)
        except quant.QuantError as e:
            raise ConfigError(str(e)) from None
        packed = D * self.bits // 8
        meta = quant.COMPACT_META_DTYPE if self.compact else quant.GROUP_META_DTYPE
        self._add_field("k", (block_size, H, packed), torch.uint8)
        self._add_field("v", (block_size, H, packed), torch.uint8)
        if residual:
            k_meta = (block_size // self.groups.key_tokens, H, D)
        else:
            k_meta = (block_size, H, D // self.groups.value_channels)
        v_meta = (block_size, H, D // self.groups.value_channels)
        # Compact values are symmetric (no zero point); so are compact keys quantized per token.
        self.symmetric = {"k": self.compact and not residual, "v": self.compact}
        for name, shape in (("k", k_meta), ("v", v_meta)):
            self._add_field(name + "_scale", shape, meta)
            if not self.symmetric[name]:
                self._add_field(name + "_zero", shape, meta)
            if self.compact:  # power-of-two exponent: per block (staged) or per token (direct)
                self._add_field(name + "_exp", (1,) if residual else (block_size,), torch.int8)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> int:
        group_size, compact = _int_defaults(quant.canonical_kind(kv_cache_dtype), None, None)
        return model_config.num_hidden_layers * quant.bytes_per_block_per_layer(
            kv_cache_dtype, model_config.num_key_value_heads, model_config.head_dim, block_size,
            group_size, int_compact=compact)

    def _quantize(self, name: str, x: torch.Tensor, group: int, axis: int) -> quant.GroupQuantized:
        rows = tuple(range(1, x.dim()))  # one exponent per block [nb, bs, H, D] or token [T, H, D]
        return quant.quantize_groups(x, self.bits, group, axis, compact=self.compact,
                                     symmetric=self.symmetric[name], exponent_dims=rows)

    def _put(self, layer: int, name: str, idx: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
             q: quant.GroupQuantized) -> None:
        """idx: block ids (whole blocks) or (block ids, offsets) (single tokens)."""
        at = (layer, *idx) if isinstance(idx, tuple) else (layer, idx)
        self.fields[name][at] = q.codes
        self.fields[name + "_scale"][at] = q.scale
        if q.zero is not None:
            self.fields[name + "_zero"][at] = q.zero
        if q.exponent is not None:
            self.fields[name + "_exp"][at] = q.exponent.reshape(q.exponent.shape[0], -1).squeeze(-1) \
                if isinstance(idx, tuple) else q.exponent.reshape(q.exponent.shape[0], 1)

    def _store_blocks(self, layer, block_ids, k, v):
        self._put(layer, "k", block_ids, self._quantize("k", k, self.groups.key_tokens, axis=1))
        self._put(layer, "v", block_ids, self._quantize("v", v, self.groups.value_channels, axis=3))

    def _store_tokens(self, layer, slots, k, v):
        bs = self.block_size
        idx = (slots // bs, slots % bs)
        for name, x in (("k", k), ("v", v)):
            self._put(layer, name, idx, self._quantize(name, x, self.groups.value_channels, axis=2))

    def _get(self, layer: int, name: str, block_ids: torch.Tensor, group: int, axis: int) -> torch.Tensor:
        zero, exp = self.fields.get(name + "_zero"), self.fields.get(name + "_exp")
        if exp is not None:
            exp = exp[layer, block_ids][:, :, None, None]  # [nb, 1 or bs] -> against [nb, bs, H, D]
        q = quant.GroupQuantized(self.fields[name][layer, block_ids], self.fields[name + "_scale"][layer, block_ids],
                                 None if zero is None else zero[layer, block_ids], self.bits, axis, group, exp)
        return quant.dequantize_groups(q, self.dtype)

    def _load_blocks(self, layer, block_ids):
        if self.staged:
            k = self._get(layer, "k", block_ids, self.groups.key_tokens, axis=1)
        else:
            k = self._get(layer, "k", block_ids, self.groups.value_channels, axis=3)
        return k, self._get(layer, "v", block_ids, self.groups.value_channels, axis=3)
