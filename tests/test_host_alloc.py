"""The malloc settings for CPU inference: freed activations are reused, not faulted in afresh.

Each case runs in its own interpreter: the settings are process-wide and one-way."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

# Prints: whether glibc took the settings; whether a fresh process's first 20 MB block lies on the
# heap (untuned glibc maps any block over 128 KB until a free raises its threshold); and the page
# faults of 10 rounds of three 8 MiB activations live together then freed, after 5 rounds of
# warm-up - the pattern that makes untuned glibc trim the heap and fault it back in every round.
PROBE = """
import resource, torch
from kvserve.model.host_alloc import tune_malloc_for_inference
tuned = tune_malloc_for_inference()
block = torch.empty(10 << 20, dtype=torch.int16)
heap = [l.split()[0].split("-") for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
on_heap = any(int(a, 16) <= block.data_ptr() < int(b, 16) for a, b in heap)
del block
def layer():
    live = [torch.empty(4 << 20, dtype=torch.int16).fill_(1) for _ in range(3)]
    del live
for _ in range(5):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(tuned, on_heap, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(tuning: str) -> tuple[bool, bool, int]:
    env = {**os.environ, "KVSERVE_MALLOC_TUNING": tuning, "OMP_NUM_THREADS": "1"}
    tuned, on_heap, faults = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                            env=env, check=True, timeout=120).stdout.split()
    return tuned == "True", on_heap == "True", int(faults)


def test_large_activations_stay_on_the_heap_and_are_not_refaulted():
    tuned, on_heap, faults = _probe("1")
    assert tuned and on_heap
    assert faults < 100, f"{faults} page faults in 10 rounds of reused activations"
    tuned, on_heap, _ = _probe("0")  # the switch leaves glibc as it was: blocks mapped afresh
    assert not tuned and not on_heap


def test_the_cpu_runner_applies_the_settings(tmp_path):
    code = f"""
from tiny_models import make_tiny_model
from kvserve.model import host_alloc
from kvserve import LLM
assert host_alloc._tuned is None
LLM(str(make_tiny_model({str(tmp_path / 'm')!r}, kind="llama_gqa")), dtype="float32",
    kv_cache_memory=2**22)
print(host_alloc._tuned)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300, cwd=str(Path(__file__).parent),
                         env={**os.environ, "KVSERVE_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"})
    assert out.stdout.split()[-1] == "True", out.stdout + out.stderr
