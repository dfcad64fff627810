"""Forward pass over the paged KV cache vs transformers on the same random tiny weights.

Every case compares float32 logits at every position against HF's full-sequence forward
(eager attention) within 1e-4, whether the tokens arrived as one prompt, as prefill chunks
across calls, or as decodes batched with another sequence's prefill chunk. Block ids are
scattered so that a wrong slot mapping or gather order shows up as a mismatch.
"""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
import transformers  # noqa: E402
from fidelity import assert_rows_agree, bf16_bound  # noqa: E402

from kvserve.attention.base import build_attention_metadata  # noqa: E402
from kvserve.cache.paged import PagedKVCache  # noqa: E402
from kvserve.config import ModelConfig  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.core.step import BlockCopy, ScheduledRequest, SchedulerOutput  # noqa: E402
from kvserve.model.llama import LlamaModel, rope_inv_freq  # noqa: E402
from kvserve.ops.cpu_kernels import varlen_kernel_for  # noqa: E402
from kvserve.runner.model_runner import ModelRunner, RunnerConfig  # noqa: E402

TOL = 1e-4
VOCAB = 96
NUM_BLOCKS = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (architecture, config overrides, block size used for it in the per-model cases)
SPECS = {
    "llama_gqa": ("llama", dict(num_key_value_heads=2), 8),
    "llama_tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True), 16),
    "llama3_rope": ("llama", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE), 32),
    "llama_mqa": ("llama", dict(num_key_value_heads=1), 128),
    "llama_mha": ("llama", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=24), 16),
    # head_dim 64 (wider than hidden / heads): the bf16 CPU kernel's size, so bf16 runs it.
    "llama_d64": ("llama", dict(num_key_value_heads=2, head_dim=64), 16),
    "mistral_swa": ("mistral", dict(num_key_value_heads=2, sliding_window=12), 8),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2), 16),
}
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    arch, overrides, _ = SPECS[name]
    cfg_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[arch])
    cfg = cfg_cls(**{**BASE, **overrides}, attn_implementation="eager")
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits; spread them so errors show
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    return model


def model_config(name: str) -> ModelConfig:
    arch, _, _ = SPECS[name]
    c = hf_model(name).config
    rope = dict(c.rope_parameters)
    return ModelConfig(
        architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=rope["rope_theta"], rope_scaling=rope if rope["rope_type"] != "default" else None,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=arch == "qwen2",
        sliding_window=getattr(c, "sliding_window", None), name=name)


def weights(name: str) -> dict[str, torch.Tensor]:
    w = dict(hf_model(name).state_dict())
    if hf_model(name).config.tie_word_embeddings:
        w.pop("lm_head.weight", None)  # the loader leaves it out when tied
    return w


@functools.lru_cache(maxsize=None)
def hf_logits(name: str, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(name)(torch.tensor([tokens])).logits[0].float()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_schedule(model: LlamaModel, cache: PagedKVCache, seqs: dict[str, list[int]],
                 steps: list[list[tuple[str, int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Drive the model step by step; each step runs (sequence, num_new_tokens) entries with blocks
    handed out from a shuffled free list. Returns the logits of every position of every sequence."""
    free = list(range(cache.num_blocks))
    random.Random(seed).shuffle(free)
    tables = {s: [] for s in seqs}
    done = {s: 0 for s in seqs}
    rows = {s: [] for s in seqs}
    bs = cache.block_size
    for step in steps:
        for s, n in step:
            while len(tables[s]) * bs < done[s] + n:
                tables[s].append(free.pop())
        meta = build_attention_metadata([done[s] for s, _ in step], [n for _, n in step],
                                        [tables[s] for s, _ in step], bs)
        ids = torch.tensor([t for s, n in step for t in seqs[s][done[s]:done[s] + n]])
        logits = model.compute_logits(model.forward(ids, meta.positions, meta, cache))
        for (s, n), a, b in zip(step, meta.query_start_loc, meta.query_start_loc[1:]):
            rows[s].append(logits[a:b])
            done[s] += n
    return {s: torch.cat(r) for s, r in rows.items()}


def assert_matches_hf(name: str, seqs: dict[str, list[int]], ours: dict[str, torch.Tensor]) -> None:
    for s, toks in seqs.items():
        ref = hf_logits(name, tuple(toks))
        assert ours[s].shape == ref.shape, s
        err = (ours[s] - ref).abs().max().item()
        assert err < TOL, f"{name}/{s}: max |logit diff| {err:.2e}"


def make(name: str, block_size: int, dtype=torch.float32) -> tuple[LlamaModel, PagedKVCache]:
    mc = model_config(name)
    model = LlamaModel(mc, weights(name), dtype)
    # The layout the runner would build for this backend (bf16 on AVX512-BF16: the kernel's "pairs").
    layout = model.attn.kv_cache_layout("auto", dtype, block_size, torch.device("cpu"))
    return model, PagedKVCache(mc, num_blocks=NUM_BLOCKS, block_size=block_size, dtype=dtype, layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_whole_prompt(name):
    model, cache = make(name, SPECS[name][2])
    seqs = {"a": tokens(1, 45)}
    assert_matches_hf(name, seqs, run_schedule(model, cache, seqs, [[("a", 45)]]))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [7, 64])
@pytest.mark.parametrize("name", SPECS)
def test_chunked_prefill_across_calls(name, chunk):
    model, cache = make(name, SPECS[name][2])
    n = 70
    seqs = {"a": tokens(2, n)}
    steps = [[("a", min(chunk, n - s))] for s in range(0, n, chunk)]
    assert_matches_hf(name, seqs, run_schedule(model, cache, seqs, steps))


def mixed_schedule() -> tuple[dict[str, list[int]], list[list[tuple[str, int]]]]:
    """Three sequences of different lengths decode together, first beside the second chunk of a
    fourth sequence's prefill, then beside its decodes; the batch shrinks to two, then one."""
    steps = [[("a", 9), ("b", 23), ("c", 20), ("d", 12)], [("c", 21)],
             [("a", 1), ("d", 18), ("b", 1), ("c", 1)]]
    steps += [[("c", 1), ("a", 1), ("b", 1), ("d", 1)] for _ in range(4)]
    steps += [[("d", 1), ("a", 1)], [("d", 1)]]
    totals = {s: sum(n for step in steps for t, n in step if t == s) for s in "abcd"}
    return {s: tokens(10 + i, totals[s]) for i, s in enumerate("abcd")}, steps


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_decode_batch_mixed_with_prefill(name):
    model, cache = make(name, SPECS[name][2])
    seqs, steps = mixed_schedule()
    assert_matches_hf(name, seqs, run_schedule(model, cache, seqs, steps, seed=3))


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa"])
def test_block_sizes(name, block_size):
    model, cache = make(name, block_size)
    seqs, steps = mixed_schedule()
    assert_matches_hf(name, seqs, run_schedule(model, cache, seqs, steps, seed=block_size))


def test_llama3_rope_scaling_matches_hf_inv_freq():
    hf_inv = hf_model("llama3_rope").model.rotary_emb.inv_freq
    ours = rope_inv_freq(model_config("llama3_rope"))
    torch.testing.assert_close(ours, hf_inv, rtol=0, atol=0)
    plain = rope_inv_freq(ModelConfig(**{**model_config("llama3_rope").__dict__, "rope_scaling": None}))
    changed = ours != plain
    assert changed.any() and not changed.all(), "the case must cover scaled and unscaled frequencies"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_the_per_step_computation(dtype):
    """On CPU cos/sin come from a table that grows with the positions asked for; every row must be
    what computing it from its position gives, before and after the table grows."""
    model = LlamaModel(model_config("llama3_rope"), weights("llama3_rope"), dtype)
    for positions in (torch.tensor([0, 5, 3, 255]), torch.tensor([7, 300, 1000]), torch.arange(1500, 1510)):
        cos, sin = model.rope_cos_sin(positions)
        want_cos, want_sin = model._rope_rows(positions)
        assert cos.shape == (len(positions), 1, want_cos.shape[1])
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    assert model._rope_table[0].shape[0] >= 1510


def test_reference_comparison_detects_errors():
    """The tolerance is far below what a wrong window or a position off by one produces."""
    seqs = {"a": tokens(4, 40)}
    mc = model_config("mistral_swa")
    no_window = LlamaModel(ModelConfig(**{**mc.__dict__, "sliding_window": None}), weights("mistral_swa"),
                           torch.float32)
    cache = PagedKVCache(mc, num_blocks=NUM_BLOCKS, block_size=8, dtype=torch.float32)
    out = run_schedule(no_window, cache, seqs, [[("a", 40)]])["a"]
    ref = hf_logits("mistral_swa", tuple(seqs["a"]))
    assert (out[:12] - ref[:12]).abs().max() < TOL  # inside the window nothing differs
    assert (out[12:] - ref[12:]).abs().max() > 100 * TOL
    # A second chunk placed one position late, or reading one wrong block of the first chunk, must
    # both fail (a uniform shift of all positions, or a reorder of visible keys, would not).
    ref = hf_logits("llama_gqa", tuple(seqs["a"]))[20:]
    for shift, table in ((1, [7, 2, 5]), (0, [7, 3, 5])):
        model, cache = make("llama_gqa", 8)
        meta = build_attention_metadata([0], [20], [[7, 2, 5]], 8)
        model.forward(torch.tensor(seqs["a"][:20]), meta.positions, meta, cache)
        meta = build_attention_metadata([20], [20], [table + [9, 11]], 8)
        logits = model.compute_logits(model.forward(torch.tensor(seqs["a"][20:]), meta.positions + shift,
                                                    meta, cache))
        assert (logits - ref).abs().max() > 100 * TOL, (shift, table)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa", "llama_d64"])
def test_bfloat16_close_to_hf(name):
    """bf16 against transformers' float32 under tests/fidelity.py's rule, D measured on the same
    sequences from transformers' own bf16 forward."""
    model, cache = make(name, 16, torch.bfloat16)
    # head_dim 64 on an AVX512-BF16 CPU: the varlen kernel over the "pairs" layout; else SDPA.
    kernel = varlen_kernel_for(torch.bfloat16, cache.head_dim, torch.device("cpu")) is not None
    assert cache.layout == ("pairs" if kernel else "tokens")
    seqs, steps = mixed_schedule()
    ours = run_schedule(model, cache, seqs, steps)
    bound = bf16_bound(hf_model(name), list(seqs.values()), [range(len(toks)) for toks in seqs.values()])
    got_rows, want_rows = [], []
    for s, toks in seqs.items():
        assert ours[s].dtype == torch.float32
        ref = torch.log_softmax(hf_logits(name, tuple(toks)), -1)
        got = torch.log_softmax(ours[s], -1)
        for i in range(len(toks)):
            ids = ref[i].topk(20).indices.tolist()
            got_rows.append({t: got[i, t].item() for t in ids})
            want_rows.append({t: ref[i, t].item() for t in ids})
    assert_rows_agree(got_rows, want_rows, bound, what=name)


@pytest.mark.slow
@pytest.mark.needs("avx512_bf16")
def test_bfloat16_projection_epilogues_change_nothing(monkeypatch):
    """SiLU * up and the rotary embedding done by the bf16 GEMM (linear.py's epilogues) give the
    same logits, bit for bit, as the separate elementwise passes; a model built without them
    (the permutation refused) is the reference."""
    from kvserve.model import linear
    fused, cache = make("llama_d64", 16, torch.bfloat16)
    assert fused.layers[0].gate_up_proj.epilogue is not None
    assert fused.layers[0].qkv_proj.epilogue is not None
    monkeypatch.setattr(linear, "_epilogue_order", lambda epi, n: None)
    plain, plain_cache = make("llama_d64", 16, torch.bfloat16)
    assert plain.layers[0].gate_up_proj.epilogue is None and plain.layers[0].qkv_proj.epilogue is None
    seqs, steps = mixed_schedule()
    ours, ref = run_schedule(fused, cache, seqs, steps), run_schedule(plain, plain_cache, seqs, steps)
    for s in seqs:
        assert torch.equal(ours[s], ref[s]), s


def _shared_prefix_schedule() -> list[tuple[list[int], list[int], list[list[int]], list[int]]]:
    """(start_pos, query_lens, block tables, token ids) per step: a 64-token prefix in four
    blocks, four continuations in their own blocks, then their decodes, which share the
    prefix's blocks (the varlen kernel's cascade groups: >= 4 decodes over >= 4 blocks) beside
    a fifth sequence's prefill."""
    prefix, own = [7, 2, 14, 1], {"x": [5, 11], "y": [0, 9], "z": [3, 12], "u": [6, 15], "w": [4, 8, 13]}
    steps = [([0], [64], [prefix], tokens(40, 64)),
             ([64] * 4, [5, 6, 7, 8], [prefix + own[s][:1] for s in "xyzu"], tokens(41, 26))]
    lens = {"x": 69, "y": 70, "z": 71, "u": 72}
    for i in range(6):
        starts = [lens[s] for s in "xyzu"] + [i * 8]
        tables = [prefix + own[s] for s in "xyzu"] + [own["w"]]
        steps.append((starts, [1, 1, 1, 1, 8], tables, tokens(50 + i, 12)))
        lens = {s: n + 1 for s, n in lens.items()}
    return steps


def _mixed_codes(w: dict[str, torch.Tensor], layer: int) -> dict:
    """Q4_1 codes for one layer's projections only (the others keep bf16 panels on AMX CPUs)."""
    import gguf

    from kvserve.model.weight_codes import GGUFBlocks

    codes = {}
    for name, t in w.items():
        if name.startswith(f"model.layers.{layer}.") and name.endswith("_proj.weight"):
            blocks = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType.Q4_1)
            codes[name] = GGUFBlocks("Q4_1", torch.from_numpy(blocks.copy()), t.shape[1])
    return codes


@pytest.mark.slow
@pytest.mark.needs("avx512_bf16")
@pytest.mark.parametrize("window,mixed", [(None, False), (12, False), pytest.param(None, True, marks=pytest.mark.needs("amx"))])
def test_compiled_decoder_equals_the_python_layer_loop(window, mixed):
    """bf16 on an AVX512-BF16 CPU runs the layer loop as one compiled call (model/cpu_decoder.py).
    It makes the same kernel calls as the Python loop, so every step's hidden states must be the
    same bits: prefill chunks, decodes beside them, shared-prefix (cascade) decodes, a sliding
    window, and (`mixed`, on AMX CPUs) layers whose projections read GGUF codes beside layers on
    bf16 panels, each projection through its own kernel."""
    mc = dataclasses.replace(model_config("llama_d64"), sliding_window=window)
    w = weights("llama_d64")
    model = LlamaModel(mc, w, torch.bfloat16, weight_codes=_mixed_codes(w, 0) if mixed else None)
    if mixed:
        assert model.layers[0].o_proj.codes is not None
        assert model.layers[1].o_proj.codes is None
    layout = model.attn.kv_cache_layout("auto", torch.bfloat16, 16, torch.device("cpu"))
    caches = [PagedKVCache(mc, num_blocks=24, block_size=16, dtype=torch.bfloat16, layout=layout) for _ in range(2)]
    assert model.compiled_decoder(caches[0]) is not None
    groups = 0
    for start, qlens, tables, ids in _shared_prefix_schedule():
        outs = []
        for compiled, cache in zip((True, False), caches):
            model.use_compiled_decoder = compiled
            meta = build_attention_metadata(start, qlens, tables, 16)
            outs.append(model.forward(torch.tensor(ids), meta.positions, meta, cache))
            if compiled:
                groups += model.attn.varlen_plan(meta).groups.num_groups
        assert torch.equal(outs[0], outs[1]), (start, qlens)
        assert outs[0].abs().max() > 0
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert groups > 0 or window is not None, "the schedule should have exercised the cascade path"


@pytest.mark.parametrize("dtype,compiled", [pytest.param(torch.bfloat16, True, marks=pytest.mark.needs("avx512_bf16")),
                                            (torch.bfloat16, False), (torch.float32, False)])
def test_forward_of_some_rows_equals_those_rows_of_the_whole(dtype, compiled):
    """`out_rows`: the last layer's o projection and MLP run on those rows only (a prefill
    chunk's last row), in the compiled layer loop and the Python one. Their hidden states must be
    the rows of the whole forward, bit for bit in bf16 (the GEMM kernels' sums for a row do not
    depend on the other rows), and the cache (every row's K and V) the same; no rows at all (a
    chunk that does not finish its prompt) returns an empty tensor. float32 goes through
    torch's matmul, whose blocking (and so its last bits) depends on the row count."""
    model, _ = make("llama_d64", 16, dtype)
    layout = model.attn.kv_cache_layout("auto", dtype, 16, torch.device("cpu"))
    caches = [PagedKVCache(model.config, num_blocks=24, block_size=16, dtype=dtype, layout=layout) for _ in range(2)]
    assert not compiled or model.compiled_decoder(caches[0]) is not None
    model.use_compiled_decoder = compiled
    for n, (start, qlens, tables, ids) in enumerate(_shared_prefix_schedule()):
        meta = build_attention_metadata(start, qlens, tables, 16)
        ends = meta.query_start_loc[1:]
        rows = [] if n == 0 else [e - 1 for e in ends][:: 2 if n % 2 else 1]
        whole = model.forward(torch.tensor(ids), meta.positions, meta, caches[0])
        some = model.forward(torch.tensor(ids), meta.positions, meta, caches[1], torch.tensor(rows, dtype=torch.long))
        assert some.shape == (len(rows), whole.shape[1])
        if dtype == torch.bfloat16:
            assert torch.equal(some, whole[rows]), (start, qlens, rows)
        else:
            torch.testing.assert_close(some, whole[rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0].kv, caches[1].kv)


# ---- the runner: greedy generation token for token, copy-on-write through block_copies ----

class HandScheduler:
    """Minimal stand-in for the scheduler: chunked prefill, then decodes, blocks by hand."""

    def __init__(self, runner: ModelRunner, chunk: int, seed: int) -> None:
        self.runner, self.chunk = runner, chunk
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}

    def step(self, reqs: list[Request]) -> dict[str, int]:
        sched = []
        for r in reqs:
            n = min(self.chunk, r.num_tokens - r.num_computed_tokens)
            table = self.tables.setdefault(r.request_id, [])
            while len(table) * self.runner.block_size < r.num_computed_tokens + n:
                table.append(self.free.pop())
            sched.append(ScheduledRequest(r, r.num_computed_tokens, n, list(table),
                                          sample=r.num_computed_tokens + n == r.num_tokens))
        out = self.runner.execute(SchedulerOutput(scheduled=sched))
        assert set(out.sampled) == {s.request.request_id for s in sched if s.sample}
        for s in sched:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.sample:
                s.request.append_output_token(out.sampled[s.request.request_id].token_id)
        return {k: v.token_id for k, v in out.sampled.items()}


def runner_for(name: str, block_size: int, num_blocks: int = NUM_BLOCKS) -> ModelRunner:
    return ModelRunner(model_config(name), weights(name), RunnerConfig(
        dtype=torch.float32, device=torch.device("cpu"), block_size=block_size, num_blocks=num_blocks))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa", "qwen2_bias"])
def test_greedy_generation_matches_hf_generate(name):
    new_tokens = 32
    runner = runner_for(name, block_size=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    reqs = [Request(f"r{n}", tokens(20 + n, n), greedy) for n in (3, 17, 50)]
    hand = HandScheduler(runner, chunk=16, seed=5)
    while any(r.num_output_tokens < new_tokens for r in reqs):
        hand.step([r for r in reqs if r.num_output_tokens < new_tokens])
    hf = hf_model(name)
    distinct: set[int] = set()
    for r in reqs:
        with torch.no_grad():
            ids = torch.tensor([r.prompt_token_ids])
            # An explicit mask: otherwise generate masks every prompt token equal to pad_token_id.
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, r.num_prompt_tokens:]
        distinct.update(ref.tolist())
        assert r.output_token_ids == ref.tolist(), f"{name} prompt len {r.num_prompt_tokens}"
    assert len(distinct) > 10, "degenerate references: repeated tokens would prove little"


def test_runner_block_copy_then_continue_matches_hf():
    """B shares A's first full block and gets a copy of A's partial block (copy-on-write) before
    its own continuation runs; B's logits must equal HF's on B's whole sequence."""
    name = "llama_gqa"
    runner = runner_for(name, block_size=16, num_blocks=8)
    prefix = tokens(30, 20)
    a = Request("a", prefix, SamplingParams(temperature=0.0))
    b = Request("b", prefix + tokens(31, 9), SamplingParams(temperature=0.0))
    runner.execute(SchedulerOutput([ScheduledRequest(a, 0, 20, [6, 2], sample=False)]))
    out = runner.execute(SchedulerOutput([ScheduledRequest(b, 20, 9, [6, 4], sample=True)],
                                         block_copies=[BlockCopy(src=2, dst=4, num_tokens=4)]))
    ref = hf_logits(name, tuple(b.all_token_ids))[-1]
    assert out.sampled["b"].token_id == int(ref.argmax())
    meta = build_attention_metadata([28], [1], [[6, 4]], 16)
    # Re-run B's last token against the cache: slots 16..19 came from the copy, 20..27 from B.
    logits = runner.model.compute_logits(runner.model.forward(
        torch.tensor(b.all_token_ids[28:]), meta.positions, meta, runner.kv_cache))
    assert (logits[0] - ref).abs().max() < TOL


def test_runner_asks_only_for_the_rows_it_samples(monkeypatch):
    """A prompt chunk's rows that neither sample nor score a prompt token are left out of the
    last layer's o projection and MLP (`out_rows`); a step where every row samples, or one with
    a prompt_logprobs request (which scores every row), asks for all of them. The sampled token
    is HF's greedy one either way."""
    name = "llama_gqa"
    runner = runner_for(name, block_size=16)
    asked = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda *a: asked.append(a[4] if len(a) > 4 else None) or forward(*a))
    a = Request("a", tokens(60, 20), SamplingParams(temperature=0.0))
    b = Request("b", tokens(61, 9), SamplingParams(temperature=0.0))
    out = runner.execute(SchedulerOutput([ScheduledRequest(a, 0, 20, [0, 1], sample=True),
                                          ScheduledRequest(b, 0, 5, [2], sample=False)]))
    assert asked[-1].tolist() == [19]
    assert out.sampled["a"].token_id == int(hf_logits(name, tuple(a.prompt_token_ids))[-1].argmax())
    assert runner.execute(SchedulerOutput([ScheduledRequest(b, 5, 4, [2], sample=False)])).sampled == {}
    assert asked[-1].tolist() == []
    a.append_output_token(out.sampled["a"].token_id)
    c = Request("c", tokens(62, 6), SamplingParams(temperature=0.0, prompt_logprobs=1))
    out = runner.execute(SchedulerOutput([ScheduledRequest(a, 20, 1, [0, 1], sample=True),
                                          ScheduledRequest(c, 0, 6, [3], sample=True)]))
    assert asked[-1] is None and len(out.prompt_logprobs["c"].logprobs) == 5
    a.append_output_token(out.sampled["a"].token_id)
    runner.execute(SchedulerOutput([ScheduledRequest(a, 21, 1, [0, 1], sample=True)]))
    assert asked[-1] is None


def test_runner_rejects_bad_block_table():
    runner = runner_for("llama_gqa", block_size=16, num_blocks=4)
    r = Request("x", tokens(1, 20), SamplingParams())
    with pytest.raises(ValueError, match="only 4 blocks"):
        runner.execute(SchedulerOutput([ScheduledRequest(r, 0, 20, [0, 9], sample=True)]))
    with pytest.raises(ValueError, match="cannot hold 20 tokens"):
        runner.execute(SchedulerOutput([ScheduledRequest(r, 0, 20, [0], sample=True)]))
