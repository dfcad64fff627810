"""The decoder stack in one compiled call on CPU (csrc/decoder_bf16.cpp).

`LlamaModel.forward` calls ~8 compiled kernels per layer from Python; at batch 1 the Python
between them is ~15 % of a step (bench/NOTES.md, "The layer loop as one compiled call"). Where
every one of those calls is a compiled kernel (bf16 on a CPU with AVX512-BF16: packed projections
with their rotary and SiLU epilogues, the fused residual-add + RMSNorm, and the varlen attention kernel over a "pairs"
cache), `run_decoder_bf16` makes the same calls with the same arguments in a C loop over the
layers, so its output is bit-identical to the Python loop's. Everything else (float32, biases,
quantized caches, other devices) keeps the Python loop.

The model's weights, shapes and kernels are fixed at load and go into one `ModelC` structure,
bound to the KV cache on the first step over it; a step only fills a `StepC` with its rows and
the varlen kernel's per-sequence arguments, built once per step as for the Python loop.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.model.linear import Linear
from kvserve.model.lora import GROUPS
from kvserve.ops.cpu_kernels import load_library, lora_gemm_for

if TYPE_CHECKING:
    from kvserve.attention.cpu import VarlenPlan
    from kvserve.model.llama import LlamaModel
    from kvserve.model.lora import LoRASlots, LoRAStep

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class ProjectionC(ctypes.Structure):  # decoder_bf16.cpp's Projection
    _fields_ = [("gemm", _P), ("weight", _P), ("lora_gemm", _P)]


class LayerC(ctypes.Structure):  # decoder_bf16.cpp's DecoderLayer
    _fields_ = [(name, ProjectionC) for name in ("qkv", "o", "gate_up", "down")] + [
        (name, _P) for name in ("input_norm", "post_attn_norm", "k_cache", "v_cache")]


class LoRAC(ctypes.Structure):  # decoder_bf16.cpp's DecoderLoRA
    _fields_ = [("shrink", _P), ("a", _P * 4), ("b", _P * 4), ("a_stride", _I64 * 4), ("b_stride", _I64 * 4),
                ("block", _I64 * 4), ("parts", _I64 * 4), ("panel_koff", _P * 4), ("rank", _I64),
                ("shrink_rows", _I64), ("num_slots", _I64)]


_GROUPS = ("qkv", "o", "gate_up", "down")  # DecoderLoRA's order


class ModelC(ctypes.Structure):  # decoder_bf16.cpp's DecoderModel
    _fields_ = [("attention", _P),
                ("layers", ctypes.POINTER(LayerC)), ("num_layers", _INT),
                ("final_norm", _P), ("hidden", _I64), ("inter", _I64), ("hq", _INT), ("hkv", _INT),
                ("head_dim", _INT), ("qkv_epilogue", _INT), ("gate_up_epilogue", _INT), ("eps", _F),
                ("scale", _F), ("window", _I64), ("lora", ctypes.POINTER(LoRAC))]


class StepC(ctypes.Structure):  # decoder_bf16.cpp's DecoderStep
    _fields_ = [("T", _I64), ("h", _P), ("x", _P), ("qkv", _P), ("attn", _P), ("proj", _P), ("act", _P),
                ("cos", _P), ("sin_signed", _P), ("slots", _P), ("n", _INT), ("q_start", _P), ("q_len", _P),
                ("block_tables", _P), ("bt_stride", _I64), ("seq_lens", _P), ("block_size", _INT),
                ("ngroups", _INT), ("group_start", _P), ("group_members", _P), ("group_prefix", _P),
                ("out_rows", _P), ("n_out", _I64), ("n_score", _INT), ("score_seqs", _P), ("score_rows", _P),
                ("scores", _P), ("nseg", _INT), ("seg", _P), ("row_slot", _P),
                ("nseg_out", _INT), ("seg_out", _P), ("row_slot_out", _P), ("lora_s", _P * 4)]


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def unsupported(model: LlamaModel) -> str | None:
    """Why the model's layers cannot run as one compiled call, or None when they can (the KV
    cache is checked when the decoder is bound to it)."""
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return f"runs bf16 on CPU only (model: {model.dtype} on {model.device})"
    lib = load_library()
    if lib is None or not lib.elementwise_bf16_available():
        return "the compiled kernels are unavailable (no compiler, or no AVX512-BF16)"
    for i, layer in enumerate(model.layers):
        for name, lin in layer.projections().items():
            if lin.gemm is None:
                return f"layer {i} {name} is not on a compiled projection kernel (a bias, or an odd shape)"
        if layer.qkv_proj.epilogue is None or layer.gate_up_proj.epilogue is None:
            return f"layer {i} does not fuse rotary / SiLU into its projections"
    return None


class CompiledDecoder:
    """`LlamaModel.forward`'s layer loop as one call of `run_decoder_bf16`, over one KV cache."""

    def __init__(self, model: LlamaModel, attention_kernel, k_blocks: list[torch.Tensor],
                 v_blocks: list[torch.Tensor], block_size: int) -> None:
        c, attn = model.config, model.attn
        layers = model.layers

        def projection(lin: Linear) -> ProjectionC:  # its kernel: bf16 panels, or GGUF codes
            twin = lora_gemm_for(lin.gemm[0])
            return ProjectionC(_address(lin.gemm[0]), lin.gemm[1].data_ptr(), _address(twin) if twin else None)

        self._layers = (LayerC * len(layers))(*(
            LayerC(*(projection(lin) for lin in L.projections().values()), L.input_norm.data_ptr(),
                   L.post_attn_norm.data_ptr(), k.data_ptr(), v.data_ptr())
            for L, k, v in zip(layers, k_blocks, v_blocks)))
        # Every tensor whose address the structures hold, so that they outlive this decoder.
        self._keep = ([lin.gemm[1] for L in layers for lin in L.projections().values()],
                      [t for L in layers for t in (L.input_norm, L.post_attn_norm)], model.norm, k_blocks, v_blocks)
        self.model = ModelC(
            attention=_address(attention_kernel), layers=self._layers,
            num_layers=len(layers), final_norm=model.norm.data_ptr(), hidden=c.hidden_size,
            inter=layers[0].gate_up_proj.out_features // 2, hq=c.num_attention_heads, hkv=c.num_key_value_heads,
            head_dim=c.head_dim, qkv_epilogue=layers[0].qkv_proj.epilogue.kind,
            gate_up_epilogue=layers[0].gate_up_proj.epilogue.kind, eps=c.rms_norm_eps, scale=attn.scale,
            window=attn.sliding_window or 0)
        self.block_size = block_size
        self._run = load_library().run_decoder_bf16
        # the projections' kernels all have a LoRA twin (AMX), so LoRA steps can run here
        self.takes_lora = all(p.lora_gemm for L in self._layers for p in (L.qkv, L.o, L.gate_up, L.down))
        self.q_size = c.num_attention_heads * c.head_dim
        self.qkv_size = self.q_size + 2 * c.num_key_value_heads * c.head_dim
        self._lora_c: tuple[LoRASlots, LoRAC] | None = None

    def _lora(self, slots: LoRASlots) -> LoRAC:
        """The packed adapter slots as decoder_bf16.cpp reads them (built once per LoRASlots)."""
        if self._lora_c is None or self._lora_c[0] is not slots:
            per_slot = {g: (slots.pa[g].shape[2], slots.pb[g].shape[2]) for g in _GROUPS}
            c = LoRAC(_address(slots.kernels.grouped), (_P * 4)(*(slots.pa[g].data_ptr() for g in _GROUPS)),
                      (_P * 4)(*(slots.pb[g].data_ptr() for g in _GROUPS)),
                      (_I64 * 4)(*(per_slot[g][0] for g in _GROUPS)), (_I64 * 4)(*(per_slot[g][1] for g in _GROUPS)),
                      (_I64 * 4)(*(slots.block(g) for g in _GROUPS)), (_I64 * 4)(*(len(GROUPS[g]) for g in _GROUPS)),
                      (_P * 4)(*(slots.panel_koff[g].data_ptr() for g in _GROUPS)), slots.rank, slots.shrink_rows,
                      slots.num_slots)
            self._lora_c = (slots, c)
        return self._lora_c[1]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slot_mapping: torch.Tensor,
                plan: VarlenPlan, out_rows: torch.Tensor | None = None,
                score_seqs: list[int] | None = None, score_rows: list[tuple[int, int]] | None = None,
                lora: LoRAStep | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: the embedded tokens `[T, hidden]` (the residual stream, updated in place); cos and
        sin_signed `[T, 1, head_dim]` (`LlamaModel.rope_cos_sin`); slot_mapping `[T]` int64; the
        step's varlen arguments; out_rows: strictly ascending int64 row indices, or None (all);
        score_seqs: sequences whose attention per block is summed (h2o, snapkv), or None, and for
        each its (last, stride): the chunk's last rows scored, every stride-th of them;
        lora: the step's rows with an adapter, over packed slots (model/lora.py).
        Returns the final-normed hidden states of those rows, `[len(out_rows) or T, hidden]`, and
        the scores `[len(score_seqs), table width]` float32 (None without score_seqs): row k's
        first ceil(seq_len / block_size) entries are the mass its table's blocks received, summed
        over layers, heads and the sequence's query rows."""
        t, m = h.shape[0], self.model
        x = torch.empty_like(h)
        qkv = torch.empty(t, self.qkv_size, dtype=h.dtype)
        attn = torch.empty(t, self.q_size, dtype=h.dtype)
        proj = torch.empty_like(h)
        act = torch.empty(t, m.inter, dtype=h.dtype)
        slots = slot_mapping.contiguous()
        g = plan.groups
        scores = seqs = rows = None
        if score_seqs:
            seqs = torch.tensor(score_seqs, dtype=torch.int64)
            rows = torch.tensor(score_rows, dtype=torch.int64).reshape(-1)
            scores = torch.zeros(len(score_seqs), plan.block_tables.shape[1], dtype=torch.float32)
        step = StepC(t, h.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), proj.data_ptr(), act.data_ptr(),
                     cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), plan.q_len.numel(),
                     plan.q_start.data_ptr(), plan.q_len.data_ptr(), plan.block_tables.data_ptr(),
                     plan.block_tables.shape[1], plan.seq_lens.data_ptr(), self.block_size, g.num_groups,
                     g.start.ctypes.data, g.members.ctypes.data, g.prefix_len.ctypes.data,
                     None if out_rows is None else out_rows.data_ptr(), t if out_rows is None else out_rows.numel(),
                     0 if seqs is None else seqs.numel(), None if seqs is None else seqs.data_ptr(),
                     None if rows is None else rows.data_ptr(), None if scores is None else scores.data_ptr())
        m.lora = None
        keep = []  # the step's LoRA arrays, alive until the call returns
        if lora is not None:
            lora_slots = lora.slots
            m.lora = ctypes.pointer(self._lora(lora_slots))
            seg, row_slots = lora.batch.absolute(), lora.row_slots(t)
            kept = lora.restrict(out_rows, pad=False) if out_rows is not None else None
            seg_out = kept.batch.absolute() if kept is not None else np.zeros((0, 3), dtype=np.int64)
            rows_out = kept.row_slots(out_rows.numel()) if kept is not None else np.full(t, -1, dtype=np.int32)
            s_bufs = [torch.zeros(t, lora_slots.num_slots * lora_slots.block(g), dtype=h.dtype) for g in _GROUPS]
            keep = [seg, row_slots, seg_out, rows_out, s_bufs]
            step.nseg, step.seg, step.row_slot = len(seg), seg.ctypes.data, row_slots.ctypes.data
            step.nseg_out, step.seg_out, step.row_slot_out = len(seg_out), seg_out.ctypes.data, rows_out.ctypes.data
            step.lora_s = (_P * 4)(*(b.data_ptr() for b in s_bufs))
        rc = self._run(ctypes.byref(m), ctypes.byref(step))
        del keep
        if rc != 0:
            raise RuntimeError(f"run_decoder_bf16: the attention kernel has no instance for block size "
                               f"{self.block_size} in this build (code {rc})")
        return (x if out_rows is None else x[:out_rows.numel()]), scores
