"""glibc malloc kept from handing a CPU forward pass freshly mapped pages every step.

A prefill step allocates tens of MB of activations per layer (a 2,048-token chunk's gate/up
output alone is 12.6 MB) and frees them a few ops later. glibc serves blocks that large with
mmap, or trims them off the top of the heap when freed, so the next layer gets new pages and
the kernel faults and zeroes every one of them: ~64,000 minor faults per 2,048-token step of
SmolLM2, and 35-45 % of its time (bench/NOTES.md, "glibc malloc tuned by two mallopt
calls, no preloaded allocator"). vLLM's CPU docs answer this by
preloading tcmalloc; the same effect comes from glibc itself when large blocks stay on the heap
and the heap is not trimmed, which needs no preload or re-exec and works on any glibc system.

Blocks over 32 MiB (glibc's ceiling for the threshold: an 8B model's 2,048-token MLP activation)
are still mapped afresh. The heap then keeps its high-water mark (a few hundred MB for the largest step) instead of
returning it to the OS between steps: the memory is in use again on the next step anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

from kvserve import envs

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2): larger blocks are mapped
# whatever is asked, so the cap itself is the setting.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30

_tuned: bool | None = None


def tune_malloc_for_inference() -> bool:
    """Keep large blocks on the heap and the heap untrimmed; True if glibc took the settings.
    Idempotent. `KVSERVE_MALLOC_TUNING=0` leaves malloc alone (for A/B runs, or when another
    allocator is preloaded)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not envs.KVSERVE_MALLOC_TUNING:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # present in glibc only; musl and macOS have no such knobs
    except (OSError, AttributeError):
        log.debug("not glibc: malloc left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)))
    if not _tuned:
        log.warning("glibc refused the malloc settings for inference; large activations will be "
                    "page-faulted afresh every step (expect slower CPU prefill)")
    return _tuned


HUGE_PAGE = 2 << 20


def zeros_huge_pages(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, but on CPU backed by a mapping asked to come in 2 MiB pages (madvise
    MADV_HUGEPAGE: transparent huge pages are "madvise" on most distributions, so nothing gets
    them unasked). Why: decode attention reads each sequence's blocks, scattered over a pool of
    GBs; with 4 KiB pages nearly every block is a TLB miss and a page walk whose table entries
    are themselves cache misses. Falls back to torch.zeros on other devices, when the platform
    has no madvise, or with KVSERVE_HUGE_PAGES=0."""
    device = torch.device(device)
    if (device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE")
            or not envs.KVSERVE_HUGE_PAGES):
        return torch.zeros(*shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(*shape, dtype=dtype, device=device)
    # Anonymous mappings come zeroed, and the tensor keeps the mapping alive (frombuffer).
    buf = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # a kernel without THP: ordinary pages
        log.debug("madvise(MADV_HUGEPAGE) failed (%s): KV cache in 4 KiB pages", e)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    # Touched now, as torch.zeros would: the pages (and their zeroing) are taken at start-up,
    # not faulted in by whichever step first writes a block.
    flat.zero_()
    return flat.view(dtype).view(*shape)
