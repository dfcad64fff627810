"""The malloc settings for CPU inference: freed activations are reused, not faulted in afresh.

Each case runs in its own interpreter: the settings are process-wide and one-way."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("glibc")

# Prints: whether glibc took the settings; whether a fresh process's first 20 MB block lies on the
# heap (untuned glibc maps any block over 128 KB until a free raises its threshold); and the page
# faults of 10 rounds of three 8 MiB activations live together then freed, after 5 rounds of
# warm-up - the pattern that makes untuned glibc trim the heap and fault it back in every round.
PROBE = """
import resource, torch
from kvserve.ops.host_alloc import tune_malloc_for_inference
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


@pytest.mark.slow
def test_large_activations_stay_on_the_heap_and_are_not_refaulted():
    tuned, on_heap, faults = _probe("1")
    assert tuned and on_heap
    assert faults < 100, f"{faults} page faults in 10 rounds of reused activations"
    tuned, on_heap, _ = _probe("0")  # the switch leaves glibc as it was: blocks mapped afresh
    assert not tuned and not on_heap


@pytest.mark.slow
def test_the_cpu_runner_applies_the_settings(tmp_path):
    code = f"""
from tiny_models import make_tiny_model
from kvserve.ops import host_alloc
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


def _smaps_entry(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding address ptr."""
    entry, hit = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if hit:
                break
            a, b = (int(x, 16) for x in head.split("-"))
            hit = a <= ptr < b
        elif hit:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


@pytest.mark.needs("linux")
def test_kv_pools_are_zeroed_mappings_advised_for_huge_pages(monkeypatch):
    """zeros_huge_pages (the CPU KV caches' storage): zeros of the asked shape and dtype, in a
    mapping marked MADV_HUGEPAGE (smaps "hg"), touched at allocation (its pages are resident, as
    torch.zeros's would be); small tensors, KVSERVE_HUGE_PAGES=0 and other devices get torch.zeros."""
    import torch

    from kvserve.ops.host_alloc import HUGE_PAGE, zeros_huge_pages

    t = zeros_huge_pages(3, 2, 1000, 777, dtype=torch.bfloat16)
    assert t.shape == (3, 2, 1000, 777) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 1, 999, 776] = 5.0  # writable, and the last element is inside the mapping
    assert float(t.float().sum()) == 5.0
    smaps = _smaps_entry(t.data_ptr())
    if "VmFlags" in smaps and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "hg" in smaps["VmFlags"].split()
    assert int(smaps["Rss"].split()[0]) * 1024 >= t.numel() * t.element_size() - HUGE_PAGE
    assert not zeros_huge_pages(10, dtype=torch.float32).any()  # under one huge page: torch.zeros
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    plain = zeros_huge_pages(4 << 20, dtype=torch.uint8)
    assert "hg" not in _smaps_entry(plain.data_ptr()).get("VmFlags", "").split()
