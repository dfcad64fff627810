"""GGUF weights read as codes by the AMX projection kernel (model/weight_codes.py, csrc/weight_tiles.h).

The claim is exactness: a projection over the Q4_1 / Q8_0 codes gives the same bits as the same
projection over the bf16 weights the loader dequantizes, for every row count and epilogue, and an
engine on a GGUF checkpoint generates the same tokens with the codes as without them."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_gguf

from kvserve.model.linear import SILU_MUL, Linear, rope_epilogue
from kvserve.model.weight_codes import GGUFBlocks, pack_tiles

needs_amx = pytest.mark.needs("amx")


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> GGUFBlocks:
    """Blocks as llama.cpp writes them: float16 d (and m), then the codes."""
    g = torch.Generator().manual_seed(seed)
    s = k // 32
    d = (torch.rand(n, s, 1, generator=g) * 0.01 + 1e-4).half().view(torch.uint8)
    if qtype == "Q4_1":
        m = (-torch.rand(n, s, 1, generator=g) * 0.08).half().view(torch.uint8)
        parts = [d, m, torch.randint(0, 256, (n, s, 16), generator=g, dtype=torch.uint8)]
    else:
        parts = [d, torch.randint(-128, 128, (n, s, 32), generator=g, dtype=torch.int8).view(torch.uint8)]
    return GGUFBlocks(qtype, torch.cat(parts, -1).reshape(n, -1).contiguous(), k)


def reference_dequantize(w: GGUFBlocks) -> torch.Tensor:
    """ggml's formulas in plain torch: Q4_1 x = d * q + m (q: low nibbles, then high), Q8_0 x = d * q."""
    b = w.blocks.view(w.rows, w.cols // 32, -1)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if w.qtype == "Q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        q = torch.cat((b[..., 4:] & 15, b[..., 4:] >> 4), -1).float()
        return (d * q + m).reshape(w.rows, w.cols)
    return (d * b[..., 2:].view(torch.int8).float()).reshape(w.rows, w.cols)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_blocks_dequantize_and_tile_order(qtype):
    w = random_blocks(qtype, 48, 96)
    assert torch.equal(w.dequantize(), reference_dequantize(w))
    tiles = pack_tiles(w)
    per_tile = 320 if qtype == "Q4_1" else 544
    assert tiles.shape == (3, 3, per_tile)
    # tile (panel 1, step 2): row r, lane 2c + j is column 16 + c, k = 64 + 2r + j
    x = reference_dequantize(w)[16:32, 64:96]  # [column, k]
    t = tiles[1, 2]
    if qtype == "Q4_1":
        q = torch.cat((t[:256].view(16, 16) & 15, t[:256].view(16, 16) >> 4), -1).float()  # [r, lane]
        d, m = t[256:288].view(torch.float16).float(), t[288:320].view(torch.float16).float()
        lane_col = torch.arange(32) // 2
        values = q * d[lane_col] + m[lane_col]
    else:
        d = t[512:].view(torch.float16).float()
        values = t[:512].view(torch.int8).view(16, 32).float() * d[torch.arange(32) // 2]
    assert torch.equal(values, x.reshape(16, 16, 2).permute(1, 0, 2).reshape(16, 32))
    with pytest.raises(ValueError, match="rows % 16 == 0"):
        pack_tiles(random_blocks(qtype, 40, 96))


@needs_amx
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k,epilogue", [(64, 64, None), (512, 64, "rope"), (960, 576, "rope"), (576, 576, None),
                                          (3072, 576, "silu"), (576, 1536, None), (256, 64, "silu")])
@pytest.mark.slow
def test_codes_gemm_is_bit_identical_to_the_bf16_gemm(qtype, n, k, epilogue):
    w = random_blocks(qtype, n, k, seed=n + k)
    dense = w.dequantize().bfloat16()
    epi = {"rope": rope_epilogue(64, n - 64 if n > 64 else 64), "silu": SILU_MUL, None: None}[epilogue]
    plain, coded = Linear(dense, epilogue=epi), Linear(dense, epilogue=epi, codes=w)
    assert plain.codes is None and coded.codes is not None
    assert coded.epilogue == plain.epilogue
    g = torch.Generator().manual_seed(k)
    for rows in (1, 5, 16, 17, 32, 33, 64, 100, 300, 600):  # 600: two super-chunks at k = 576
        x = torch.randn(rows, k, generator=g).bfloat16()
        args = ()
        if epi is not None and epi.kind == rope_epilogue(64, 64).kind:
            pos = torch.randint(0, 4096, (rows, 1), generator=g).float()
            ang = pos * torch.rand(1, 32, generator=g)
            args = (torch.cat((ang.cos(), ang.cos()), -1).bfloat16().contiguous(),
                    torch.cat((-ang.sin(), ang.sin()), -1).bfloat16().contiguous())
        assert torch.equal(coded(x, *args), plain(x, *args)), rows


@needs_amx
def test_codes_replace_the_bf16_weight():
    w = random_blocks("Q4_1", 64, 64)
    lin = Linear(w.dequantize().bfloat16(), codes=w)
    kernel, operand = lin.gemm
    assert lin.codes == "Q4_1" and lin.weight is None
    assert operand.dtype == torch.uint8 and torch.equal(operand, pack_tiles(w))  # no bf16 copy kept
    with pytest.raises(ValueError, match="GGUF codes of 64 x 96 for a 64 x 64 weight"):
        Linear(w.dequantize().bfloat16(), codes=random_blocks("Q4_1", 64, 96))


@pytest.mark.slow
def test_gguf_load_keeps_codes_equal_to_the_weights(tmp_path, monkeypatch):
    from kvserve.model.loader import load_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_gguf(tmp_path, "llama_d64", quantize="Q4_1")
    fresh = load_gguf(path, torch.float32, use_cache=False)
    load_gguf(path, torch.float32)  # stores the cache entry
    cached = load_gguf(path, torch.float32)
    matrices = {k for k, v in fresh.weights.items() if v.dim() == 2}
    assert set(fresh.codes) == matrices == set(cached.codes)
    for name, codes in fresh.codes.items():
        assert codes.qtype == ("Q8_0" if "embed" in name else "Q4_1"), name
        # the q/k rows come back in HF order, as the dequantized weights do
        assert torch.equal(codes.dequantize(), fresh.weights[name]), name
        assert cached.codes[name].qtype == codes.qtype and torch.equal(cached.codes[name].blocks, codes.blocks)


@pytest.mark.slow
@needs_amx
def test_engine_tokens_and_logits_identical_with_and_without_codes(tmp_path, monkeypatch):
    from kvserve import LLM, SamplingParams

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(make_tiny_gguf(tmp_path, "llama_d64", quantize="Q4_1"))
    prompts = [[(7 * i + j) % 49152 for j in range(3 + 11 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    for q in (None, "none"):
        llm = LLM(path, dtype="bfloat16", quantization=q, kv_cache_memory=2**24)
        model = llm.engine.runner.model
        assert {lin.codes for L in model.layers for lin in L.projections().values()} == {"Q4_1" if q is None else None}
        assert (model.lm_head.codes is not None) == (q is None)
        assert model.compiled_decoder(llm.engine.runner.kv_cache) is not None  # the layer loop runs compiled
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[q] = [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]
    assert runs[None] == runs["none"]


def test_quantization_flag_is_checked(tmp_path):
    from tiny_models import make_tiny_model

    from kvserve.config import ConfigError, EngineArgs
    from kvserve.runner.build import build_engine_parts

    with pytest.raises(ConfigError, match="--quantization must be one of gguf, none or unset"):
        EngineArgs(quantization="awq").validate()
    args = EngineArgs(model=str(make_tiny_model(tmp_path, "llama_d64")), quantization="gguf")
    args.validate()
    with pytest.raises(ConfigError, match="--quantization gguf needs a GGUF checkpoint"):
        build_engine_parts(args)


def _split_model(qtype: str, hq: int, hkv: int, inter: int) -> tuple[object, dict, dict]:
    """One layer's projections of a head_dim 64 model as GGUF codes, and their dequantized weights."""
    from kvserve.config import ModelConfig

    d = 64
    hidden = hq * d
    cfg = ModelConfig("llama", 100, hidden, inter, 1, hq, hkv, d, 128)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    shapes = {a + "q_proj.weight": (hq * d, hidden), a + "k_proj.weight": (hkv * d, hidden),
              a + "v_proj.weight": (hkv * d, hidden), a + "o_proj.weight": (hidden, hq * d),
              m + "gate_proj.weight": (inter, hidden), m + "up_proj.weight": (inter, hidden),
              m + "down_proj.weight": (hidden, inter), "model.embed_tokens.weight": (100 - 4, hidden)}
    codes = {name: random_blocks(qtype, n, k, seed=i) for i, (name, (n, k)) in enumerate(shapes.items())}
    return cfg, codes, {name: c.dequantize() for name, c in codes.items()}


@pytest.mark.parametrize("tp", [3, 6])
def test_sharded_codes_are_the_sharded_weights(tp):
    """Each rank's codes (rows of blocks for q/k/v/gate/up, whole 32-column blocks of o and down)
    dequantize to exactly that rank's slice of the dequantized weights; at TP=6 each KV head is
    held by two ranks."""
    from kvserve.model.shard import shard_codes, shard_weights

    cfg, codes, weights = _split_model("Q4_1", 6, 3, 384)
    for rank in range(tp):
        mine, want = shard_codes(codes, cfg, rank, tp), shard_weights(weights, cfg, rank, tp)
        assert set(mine) == set(codes)
        for name, c in mine.items():
            assert torch.equal(c.dequantize(), want[name]), (rank, name)


@needs_amx
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_ranks_codes_gemm_is_bit_identical_to_its_bf16_shard(qtype):
    """TP=3 over 9 query / 3 KV heads (SmolLM2's split): every rank's fused q/k/v (rotary epilogue),
    o, gate/up (SiLU epilogue) and down over its codes give the bits of the same projections over
    its dequantized bf16 shard."""
    from kvserve.model.shard import rank_config, shard_codes, shard_weights
    from kvserve.model.weight_codes import cat

    tp = 3
    cfg, codes, weights = _split_model(qtype, 9, 3, 576)
    local = rank_config(cfg, tp)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    q_rows = local.num_attention_heads * 64
    fused = {"qkv": ([a + f"{p}_proj.weight" for p in "qkv"], rope_epilogue(64, q_rows + 64)),
             "o": ([a + "o_proj.weight"], None), "gate_up": ([m + "gate_proj.weight", m + "up_proj.weight"], SILU_MUL),
             "down": ([m + "down_proj.weight"], None)}
    g = torch.Generator().manual_seed(tp)
    for rank in range(tp):
        mine, dense = shard_codes(codes, cfg, rank, tp), shard_weights(weights, cfg, rank, tp)
        for what, (names, epi) in fused.items():
            w = torch.cat([dense[n] for n in names]).bfloat16()
            plain, coded = Linear(w, epilogue=epi), Linear(w, epilogue=epi, codes=cat([mine[n] for n in names]))
            assert coded.codes == qtype and plain.codes is None, what
            for rows in (1, 7, 40):
                x = torch.randn(rows, w.shape[1], generator=g).bfloat16()
                args = ()
                if epi is not None and epi.kind == rope_epilogue(64, 64).kind:
                    ang = torch.rand(rows, 32, generator=g) * 100
                    args = (torch.cat((ang.cos(), ang.cos()), -1).bfloat16().contiguous(),
                            torch.cat((-ang.sin(), ang.sin()), -1).bfloat16().contiguous())
                assert torch.equal(coded(x, *args), plain(x, *args)), (rank, what, rows)


def test_a_split_that_cuts_gguf_blocks_is_refused_with_quantization_gguf(tmp_path, monkeypatch, caplog):
    """llama_mha's o (96 inputs) and down (160) split in two are 48 and 80 columns a rank: not whole
    32-weight blocks, and gate/up's 320 rows (five 64-row panels) are 160 a rank. --quantization gguf
    is refused naming the numbers and the sizes that fit; unset, those projections' codes are left
    out of each rank's share (they run on its bf16 shard)."""
    from kvserve.config import ConfigError, EngineArgs
    from kvserve.model.loader import load_model
    from kvserve.model.shard import codes_split_problems, shard_codes
    from kvserve.runner.build import _check_codes_split, build_engine_parts

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(make_tiny_gguf(tmp_path, "llama_mha", quantize="Q4_1"))
    args = EngineArgs(model=path, quantization="gguf", tensor_parallel_size=2)
    args.validate()
    with pytest.raises(ConfigError, match=r"--quantization gguf with --tensor-parallel-size 2: o_proj's 96 inputs "
                                          r"split 2 ways are 48 per rank, not a whole number of 32-weight GGUF "
                                          r"blocks; down_proj's 160 inputs split 2 ways are 80 per rank.*use a "
                                          r"--tensor-parallel-size that splits whole blocks \(1\), or leave "
                                          r"--quantization unset"):
        build_engine_parts(args)
    loaded = load_model(path)
    assert set(codes_split_problems(loaded.config, 2, loaded.codes)) == {"o_proj", "down_proj", "gate_up_proj"}
    kept = shard_codes(loaded.codes, loaded.config, 1, 2)
    assert {n.split(".")[-2] for n in kept} == {"q_proj", "k_proj", "v_proj", "embed_tokens", "lm_head"}
    unset = EngineArgs(model=path, tensor_parallel_size=2)
    unset.validate()
    with caplog.at_level("WARNING", logger="kvserve.runner.build"):
        _check_codes_split(unset, loaded.config, loaded.codes)
    assert "o_proj, down_proj, gate_up_proj run on bf16 shards (the other projections keep" in caplog.text
