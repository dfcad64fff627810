"""LoRA adapters on the decoder's fused projections: PEFT directories in, per-segment deltas out.

An adapter's q/k/v (and gate/up) modules land on the fused q/k/v (gate/up) projection: its
lora_A matrices stacked (`[3R, hidden]`), its lora_B matrices block-diagonal (`[q+2kv, 3R]`,
the scale folded in), so one shrink and one expand product give the three deltas side by side,
in the fused output's column order. Adapters live in `LoRASlots`, preallocated at start-up
(`--max-loras` slots of `--max-lora-rank`, zero-padded: padded rank columns add exact zeros).

A step's rows are grouped by adapter slot (`LoRABatch`): each segment of rows sharing an adapter
is one pair of GEMMs (x[seg] A^T B^T, the SGMV idea of punica and vLLM), added onto the base
projection's output for those rows only; rows of the base model are not touched. The delta is
added before the rotary / SiLU epilogue, as PEFT adds it to the projection's output.

Two places run it. The Python layer loop: torch GEMMs per segment over torch slots. The compiled
layer loop (bf16 on AMX, slots also packed, `packing_kernels`): one grouped kernel call for every
segment's shrink, and the expand as extra k-steps of the base projection's own product, so the
delta is in the accumulator before the epilogue and the output is written once
(csrc/gemm_grouped.h).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT module name -> (fused projection, position among its parts)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter cannot be used with this model or these settings; the message says why and what to change."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT target module -> (out_features, in_features) of the base model's projection."""
    q, kv, h, i = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def group_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Fused projection -> (out_features, in_features)."""
    m = module_shapes(cfg)
    return {g: (sum(m[p][0] for p in parts), m[parts[0]][1]) for g, parts in GROUPS.items()}


def packing_kernels(cfg: ModelConfig, dtype: torch.dtype, lora_dtype: torch.dtype, device: torch.device):
    """The AMX projection kernels (ops/cpu_kernels.GemmBf16) that adapter slots are also packed
    for, so that the compiled layer loop adds the deltas inside its projections; None where the
    slots are torch tensors only: not a bf16 model with bf16 slots on a CPU with AMX, or shapes
    the kernels do not take (every part's outputs in whole 32-column halves)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or lora_dtype != torch.bfloat16:
        return None
    from kvserve.ops.cpu_kernels import gemm_bf16_kernels
    kernels = gemm_bf16_kernels()
    if kernels is None or kernels.grouped is None:
        return None
    shapes = module_shapes(cfg)
    if any(n_out % 64 or n_in % kernels.k_multiple for n_out, n_in in group_shapes(cfg).values()) or \
            any(n_out % 32 for n_out, _ in shapes.values()):
        return None
    return kernels


def packed_rank(max_rank: int) -> tuple[int, int, int]:
    """(k of B per panel, A rows per part, s columns per part): the rank made even (bf16 pairs),
    rounded up to a 16-column panel (the shrink's N), and to a 32-k AMX step."""
    return max_rank + max_rank % 2, -(-max_rank // 16) * 16, -(-max_rank // 32) * 32


def slot_bytes(cfg: ModelConfig, max_rank: int, dtype: torch.dtype, kernels=None) -> int:
    """Bytes one adapter slot takes: every layer's stacked A and block-diagonal B at max_rank as
    torch tensors, and where `kernels` is given the packed copy LoRASlots also keeps."""
    size = torch.empty(0, dtype=dtype).element_size()
    per_layer = sum(len(GROUPS[g]) * max_rank * (n_in + n_out) for g, (n_out, n_in) in group_shapes(cfg).items())
    if kernels is not None:
        rank, rows, _ = packed_rank(max_rank)
        per_layer += sum(len(GROUPS[g]) * rows * n_in + n_out * rank + _B_PAD
                         for g, (n_out, n_in) in group_shapes(cfg).items())
    return per_layer * cfg.num_hidden_layers * size


# Zeros after each packed B: a k-step reads 32 k of a panel of `rank`, past the slot's last one.
_B_PAD = 16 * 32


def adapter_digest(path: str) -> str:
    """SHA-256 of the adapter's config and weights files: what its K/V depend on."""
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, module) lora_A `[r, in]` and scale * lora_B `[out, r]`."""
    name: str
    path: str
    digest: str
    rank: int
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory; give a PEFT adapter directory "
                        f"(with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{cfg_path} is missing; a LoRA adapter is a PEFT directory with {ADAPTER_CONFIG} "
                        f"and {ADAPTER_WEIGHTS} (save it with PeftModel.save_pretrained)") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_path} cannot be read as JSON ({e}); re-save the adapter") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{cfg_path} is not a JSON object; re-save the adapter")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{cfg_path}: peft_type {peft_type} is not supported; only LoRA adapters are")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained extra modules)"}
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{cfg_path}: {what} is not supported; train the adapter without {key}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_path}: bias={config['bias']!r} is not supported; train with bias='none'")
    if config.get("alpha_pattern"):
        raise LoRAError(f"{cfg_path}: alpha_pattern is not supported; give every module the same lora_alpha")
    return config


def load_adapter(path: str, name: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                 digest: str | None = None, shard: tuple[ModelConfig, int, int] | None = None) -> LoRAAdapter:
    """Read and check a PEFT adapter directory for this model. Raises LoRAError naming what is wrong.
    `shard`: (the whole model's config, rank, tensor-parallel size): the adapter is checked
    against the whole model, then split as the rank's projections are (model/shard.py)."""
    if shard is not None:
        cfg = shard[0]
    config = _read_config(path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise LoRAError(f"{weights_path} is missing; kvserve reads adapters in safetensors format "
                        f"(PeftModel.save_pretrained(..., safe_serialization=True))")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"{weights_path} is not a readable safetensors file ({e}); re-save the adapter") from None
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora", False))
    shapes = module_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            module = m.group(2) if m else re.split(r"\.(?:lora_|base_layer|weight)", key.removeprefix("base_model.model."))[0]
            raise LoRAError(f"{weights_path}: target module {module!r} is not supported; kvserve applies LoRA to "
                            f"{', '.join(TARGETS)} only (retrain with target_modules among those)")
        layer = int(m.group(1))
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"{weights_path}: {key} is for layer {layer}, but the base model has "
                            f"{cfg.num_hidden_layers} layers; the adapter was trained for another base model")
        parts.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    if not parts:
        raise LoRAError(f"{weights_path} holds no lora_A / lora_B weights; re-save the adapter")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(parts.items(), key=lambda kv: (kv[0][0], list(TARGETS).index(kv[0][1]))):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{weights_path}: {where} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        n_out, n_in = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
            raise LoRAError(f"{weights_path}: {where}: the adapter's lora_A is {list(a.shape)} and lora_B "
                            f"{list(b.shape)}, but the base model's {module} is [{n_out}, {n_in}] (lora_A must "
                            f"be [r, {n_in}], lora_B [{n_out}, r]); the adapter was trained for another base model")
        if r > max_rank:
            raise LoRAError(f"{path}: rank {r} ({where}) is above --max-lora-rank {max_rank}; raise "
                            f"--max-lora-rank to at least {r}")
        rank = max(rank, r)
        scale = alpha / (math.sqrt(r) if rslora else r)
        if shard is not None:
            from kvserve.model.shard import shard_lora
            a, b = shard_lora(module, a, b, *shard)
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return LoRAAdapter(name, path, digest or adapter_digest(path), rank,
                       tuple(sorted({m for _, m in weights}, key=list(TARGETS).index)), weights)


class LoRASlots:
    """The adapters a step may use, preallocated: S = --max-loras slots of R = --max-lora-rank.

    As torch tensors per layer and fused projection (the Python layer loop's): A^T `a`
    `[S, in, P*R]` (P parts side by side) and B^T `b` `[S, P*R, out]` (block-diagonal), B^T's
    columns in the gate/up projection's SiLU epilogue order where it has one (the q/k/v delta is
    rotated apart, LlamaModel._qkv_rotated_plus_lora).

    With `kernels` (packing_kernels), also packed for the compiled layer loop
    (csrc/decoder_bf16.cpp, gemm_grouped.h's LoRAExt): per fused projection g, `pa[g]`
    `[layers, S, P * shrink_rows * in]`, each part's A a packed weight of its own (a shrink per part
    writes its rank columns at a 32-aligned offset of the row's block of s; the zeros between stay
    from the start of the step), and `pb[g]` `[layers, S, out * rank + pad]`:
    for each 16-column panel of the projection's packed output order (its epilogue's), only its
    part's B rows, `rank` k each; `panel_koff[g]` says which part's columns of s a panel reads.
    A delta then costs its adapter's exact B bytes, added inside the base product before its
    rotary or SiLU epilogue."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, orders: dict[str, torch.Tensor | None] | None = None,
                 kernels=None) -> None:
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        self.shapes = module_shapes(cfg)
        orders = {g: o for g, o in (orders or {}).items() if o is not None}
        self.orders = {g: o for g, o in orders.items() if g != "qkv"}  # the torch tensors'
        self.kernels = kernels
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_hidden_layers):
            self.a.append({})
            self.b.append({})
            for g, (n_out, n_in) in group_shapes(cfg).items():
                pr = len(GROUPS[g]) * max_rank
                self.a[-1][g] = torch.zeros(num_slots, n_in, pr, dtype=dtype, device=device)
                self.b[-1][g] = torch.zeros(num_slots, pr, n_out, dtype=dtype, device=device)
        self.pa: dict[str, torch.Tensor] = {}
        self.pb: dict[str, torch.Tensor] = {}
        self.panel_koff: dict[str, torch.Tensor] = {}
        self.packed_orders: dict[str, torch.Tensor] = orders
        self.rank, self.shrink_rows, self.part_cols = packed_rank(max_rank)
        if kernels is None:
            return
        for g, (n_out, n_in) in group_shapes(cfg).items():
            parts = GROUPS[g]
            self.pa[g] = torch.zeros(cfg.num_hidden_layers, num_slots, len(parts) * self.shrink_rows * n_in, dtype=dtype)
            self.pb[g] = torch.zeros(cfg.num_hidden_layers, num_slots, n_out * self.rank + _B_PAD, dtype=dtype)
            order = orders.get(g)
            cols = order if order is not None else torch.arange(n_out)
            part_of = torch.repeat_interleave(torch.arange(len(parts)),
                                              torch.tensor([self.shapes[m][0] for m in parts]))[cols]
            panels = part_of.view(-1, 16)
            if not (panels == panels[:, :1]).all():
                raise ValueError(f"{g}: a 16-column panel spans two parts")  # packing_kernels rules this out
            self.panel_koff[g] = (panels[:, 0] * self.part_cols).to(torch.int32).contiguous()

    @property
    def packed(self) -> bool:
        return self.kernels is not None

    def block(self, group: str) -> int:
        """Columns of s per slot for a fused projection (packed slots)."""
        return len(GROUPS[group]) * self.part_cols

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in (*self.a, *self.b) for t in layer.values()] + [*self.pa.values(), *self.pb.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _parts(self, layer: int, group: str, adapter: LoRAAdapter):
        """(part, row offset of its outputs, A `[r, in]`, B `[out, r]`) of the adapter's modules in the group."""
        row = 0
        for p, module in enumerate(GROUPS[group]):
            w = adapter.weights.get((layer, module))
            if w is not None:
                yield p, row, w[0], w[1]
            row += self.shapes[module][0]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put the adapter in a slot: its matrices at their parts' rows and columns, zeros elsewhere."""
        r = self.max_rank
        for layer, (a_g, b_g) in enumerate(zip(self.a, self.b)):
            for g, parts in GROUPS.items():
                a, b = a_g[g][slot], b_g[g][slot]
                a.zero_()
                b_t = torch.zeros(b.shape[1], b.shape[0], dtype=b.dtype, device=b.device)  # [out, P*R]
                for p, row, wa, wb in self._parts(layer, g, adapter):
                    k = wa.shape[0]
                    a[:, p * r:p * r + k].copy_(wa.t())
                    b_t[row:row + wb.shape[0], p * r:p * r + k].copy_(wb)
                order = self.orders.get(g)
                b.copy_((b_t if order is None else b_t[order.to(b.device)]).t())
                if self.packed:
                    self._pack(layer, slot, g, adapter)

    def _pack(self, layer: int, slot: int, group: str, adapter: LoRAAdapter) -> None:
        n_out, n_in = sum(self.shapes[m][0] for m in GROUPS[group]), self.shapes[GROUPS[group][0]][1]
        rows = self.shrink_rows
        a = torch.zeros(len(GROUPS[group]), rows, n_in, dtype=self.dtype)  # each part's own packed weight
        b = torch.zeros(n_out, self.rank, dtype=self.dtype)  # each output's own part's B row
        for p, row, wa, wb in self._parts(layer, group, adapter):
            a[p, :wa.shape[0]].copy_(wa)
            b[row:row + wb.shape[0], :wb.shape[1]].copy_(wb)
        order = self.packed_orders.get(group)
        if order is not None:
            b = b[order].contiguous()
        dst = self.pa[group][layer, slot].view(len(GROUPS[group]), rows * n_in)
        for p in range(len(GROUPS[group])):
            self.kernels.pack(a[p].data_ptr(), rows, n_in, dst[p].data_ptr())
        self.kernels.pack(b.data_ptr(), n_out, self.rank, self.pb[group][layer, slot].data_ptr())


@dataclass
class LoRABatch:
    """A step's rows that run with an adapter: rows lo..hi, in segments (slot, start, end) of
    rows sharing a slot, ascending (the runner orders a step's requests by slot, base rows first).
    Where padding every slot's segment to the longest wastes little (decode), one batched GEMM
    over all slots replaces the loop over segments: `pad_index` gathers the padded rows,
    `valid_index` picks the real ones back."""
    lo: int
    hi: int
    segments: list[tuple[int, int, int]]
    num_slots: int
    pad_len: int = 0
    pad_index: torch.Tensor | None = None
    valid_index: torch.Tensor | None = None

    @classmethod
    def build(cls, segments: list[tuple[int, int, int]], num_slots: int, device: torch.device,
              pad: bool = True) -> "LoRABatch | None":
        """`pad`: plan the batched GEMM where it pays (torch slots; packed ones run per segment)."""
        segments = [s for s in segments if s[2] > s[1]]
        if not segments:
            return None
        lo, hi = segments[0][1], segments[-1][2]
        rel = [(slot, a - lo, b - lo) for slot, a, b in segments]
        batch = cls(lo, hi, rel, num_slots)
        longest = max(b - a for _, a, b in rel)
        if pad and num_slots * longest <= 2 * (hi - lo):
            pad = np.zeros((num_slots, longest), dtype=np.int64)
            valid = []
            for slot, a, b in rel:
                pad[slot, :b - a] = np.arange(a, b)
                valid.append(slot * longest + np.arange(b - a))
            batch.pad_len = longest
            flat, valid = pad.reshape(-1), np.concatenate(valid)
            if flat.size == hi - lo and (flat == np.arange(flat.size)).all():
                return batch  # every slot one segment of the same length, in order: no padding to do
            batch.pad_index = torch.from_numpy(flat).to(device)
            batch.valid_index = torch.from_numpy(valid).to(device)
        return batch

    def restrict(self, out_rows: torch.Tensor, device: torch.device, pad: bool = True) -> "LoRABatch | None":
        """The same batch over the rows `out_rows` keeps (LlamaModel.forward's last layer),
        renumbered as positions in out_rows (a segment's kept rows stay contiguous there)."""
        keep = out_rows.cpu().numpy()
        segments = [(slot, int(np.searchsorted(keep, self.lo + a)), int(np.searchsorted(keep, self.lo + b)))
                    for slot, a, b in self.segments]
        return LoRABatch.build(segments, self.num_slots, device, pad)

    def absolute(self) -> np.ndarray:
        """The segments as rows (slot, start, end) of the step: int64 `[n, 3]` (decoder_bf16.cpp's)."""
        return np.array([(slot, self.lo + a, self.lo + b) for slot, a, b in self.segments], dtype=np.int64)


@functools.lru_cache(maxsize=None)
def _triton_usable(device: torch.device) -> bool:
    from kvserve.attention.triton import triton_support
    return triton_support(device).available


class LoRAStep:
    """What LlamaModel.forward needs to add a step's LoRA deltas: the slots and the step's rows."""

    def __init__(self, slots: LoRASlots, batch: LoRABatch) -> None:
        self.slots, self.batch = slots, batch
        self._slots_on_device: torch.Tensor | None = None  # each row's slot, for the Triton kernel

    @property
    def rows(self) -> slice:
        return slice(self.batch.lo, self.batch.hi)

    @property
    def packed(self) -> bool:
        return self.slots.packed

    def restrict(self, out_rows: torch.Tensor, pad: bool = True) -> "LoRAStep | None":
        batch = self.batch.restrict(out_rows, out_rows.device, pad)
        return None if batch is None else LoRAStep(self.slots, batch)

    def delta(self, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """x[rows] A^T B^T for each segment's adapter, `[hi - lo, out]` in the slots' dtype."""
        b = self.batch
        a_t, b_t = self.slots.a[layer][group], self.slots.b[layer][group]
        xs = x[b.lo:b.hi]
        if xs.is_cuda and _triton_usable(xs.device):  # every adapter's rows in two launches
            from kvserve.model.lora_triton import lora_delta
            if self._slots_on_device is None:
                rows = self.row_slots(b.hi)[b.lo:b.hi]
                self._slots_on_device = torch.from_numpy(rows).to(xs.device)
            return lora_delta(xs, self._slots_on_device, a_t, b_t)
        if xs.dtype != a_t.dtype:
            xs = xs.to(a_t.dtype)
        if b.pad_len:
            padded = xs if b.pad_index is None else xs.index_select(0, b.pad_index)
            out = torch.bmm(torch.bmm(padded.view(b.num_slots, b.pad_len, -1), a_t), b_t)
            out = out.view(-1, out.shape[-1])
            return out if b.valid_index is None else out.index_select(0, b.valid_index)
        out = torch.empty(xs.shape[0], b_t.shape[-1], dtype=a_t.dtype, device=xs.device)
        for slot, lo, hi in b.segments:
            torch.mm(torch.mm(xs[lo:hi], a_t[slot]), b_t[slot], out=out[lo:hi])
        return out

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """y[rows] += the delta (y `[T, out]`, in place)."""
        y[self.batch.lo:self.batch.hi] += self.delta(x, layer, group)  # rounded to y's dtype once
        return y

    def row_slots(self, num_rows: int) -> np.ndarray:
        """Each row's slot, -1 for base-model rows: int32 `[num_rows]` (gemm_grouped.h's row_slot)."""
        out = np.full(num_rows, -1, dtype=np.int32)
        for slot, a, b in self.batch.segments:
            out[self.batch.lo + a:self.batch.lo + b] = slot
        return out
