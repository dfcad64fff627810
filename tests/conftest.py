"""Shared fixtures, what this machine can run, and the rule that a test skips only for that.

A test that needs hardware or a platform feature says so with `@pytest.mark.needs("amx")`; it is
skipped, with the capability named, only where the capability is missing. Nothing else may skip:
with `--check-skips` (scripts/test.sh passes it) a skip for any other reason fails the run, so a
broken kernel build or import can never turn tests into quiet skips.

Capabilities come from what the compiler enables for the kernels' target (`g++ -dM -E` with
KVSERVE_CPU_TARGET, default -march=native), not from the kernel library's own answers, so they
are independent evidence. Where a C++ compiler exists the library must build: a failure stops the
run with the compiler's message (KVSERVE_CPU_KERNEL=0 opts out, for machines without one).
"""
from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CUDA_TESTS = TESTS / "test_cuda.py"

CAPABILITIES = {
    "cpu_kernels": "the compiled CPU kernels (a C++ compiler, KVSERVE_CPU_KERNEL not 0)",
    "avx512_bf16": "AVX512-BF16 in the kernels' build target",
    "amx": "AMX tiles (bf16) in the kernels' build target",
    "no_avx512_bf16": "a CPU (build target) without AVX512-BF16",
    "no_amx": "a CPU (build target) without AMX",
    "cuda": "a CUDA GPU",
    "cuda_2": "two CUDA GPUs (tensor parallelism over NCCL)",
    "glibc": "glibc (mallopt)",
    "linux": "Linux /proc",
    "promtool": "promtool (Debian package prometheus; .ci/install_observability.sh)",
    "prometheus": "the Prometheus server (Debian package prometheus; .ci/install_observability.sh)",
    "chromium": "headless Chromium (Debian package chromium; .ci/install_observability.sh)",
}


def _target_macros() -> set[str]:
    from kvserve import envs
    compiler = envs.CXX or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return set()
    out = subprocess.run([compiler, *shlex.split(envs.KVSERVE_CPU_TARGET), "-dM", "-E", "-x", "c++", os.devnull],
                         capture_output=True, text=True, timeout=60)
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}


@lru_cache(maxsize=None)
def capabilities() -> dict[str, bool]:
    from kvserve import envs
    macros = _target_macros()
    kernels = bool(envs.KVSERVE_CPU_KERNEL) and bool(macros)
    bf16 = kernels and {"__AVX512F__", "__AVX512BW__", "__AVX512BF16__"} <= macros
    amx = bf16 and {"__AMX_TILE__", "__AMX_BF16__"} <= macros
    import torch
    return {"cpu_kernels": kernels, "avx512_bf16": bf16, "amx": amx, "no_avx512_bf16": kernels and not bf16,
            "no_amx": bf16 and not amx, "cuda": torch.cuda.is_available(),
            "cuda_2": torch.cuda.is_available() and torch.cuda.device_count() >= 2,
            "glibc": platform.libc_ver()[0] == "glibc", "linux": Path("/proc/meminfo").exists(),
            "promtool": shutil.which("promtool") is not None, "prometheus": shutil.which("prometheus") is not None,
            "chromium": shutil.which("chromium") is not None}


def has(capability: str) -> bool:
    return capabilities()[capability]


# -- shared fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (GQA, 3 layers; max_position_embeddings 1024) on disk."""
    from tiny_models import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), kind="llama_gqa"))


@pytest.fixture(scope="session")
def tiny_hf(tiny):
    """transformers' model of `tiny`, float32: the reference."""
    from hf_reference import load_hf
    return load_hf(tiny)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' model of the embedded SmolLM2-135M-Instruct, float32, on kvserve's weights."""
    from hf_reference import load_hf
    return load_hf(None)


@pytest.fixture
def redis_server():
    """A real redis-server on 127.0.0.1 and a free port, empty, stopped after the test."""
    from redis_server import RedisServer
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_d64(tmp_path_factory) -> str:
    """A tiny checkpoint with head_dim 64, the size the bf16 CPU kernels take."""
    from tiny_models import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_d64"), kind="llama_d64"))


# -- options, markers, collection ------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--check-skips", action="store_true",
                     help="fail the run when a test skips for any reason but a missing capability")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*capabilities): skip unless this machine has them "
                                       f"({', '.join(CAPABILITIES)})")
    config.addinivalue_line("markers", "slow: loads the embedded SmolLM2 model, starts a server or runs long")
    config._capability_skips = set()


def pytest_sessionstart(session):
    """Where a compiler exists the kernels must build; no compiler needs the explicit opt-out."""
    from kvserve import envs
    if not envs.KVSERVE_CPU_KERNEL:
        return
    from kvserve.ops import cpu_kernels
    if cpu_kernels.find_compiler() is None:
        raise pytest.UsageError("no C++ compiler found for the CPU kernels: install g++, or set "
                                "KVSERVE_CPU_KERNEL=0 to test the torch paths alone")
    try:
        cpu_kernels.load_library()
    except cpu_kernels.KernelBuildError as e:  # the run stops here, with the compiler's message
        raise pytest.UsageError(str(e)) from None
    if envs.KVSERVE_CPU_TARGET == envs.VARIABLES["KVSERVE_CPU_TARGET"].default():
        # Built for this CPU: what the compiler enables must be what the CPU reports (lscpu's
        # flags), or a capability would be skipped (or run) for the wrong reason.
        flags = _cpu_flags()
        for cap, flag in (("avx512_bf16", "avx512_bf16"), ("amx", "amx_bf16")):
            if flags and has(cap) != (flag in flags):
                raise pytest.UsageError(f"the compiler {'enables' if has(cap) else 'does not enable'} {cap} "
                                        f"for -march=native but the CPU {'lacks' if has(cap) else 'has'} {flag}")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def _cuda_tests_alone(config) -> bool:
    args = [Path(a.split("::")[0]).resolve() for a in config.args]
    return bool(args) and all(a == CUDA_TESTS for a in args)


def pytest_ignore_collect(collection_path, config):
    # The interpreter tests (test_triton_attention.py) set TRITON_INTERPRET for their process,
    # which makes triton unusable on a GPU there: the CUDA tests run in a process of their own
    # (`python -m pytest tests/test_cuda.py`, which scripts/test.sh runs after the rest).
    if Path(collection_path).resolve() == CUDA_TESTS and not _cuda_tests_alone(config):
        return True
    return None


def pytest_report_header(config):
    caps = capabilities()
    line = "capabilities: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in caps.items())
    notes = [line]
    if not _cuda_tests_alone(config):
        notes.append("tests/test_cuda.py runs in its own process: python -m pytest tests/test_cuda.py")
    return notes


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in item.iter_markers("needs"):
            unknown = [c for c in mark.args if c not in CAPABILITIES]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid}: unknown capability {unknown}; known: {list(CAPABILITIES)}")
            missing = [c for c in mark.args if not has(c)]
            if missing:
                item.add_marker(pytest.mark.skip(reason="needs " + "; ".join(CAPABILITIES[c] for c in missing)))
                config._capability_skips.add(item.nodeid)


@pytest.fixture(autouse=True)
def _kernels_present_where_needed(request):
    """A test that needs a capability runs only where the kernels for it exist: a lookup that
    answers None there (a broken build, a wrong availability check) fails the test instead of
    letting it compare the torch fallback with itself."""
    needed = {c for mark in request.node.iter_markers("needs") for c in mark.args}
    if needed & {"cpu_kernels", "avx512_bf16", "amx"}:
        import torch

        from kvserve.ops import cpu_kernels
        cpu = torch.device("cpu")
        assert cpu_kernels.load_library() is not None, "the CPU kernel library did not load"
        assert cpu_kernels.decode_kernel_for(torch.float32, 64, cpu) is not None
        if needed & {"avx512_bf16", "amx"}:
            assert cpu_kernels.varlen_kernel_for(torch.bfloat16, 64, cpu) is not None, "no varlen bf16 kernel"
            assert cpu_kernels.gemm_bf16_kernels(amx=False) is not None, "no bf16 GEMM kernel"
            assert cpu_kernels.elementwise_kernels() is not None, "no bf16 elementwise kernels"
        if "amx" in needed:
            assert cpu_kernels.gemm_bf16_kernels(amx=True) is not None, "no AMX GEMM kernel"
    yield


# -- the skip check --------------------------------------------------------------------------------

def _reason(report) -> str:
    return (report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)).removeprefix(
        "Skipped: ")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _reason(report)))


_SKIPS: list[tuple[str, str]] = []


def _unexplained(config) -> list[tuple[str, str]]:
    return [(nodeid, why) for nodeid, why in _SKIPS if nodeid not in config._capability_skips]


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--check-skips") and _unexplained(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _SKIPS:
        return
    counts: dict[str, int] = {}
    for nodeid, why in _SKIPS:
        if nodeid in config._capability_skips:
            counts[why] = counts.get(why, 0) + 1
    terminalreporter.section("skips")
    for why, n in sorted(counts.items()):
        terminalreporter.line(f"{n:5d}  {why}")
    wrong = _unexplained(config)
    if wrong:
        terminalreporter.line(f"{len(wrong):5d}  NOT explained by a missing capability"
                              f"{' (--check-skips fails the run)' if config.getoption('--check-skips') else ''}:")
        for nodeid, why in wrong:
            terminalreporter.line(f"         {nodeid}: {why}")
