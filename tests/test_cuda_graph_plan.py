"""Which decode batch sizes get CUDA graphs, and which settings turn them off (no GPU needed;
test_cuda.py captures and replays them on a GPU)."""
from __future__ import annotations

import pytest
import torch

from kvserve.cache.paged import PagedKVCache
from kvserve.cli import build_parser, engine_args_from
from kvserve.config import ConfigError, EngineArgs
from kvserve.runner.build import cuda_graph_sizes
from kvserve.runner.cuda_graph import capture_sizes, graphs_unsupported


def test_capture_sizes_are_vllms() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 3 + 64


def test_sizes_from_the_flags() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cuda_graph_sizes(EngineArgs(max_num_seqs=256), cpu) == []
    assert cuda_graph_sizes(EngineArgs(enforce_eager=True), cuda) == []
    assert cuda_graph_sizes(EngineArgs(max_num_seqs=24), cuda) == [1, 2, 4, 8, 16, 24]
    assert cuda_graph_sizes(EngineArgs(max_num_seqs=256, max_cudagraph_capture_size=8), cuda) == [1, 2, 4, 8]


def test_cli_flags_map_onto_engine_args() -> None:
    ns = build_parser().parse_args(["serve", "--enforce-eager", "--max-cudagraph-capture-size", "64"])
    args = engine_args_from(ns)
    assert args.enforce_eager is True and args.max_cudagraph_capture_size == 64
    assert engine_args_from(build_parser().parse_args(["serve"])).enforce_eager is False


def test_a_non_positive_capture_size_names_enforce_eager() -> None:
    with pytest.raises(ConfigError, match="--enforce-eager"):
        EngineArgs(max_cudagraph_capture_size=0).validate()


@pytest.mark.slow
def test_cpu_models_are_not_captured(tmp_path) -> None:
    from tiny_models import make_tiny_model

    from kvserve.model.llama import LlamaModel
    from kvserve.model.loader import load_model

    loaded = load_model(str(make_tiny_model(tmp_path, "llama_gqa")), torch.float32)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, "cpu")
    cache = PagedKVCache(loaded.config, num_blocks=4, block_size=16, dtype=torch.float32)
    assert "CUDA device" in graphs_unsupported(model, cache)
