"""The shared machinery of quantized paged KV caches; the formats are one file each:
fp8.py (fp8 e4m3 / e5m2) and kivi.py (KIVI-style int8 / int4).

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
The residual is a pool sized at start (`num_residual_blocks`, `residual_blocks_for(max_num_seqs)`:
one open block per running sequence and one more, see there), grown only by a step that needs
more; its bytes are `residual_bytes(...)`, outside `bytes_per_block`.

`seal_at_step_end` (the engine's setting): a block filled by a write is sealed in `finish_step`,
for every layer in one quantization call, instead of inside each layer's write (30 small
quantizations per step at ~0.5 ms each; bench/NOTES.md, "Quantized cache writes: seal at step end, residual rows
written by one compiled call"). Until then it is read from its
residual rows, i.e. at full precision for the rest of the step that filled it.

fp8 with static scales (a checkpoint's k_scale / v_scale) and int with `residual=False` (keys
quantized per token like values) need no residual: every token is quantized when written.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import torch

from kvserve.cache import quantizers as quant
from kvserve.cache.base import KVCache, copy_slot_indices
from kvserve.cache.write_plan import Placement, WritePlan, plan_write
from kvserve.config import ConfigError, ModelConfig
from kvserve.core.step import BlockCopy
from kvserve.ops.host_alloc import zeros_huge_pages

log = logging.getLogger(__name__)

def residual_blocks_for(max_num_seqs: int) -> int:
    """Residual entries a step's write needs in the common case: an open block per running
    sequence, plus one for the sequence whose prefill chunk the token budget cut mid-block in the
    step before (its next chunk starts in that open block and ends in a new one). With exactly
    max_num_seqs entries a full batch of decodes beside such a chunk exhausted the pool. A write
    that opens more (prompt chunks starting and ending mid-block; the engine's KV manager no longer
    makes those by copying a quantized cache's partial blocks) grows the pool for that step
    (QuantizedKVCache._grow_residual)."""
    return max_num_seqs + 1


DEFAULT_NUM_RESIDUAL_BLOCKS = residual_blocks_for(256)  # EngineArgs.max_num_seqs default


def _residual_state_bytes(model_config: ModelConfig, block_size: int, model_dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=model_dtype).element_size()
    per_layer = 2 * block_size * model_config.num_key_value_heads * model_config.head_dim * elem
    return model_config.num_hidden_layers * (per_layer + block_size)  # + the fill mask (bool)


class MetaRef(NamedTuple):
    """A per-group number of a quantized field (scale, zero point, key mean or exponent): for
    block b, token t, head h, channel d it is `tensor[b, t // group_tokens, h, d // group_channels]`
    (a 4-D view; broadcast dims are expanded with stride 0)."""
    tensor: torch.Tensor
    group_tokens: int
    group_channels: int


class DequantField(NamedTuple):
    """How one layer's K or V is stored, for kernels that dequantize blocks themselves
    (attention/staging.py): x = ((code - code_offset) * scale + zero) * 2**exponent, rounded to
    float32 after each operation as `_load_blocks` does, then to the model dtype."""
    codes: torch.Tensor  # [num_blocks, bs, H, P] uint8: P = D, or D / 2 (int4, low nibble first)
    code_format: str  # "uint8", "int4", "e4m3" or "e5m2"
    code_offset: float
    scale: MetaRef
    zero: MetaRef | None
    exponent: MetaRef | None  # int8 powers of two


def meta_ref(t: torch.Tensor, group_tokens: int, group_channels: int, shape: tuple[int, ...]) -> MetaRef:
    """`t` viewed 4-D and expanded to `shape` = (blocks, bs / group_tokens, H, D / group_channels)."""
    return MetaRef(t.expand(shape), group_tokens, group_channels)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 storage as its bytes (uint8), for moving whole blocks unchanged; other storage as is."""
    return t.view(torch.uint8) if t.dtype in quant.FP8_DTYPES.values() else t


class BlockSource(NamedTuple):
    """Whole blocks for the compiled quantizers (ops/csrc/quantize_blocks.cpp): block i's K is
    the `[block_size, H, D]` elements at address k + (src[i] if src is given, else i) * stride
    elements, its V the same from v; float32 or bf16."""
    k: int
    v: int
    is_bf16: int
    n: int
    src: torch.Tensor | None  # int64, contiguous
    stride: int

    @property
    def src_ptr(self) -> int | None:
        return None if self.src is None else self.src.data_ptr()


class QuantizedKVCache(KVCache):
    """Shared machinery: named storage fields, the residual pool, write / gather / copy."""

    kind: str  # canonical quant kind (fp8_e4m3, fp8_e5m2, int8, int4)
    staged: bool  # True: blocks pass through the residual pool and are quantized whole

    def _init_common(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device | str, num_residual_blocks: int | None,
                     seal_at_step_end: bool = False) -> None:
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least 1 block, got num_blocks={num_blocks}; "
                              f"raise --kv-cache-memory or --num-gpu-blocks-override")
        self.num_layers = model_config.num_hidden_layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = model_config.num_key_value_heads, model_config.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.seal_at_step_end = seal_at_step_end
        self._last_plan: tuple | None = None  # (slots, its version, WritePlan)
        self.fields: dict[str, torch.Tensor] = {}
        self._block_quantizers = None  # the compiled block quantizers (CPU), looked up on first use
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
        self.residual_generation = 0  # bumped when the pool grows (its tensors are reallocated)
        self._row_write = None  # the compiled residual write (CPU), looked up on first use

    def _add_field(self, name: str, per_block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.fields[name] = zeros_huge_pages(self.num_layers, self.num_blocks, *per_block_shape,
                                             dtype=dtype, device=self.device)

    # -- what each format implements --

    def _store_blocks(self, layer: int, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks k, v `[nb, block_size, H, D]` into `block_ids` (staged mode)."""
        raise NotImplementedError

    def _quantize_compiled(self, dst: torch.Tensor, source: BlockSource) -> bool:
        """Quantize `source`'s blocks into flat blocks `dst` (layer * num_blocks + block) with the
        compiled quantizer, as `_store_blocks` would; False, having written nothing, when it does
        not apply to this format or a value must go to the torch path (which raises its error)."""
        return False

    def _quantizers(self):
        """cpu_kernel.BlockQuantizers, or False (another device, no compiler)."""
        if self._block_quantizers is None:
            from kvserve.ops.cpu_kernels import block_quantizers
            self._block_quantizers = (block_quantizers() if self.device.type == "cpu" else None) or False
        return self._block_quantizers

    def _store_blocks_compiled(self, layer: int | torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor) -> bool:
        """`_store_blocks` by the compiled quantizer, when it applies (a 2,048-token prefill step spent
        ~50 ms per step in the torch ops of quantize_groups; bench/NOTES.md, "Every format's blocks
        quantized by one compiled pass, bit-equal to the torch path")."""
        shape = (block_ids.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        if (not self._quantizers() or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype
                or k.shape != shape or v.shape != shape):
            return False
        k, v = k.contiguous(), v.contiguous()
        # int64 whatever the ids' dtype: the kernel reads them as such (and checks their range).
        dst = (torch.as_tensor(layer, dtype=torch.long) * self.num_blocks + block_ids.long()).contiguous()
        blk = self.block_size * self.num_kv_heads * self.head_dim
        return self._quantize_compiled(dst, BlockSource(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                                                        block_ids.numel(), None, blk))

    def _store_tokens(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize tokens k, v `[T, H, D]` into flat `slots` (direct mode)."""
        raise NotImplementedError

    def _load_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize `block_ids` -> k, v `[nb, block_size, H, D]` in self.dtype."""
        raise NotImplementedError

    def dequant_fields(self, layer: int) -> tuple[DequantField, DequantField]:
        """K and V of `layer` as stored (sealed blocks; open ones are in `residual(layer)`)."""
        raise NotImplementedError

    def residual(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The open blocks of `layer`: (rows `[entries, 2, bs, H, D]`, entry per block `[num_blocks]`,
        -1 when sealed), or None for a cache without a residual pool."""
        return (self.res_kv[layer], self.block_res[layer]) if self.staged else None

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
        src_slots, dst_slots = copy_slot_indices(copies, self.block_size, self.num_blocks)
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
            raw = _raw(t)
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
            raw = _raw(t)
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

    def finish_step(self) -> None:
        if self.staged and self.seal_at_step_end:
            full = (self.res_owner >= 0) & self.res_mask.all(-1)  # [L, entries]
            if bool(full.any()):
                self._seal(*full.nonzero(as_tuple=True), full=True)

    def _seal(self, layer: int | torch.Tensor, entries: torch.Tensor, full: bool = False) -> None:
        """Quantize residual entries into their blocks and free them; `layer` is one layer or
        one per entry (the formats index their fields `[layer, block_ids]`, which takes both).
        `full`: the caller knows every entry is full (no padding), so the compiled quantizer may
        read them where they are."""
        if full and self._seal_compiled(layer, entries):
            return
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

    def _seal_compiled(self, layer: int | torch.Tensor, entries: torch.Tensor) -> bool:
        """`_seal` of full entries by the compiled quantizer, straight from the residual pool (the
        torch path gathers them as float32 first). At batch 64 some block fills in most decode
        steps; the torch path cost 1-5 ms per step (bench/NOTES.md, "Every format's blocks
        quantized by one compiled pass, bit-equal to the torch path")."""
        if self.res_kv.dtype not in (torch.float32, torch.bfloat16) or not self._quantizers():
            return False
        owners = self.res_owner[layer, entries]
        layers = torch.as_tensor(layer, dtype=torch.long).expand_as(entries)
        blk = self.block_size * self.num_kv_heads * self.head_dim
        base, es = self.res_kv.data_ptr(), self.res_kv.element_size()
        # res_kv is [L, entries, 2, bs, H, D]: entry e of layer l starts (l * entries + e) * 2 * blk in.
        source = BlockSource(base, base + blk * es, int(self.res_kv.dtype == torch.bfloat16), entries.numel(),
                             (layers * self.num_residual_blocks + entries.long()).contiguous(), 2 * blk)
        if not self._quantize_compiled((layers * self.num_blocks + owners).contiguous(), source):
            return False
        self.sealed_fill[layer, owners] = self.block_size
        self.block_res[layer, owners] = -1
        self.res_owner[layer, entries] = -1
        return True

    def _grow_residual(self, extra: int) -> None:
        """Add `extra` entries (rounded up to 8) to every layer's residual pool. The pool is sized
        for one open block per running sequence plus one (residual_blocks_for), but a step whose
        prompt chunks start and end mid-block opens two blocks per chunk: four such prompts at
        --max-num-seqs 4 needed 8 entries of 5 and failed the step (when prefix hits inside a
        quantized cache's block were still copied on write). Growing costs memory
        beyond the planned KV budget, so it is logged; existing entries keep their indices, and
        kernels that cached the pool's address see `residual_generation` change."""
        extra = -(-extra // 8) * 8
        L, dev = self.num_layers, self.device
        rest = self.res_kv.shape[2:]
        self.res_kv = torch.cat([self.res_kv, torch.zeros(L, extra, *rest, dtype=self.res_kv.dtype, device=dev)], 1)
        self.res_mask = torch.cat([self.res_mask, torch.zeros(L, extra, self.block_size, dtype=torch.bool,
                                                             device=dev)], 1)
        self.res_owner = torch.cat([self.res_owner, torch.full((L, extra), -1, dtype=torch.long, device=dev)], 1)
        self.res_clock = torch.cat([self.res_clock, torch.zeros(L, extra, dtype=torch.long, device=dev)], 1)
        self.num_residual_blocks += extra
        self.residual_generation += 1
        log.warning("KV residual pool grown by %d entries to %d (+%.1f MiB beyond the KV budget): one step's "
                    "writes left more blocks partly filled than the pool held (prompt chunks starting and "
                    "ending mid-block)", extra, self.num_residual_blocks,
                    extra * self.res_kv[0, 0].numel() * self.res_kv.element_size() * L / 2**20)

    def _allocate(self, layer: int, blocks: torch.Tensor, busy: torch.Tensor) -> torch.Tensor:
        """Residual entries for `blocks` (not yet in the pool); evicts LRU entries not in `busy`."""
        free = (self.res_owner[layer] < 0).nonzero().flatten()
        need = blocks.numel() - free.numel()
        if need > 0 and self.seal_at_step_end:  # blocks filled earlier and not yet sealed go first
            owners = self.res_owner[layer]
            filled = ((owners >= 0) & self.res_mask[layer].all(-1) & ~torch.isin(owners, busy)).nonzero().flatten()
            if filled.numel():
                self._seal(layer, filled, full=True)
                free = (self.res_owner[layer] < 0).nonzero().flatten()
                need = blocks.numel() - free.numel()
        if need > 0:
            owners = self.res_owner[layer]
            evictable = (owners >= 0) & ~torch.isin(owners, busy)
            cand = evictable.nonzero().flatten()
            if cand.numel() < need:  # every entry is busy in this very write: more entries, not a failed step
                self._grow_residual(need - cand.numel())
                free = (self.res_owner[layer] < 0).nonzero().flatten()
                need = blocks.numel() - free.numel()
            if need > 0:
                victims = cand[self.res_clock[layer, cand].argsort()[:need]]
                self._seal(layer, victims)
                self.residual_evictions += int(victims.numel())
                free = (self.res_owner[layer] < 0).nonzero().flatten()
        e = free[:blocks.numel()]
        self.res_owner[layer, e] = blocks
        self.block_res[layer, blocks] = e
        return e

    def _write_plan(self, slots: torch.Tensor) -> WritePlan:
        """Where `slots`' tokens go, by block (the same for every layer of a step, so worked out
        once: the engine writes each layer with the same slot tensor; `_version` catches a caller
        that edits it in place, where torch tracks it - inference tensors, the runner's, it does
        not, and the runner never edits a step's slot mapping)."""
        version = -1 if slots.is_inference() else slots._version
        if self._last_plan is not None and self._last_plan[0] is slots and self._last_plan[1] == version:
            return self._last_plan[2]
        plan = plan_write(slots, self.block_size)
        self._last_plan = (slots, version, plan)
        return plan

    def _write_staged(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        bs = self.block_size
        plan = self._write_plan(slots)
        if plan.whole is not None:
            # Blocks written entirely by this call skip the residual: quantize straight away.
            w = plan.whole
            shape = (w.blocks.numel(), bs, self.num_kv_heads, self.head_dim)
            self._release(layer, w.blocks)
            self._store_blocks(layer, w.blocks, k.index_select(0, w.source_rows).view(shape),
                               v.index_select(0, w.source_rows).view(shape))
            self.sealed_fill[layer, w.blocks] = bs
        if plan.part is None:
            return
        part = plan.part
        if not self._write_rows(layer, part, k, v):
            pb, fresh = part.blocks, part.fresh
            entry = self.block_res[layer, pb]
            missing = entry < 0
            if bool(missing.any()):
                new = self._allocate(layer, pb[missing], busy=plan.blocks)
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
            if not self._write_rows(layer, part, k, v):  # every block has its entry now: no re-run of the above
                self.res_mask[layer, entry[fresh]] = False
                self._write_rows_torch(layer, entry, part, k, v)
        if self.seal_at_step_end:
            return
        entry = self.block_res[layer, part.blocks]
        done = self.res_mask[layer, entry].all(1)
        if bool(done.any()):
            self._seal(layer, entry[done], full=True)

    def _write_rows(self, layer: int, part: Placement, k: torch.Tensor, v: torch.Tensor) -> bool:
        """The compiled residual write: one call instead of the torch ops below, blocks new to the
        pool given free entries as `_allocate` gives them. False, having written nothing, when it
        does not apply (another device or dtype, strided rows) or the Python path must run (a
        block to re-open, or too few free entries: sealing or eviction first)."""
        if self._row_write is None:
            from kvserve.ops.cpu_kernels import residual_write_kernel
            self._row_write = (residual_write_kernel() if self.device.type == "cpu" else None) or False
        if not self._row_write or not self._row_write_applies(part, k, v):
            return False
        def layer_of(t: torch.Tensor) -> int:  # layer's slice of a pool tensor, without making a view
            return t.data_ptr() + layer * t.stride(0) * t.element_size()

        es, bs, rows = k.element_size(), self.block_size, part.rows
        self._clock[layer] += 1
        rc = self._row_write(layer_of(self.block_res), self.num_blocks, layer_of(self.res_owner),
                             self.num_residual_blocks, layer_of(self.sealed_fill), layer_of(self.res_mask),
                             layer_of(self.res_clock), layer_of(self.res_kv),
                             part.blocks.data_ptr(), part.fresh.data_ptr(), part.blocks.numel(),
                             part.index.data_ptr(), part.offs.data_ptr(), 0 if rows is None else rows.data_ptr(),
                             part.index.numel(), k.data_ptr(), v.data_ptr(), k.shape[0], k.stride(0) * es,
                             v.stride(0) * es, self.num_kv_heads * self.head_dim * es, bs, self._clock[layer])
        if rc:
            self._clock[layer] -= 1
        return rc == 0

    def _row_write_applies(self, part: Placement, k: torch.Tensor, v: torch.Tensor) -> bool:
        """What the compiled write takes: the pool's dtype, rows of H*D contiguous elements, and
        contiguous int64 / bool placement tensors (it reads them as raw arrays)."""
        index_ok = all(t.dtype == torch.long and t.is_contiguous()
                       for t in (part.blocks, part.index, part.offs, *(() if part.rows is None else (part.rows,))))
        return (index_ok and part.fresh.dtype == torch.bool and part.fresh.is_contiguous()
                and k.dtype == v.dtype == self.res_kv.dtype and k.shape == v.shape
                and k.stride()[1:] == (self.head_dim, 1) and v.stride()[1:] == (self.head_dim, 1))

    def _write_rows_torch(self, layer: int, entry: torch.Tensor, part: Placement, k: torch.Tensor,
                          v: torch.Tensor) -> None:
        """`_write_rows` in torch ops, `entry` being the blocks' residual entries (all present)."""
        bs = self.block_size
        self._clock[layer] += 1
        self.res_clock[layer, entry] = self._clock[layer]
        e_tok, offs = entry[part.index], part.offs
        if part.rows is not None:
            k, v = k.index_select(0, part.rows), v.index_select(0, part.rows)
        # Row copies into the layer's pool seen as [entries * 2 * bs, H * D]: K rows of entry e at
        # e * 2 * bs + offs, V rows bs further (index_put with two index tensors is far slower).
        rows = self.res_kv[layer].view(-1, self.num_kv_heads * self.head_dim)
        k_rows = e_tok * (2 * bs) + offs
        rows.index_copy_(0, k_rows, k.reshape(k.shape[0], -1).to(rows.dtype))
        rows.index_copy_(0, k_rows + bs, v.reshape(v.shape[0], -1).to(rows.dtype))
        self.res_mask[layer, e_tok, offs] = True
