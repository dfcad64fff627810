"""Llama / Mistral / Qwen2 decoder over the flattened tokens of every sequence in a step.

Numerics follow transformers' modeling_llama so that float32 logits agree to ~1e-5: RMSNorm in
float32 then cast back before the weight, RoPE with the rotate-half convention and cos/sin cast to
the activation dtype, residual stream in the model dtype. Q/K/V and gate/up projections are fused
at load time so each is one matmul.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.cache.base import KVCache
from kvserve.config import ModelConfig
from kvserve.model import cpu_decoder
from kvserve.model.fused import ElementwiseOps
from kvserve.model.linear import SILU_MUL, Epilogue, Linear, rope_epilogue, silu_mul_tiles
from kvserve.model.lora import LoRAStep
from kvserve.model.weight_codes import GGUFBlocks
from kvserve.model.weight_codes import cat as weight_codes_cat

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] in float32, as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported "
                              f"(supported: default, linear, llama3)")


class _Layer:
    """One decoder layer's weights, fused and cast."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, take, rope: Epilogue, codes) -> None:
        a, m = prefix + "self_attn.", prefix + "mlp."
        qkv_weight = torch.cat([take(a + f"{p}_proj.weight") for p in "qkv"])
        self.qkv_shape = tuple(qkv_weight.shape)
        biases = [w.get(a + f"{p}_proj.bias") for p in "qkv"]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError(f"{a}: q/k/v biases must be all present or all absent")
        qkv_bias = torch.cat([take(a + f"{p}_proj.bias") for p in "qkv"]) if biases[0] is not None else None
        self.qkv_proj = Linear(qkv_weight, qkv_bias, epilogue=rope,
                               codes=codes(*(a + f"{p}_proj.weight" for p in "qkv")))
        self.o_proj = Linear(take(a + "o_proj.weight"), take(a + "o_proj.bias") if a + "o_proj.bias" in w else None,
                             codes=codes(a + "o_proj.weight"))
        self.gate_up_proj = Linear(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
                                   epilogue=SILU_MUL, codes=codes(m + "gate_proj.weight", m + "up_proj.weight"))
        self.down_proj = Linear(take(m + "down_proj.weight"), codes=codes(m + "down_proj.weight"))
        self.input_norm = take(prefix + "input_layernorm.weight")
        self.post_attn_norm = take(prefix + "post_attention_layernorm.weight")

    def projections(self) -> dict[str, Linear]:
        """The four projections by attribute name, in decoder_bf16.cpp's DecoderLayer order."""
        return {"qkv_proj": self.qkv_proj, "o_proj": self.o_proj, "gate_up_proj": self.gate_up_proj,
                "down_proj": self.down_proj}


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu",
                 attention_backend: AttentionBackend | None = None,
                 weight_codes: dict[str, GGUFBlocks] | None = None) -> None:
        """`weight_codes`: GGUF blocks of some weights (loader.LoadedModel.codes), which bf16
        projections on AMX CPUs keep and read instead of bf16 copies (model/linear.py)."""
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {config.architecture!r} is not supported; "
                             f"kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint of {config.name}")
            return weights[name].to(device=self.device, dtype=dtype)

        def codes(*names: str) -> GGUFBlocks | None:
            return weight_codes_cat([weight_codes.get(n) for n in names]) if weight_codes else None

        c = config
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        expect_qkv = self.q_size + 2 * self.kv_size
        self.embed_tokens = take("model.embed_tokens.weight")
        rope = rope_epilogue(c.head_dim, self.q_size + self.kv_size)
        self.layers = [_Layer(weights, f"model.layers.{i}.", take, rope, codes) for i in range(c.num_hidden_layers)]
        for i, layer in enumerate(self.layers):
            if layer.qkv_shape != (expect_qkv, c.hidden_size):
                raise ValueError(f"layer {i}: fused qkv weight is {layer.qkv_shape}, "
                                 f"config implies ({expect_qkv}, {c.hidden_size}); check head_dim / heads")
        self.norm = take("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = Linear(self.embed_tokens, codes=codes("model.embed_tokens.weight"))
        else:
            self.lm_head = Linear(take("lm_head.weight"), codes=codes("lm_head.weight"))
        self.inv_freq = rope_inv_freq(c).to(self.device)
        self._rope_table = (torch.empty(0, c.head_dim, dtype=dtype),) * 2  # CPU: rope_cos_sin
        self.ops = ElementwiseOps(dtype, self.device)
        self.attn = attention_backend or CPUAttentionBackend(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, scale=c.head_dim ** -0.5,
            sliding_window=c.sliding_window)
        # The layer loop as one compiled call where every op in it is a compiled kernel
        # (model/cpu_decoder.py); False keeps the Python loop (tests compare the two).
        self.use_compiled_decoder = True
        self._decoder_unsupported = cpu_decoder.unsupported(self)
        self._decoder: tuple[KVCache, cpu_decoder.CompiledDecoder | None] | None = None  # cache, loop over it
        # Tensor parallelism: sums a row-parallel projection's partial products across the ranks,
        # in place (runner/distributed.py). The compiled layer loop has no point to call it from,
        # so a sharded model runs the Python loop (its per-op compiled kernels still run).
        self.all_reduce = None

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2], float32 like HF
        cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [T, 1, D] and sin with the first half negated [T, 1, D], for `fused.apply_rope`.
        On CPU, rows of a table over positions 0 .. n-1, grown as positions need it: ten small
        ops per step took 0.17 ms of a batch-64 decode step, and a row is the same function of
        its position either way. Elsewhere computed per step (asynchronous there, and a CUDA
        graph's capture cannot read the largest position back)."""
        if positions.device.type != "cpu":
            cos, sin = self._rope_rows(positions)
        else:
            need = int(positions.max()) + 1 if positions.numel() else 0
            if need > self._rope_table[0].shape[0]:
                self._rope_table = self._rope_rows(torch.arange(max(need, 2 * self._rope_table[0].shape[0], 256)))
            cos, sin = self._rope_table[0][positions], self._rope_table[1][positions]
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache, out_rows: torch.Tensor | None = None,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden], or of out_rows only
        (strictly ascending int64 row indices on the model's device): the last layer's o
        projection and MLP then run on those rows alone. A prompt chunk's other rows feed nothing
        there (their K and V, all that later tokens read, come from the q/k/v projection), so a
        prefill step skips 1/num_layers of its o and MLP work; the rows kept are unchanged.
        `lora`: the step's rows that run with an adapter (model/lora.py), whose deltas are added to
        the projections before the rotary and SiLU passes: inside the compiled layer loop's
        products where the slots are packed for it, else in the Python loop."""
        c = self.config
        t = input_ids.shape[0]
        cos, sin = self.rope_cos_sin(positions)
        h = F.embedding(input_ids, self.embed_tokens)  # a copy: the residual stream is updated in place
        decoder = self.compiled_decoder(kv_cache) if self.all_reduce is None else None
        if lora is not None and decoder is not None and not (lora.packed and decoder.takes_lora):
            decoder = None
        if decoder is not None:
            meta = attn_metadata
            x, scores = decoder.forward(h, cos, sin, meta.slot_mapping, self.attn.varlen_plan(meta), out_rows,
                                        meta.score_seqs, meta.score_rows, lora)
            for k, i in enumerate(meta.score_seqs):  # score-based compression, scored in the loop
                meta.block_scores[i] = scores[k, :-(-meta.seq_lens[i] // meta.block_size)]
            return x
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        ops, eps = self.ops, c.rms_norm_eps
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            if lora is not None and layer.qkv_proj.epilogue is not None:
                qkv = self._qkv_rotated_plus_lora(layer, x, cos, sin, i, lora)
                qk = qkv[:, :self.q_size + self.kv_size].view(t, hq + hkv, d)
            elif lora is not None:
                qkv = lora.add(layer.qkv_proj(x), x, i, "qkv")
                qk = ops.rope(qkv[:, :self.q_size + self.kv_size].view(t, hq + hkv, d), cos, sin)
            elif layer.qkv_proj.epilogue is not None:  # the projection rotates q and k itself
                qkv = layer.qkv_proj(x, cos, sin)
                qk = qkv[:, :self.q_size + self.kv_size].view(t, hq + hkv, d)
            else:
                qkv = layer.qkv_proj(x)
                # q and k are adjacent columns of qkv: one rotary pass over both heads sets.
                qk = ops.rope(qkv[:, :self.q_size + self.kv_size].view(t, hq + hkv, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, self.q_size + self.kv_size:].view(t, hkv, d)
            o = self.attn.forward(i, q, k, v, kv_cache, attn_metadata)
            if attn_metadata.score_seqs:  # score-based compression (h2o, snapkv) in the step
                self.attn.score_blocks(i, q, kv_cache, attn_metadata)
            if out_rows is not None and i + 1 == len(self.layers):
                o, h, t = o[out_rows], h[out_rows], out_rows.numel()
                if t == 0:
                    self._reduce_scores(attn_metadata)
                    return h
                lora = lora.restrict(out_rows) if lora is not None else None
            o = o.reshape(t, self.q_size)
            proj = layer.o_proj(o)
            if lora is not None:
                lora.add(proj, o, i, "o")
            if self.all_reduce is not None:
                self.all_reduce(proj)
            x = ops.add_rms_norm(h, proj, layer.post_attn_norm, eps)
            if lora is not None:  # the delta goes in before SiLU; plain() keeps the epilogue's column order
                gate_up = lora.add(layer.gate_up_proj.plain(x), x, i, "gate_up")
                act = silu_mul_tiles(ops, gate_up) if layer.gate_up_proj.epilogue is not None else ops.silu_mul(gate_up)
            else:
                act = layer.gate_up_proj(x)
                if layer.gate_up_proj.epilogue is None:
                    act = ops.silu_mul(act)
            down = layer.down_proj(act)
            if lora is not None:
                lora.add(down, act, i, "down")
            if self.all_reduce is not None:
                self.all_reduce(down)
            # The residual add closes the layer and fuses with the next norm (or the final one).
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(h, down, next_norm, eps)
        self._reduce_scores(attn_metadata)
        return x

    def _reduce_scores(self, meta: AttentionMetadata) -> None:
        """Under tensor parallelism each rank scored its own heads: the attention per block that
        decides what h2o / snapkv keep is the sum over all of them."""
        if self.all_reduce is not None:
            for i, scores in meta.block_scores.items():
                meta.block_scores[i] = scores = scores.contiguous()
                self.all_reduce(scores)

    def _qkv_rotated_plus_lora(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               i: int, lora: LoRAStep) -> torch.Tensor:
        """The q/k/v projection with its rotary epilogue, plus the LoRA rows' delta rotated the
        same way: the rotation is linear, so rotating the sum or adding the rotated delta is the
        same map, and the fused projection's output keeps its layout (no gather of its columns)."""
        c, qk = self.config, self.q_size + self.kv_size
        qkv = layer.qkv_proj(x, cos, sin)
        delta = lora.delta(x, i, "qkv")
        rows = lora.rows
        n = delta.shape[0]
        rotated = self.ops.rope(delta[:, :qk].to(qkv.dtype).view(n, c.num_attention_heads + c.num_key_value_heads, c.head_dim),
                                cos[rows], sin[rows])
        qkv[rows, :qk] += rotated.reshape(n, qk)
        qkv[rows, qk:] += delta[:, qk:]
        return qkv

    def compiled_decoder(self, kv_cache: KVCache) -> cpu_decoder.CompiledDecoder | None:
        """The compiled layer loop over kv_cache, or None where the Python loop runs."""
        if not self.use_compiled_decoder or self._decoder_unsupported is not None:
            return None
        if self._decoder is None or self._decoder[0] is not kv_cache:
            kernel = (self.attn.varlen_kernel_over(kv_cache) if isinstance(self.attn, CPUAttentionBackend)
                      else None)
            self._decoder = (kv_cache, None if kernel is None else cpu_decoder.CompiledDecoder(
                self, kernel, *zip(*map(kv_cache.layer_blocks, range(len(self.layers)))), kv_cache.block_size))
        return self._decoder[1]

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] of the rows that sample -> logits [N, vocab]: float32, or in the
        lm_head's dtype with float32=False (the sampler converts only what it reads; a greedy
        step's argmax reads the bf16 rows as they are)."""
        logits = self.lm_head(hidden_rows)
        return logits.float() if float32 else logits
