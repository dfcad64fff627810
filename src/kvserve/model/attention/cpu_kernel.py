"""Paged decode attention as a small C++/OpenMP kernel, built with the system compiler on first use.

Why: torch's CPU SDPA (and batched matmul) over a gathered copy of the blocks is slow for the
shapes of decode (1 query row per sequence, G = Hq/Hkv heads per K/V head): at 1 sequence x 256
keys it spends ~4x the time of reading the K/V, and at 64 sequences x 384 keys ~10x. This kernel
reads every sequence's K/V straight out of its blocks (no gathered copy), once per K/V head for
all G query heads sharing it, in float32 accumulation, parallel over (sequence, K/V head).

The source is compiled with `g++ -O3 -march=native -fopenmp` into a cache directory keyed by the
source, the compiler and the CPU's flags, and called through ctypes (no torch headers: the build
takes ~1 s instead of the ~1 min of a torch extension). OpenMP resolves to the libgomp torch
already loaded, so `torch.set_num_threads` governs it too. If anything fails (no compiler, an
unsupported dtype, KVSERVE_CPU_KERNEL=0), `load_decode_kernel` returns None and the backend keeps
its pure-torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "KVSERVE_CPU_KERNEL"  # "0" turns the compiled kernel off

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <omp.h>

#define MAX_DH 256

static inline float to_f32(float x) { return x; }
static inline float to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline void from_f32(float x, float* out) { *out = x; }
// exp for x <= 0 (softmax after subtracting the max), ~1e-7 relative error, branch-free so the
// loop vectorises (libm's expf does not without -ffast-math).
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}
static inline void from_f32(float x, uint16_t* out) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *out = 0x7fc0; return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as torch's bf16 cast
    *out = (uint16_t)(u >> 16);
}

// Blocks sit anywhere in the pool and span pages, where the hardware prefetcher stops: ask for
// the next block's lines while this one is being used.
template <typename T>
static inline void prefetch_block(const T* p, int64_t elems) {
    const char* c = (const char*)p;
    for (int64_t off = 0; off < elems * (int64_t)sizeof(T); off += 64) __builtin_prefetch(c + off);
}

// q, out: rows q_rows[i] of [*, Hq, D] (row strides q_stride, out_stride elements; heads dense). k_cache, v_cache: one
// layer's [num_blocks, bs, Hkv, D]. block_tables: [N, bt_stride]. seq_lens: [N]; the query sits
// at position seq_lens[i] - 1. window > 0: keys older than window positions are invisible.
// Work item = (sequence, group of K/V heads): all heads of a sequence together when there are
// enough sequences to keep every thread busy (a block's tokens are then read contiguously),
// one K/V head per item otherwise (batch 1 still spreads over the threads).
template <typename T, int DH_FIXED>
static void decode_attention(const T* q, T* out, const int64_t* q_rows, int64_t q_stride, int64_t out_stride,
                             const T* k_cache, const T* v_cache, const int64_t* block_tables,
                             int64_t bt_stride, const int64_t* seq_lens, int n, int hq, int hkv,
                             int bs, float scale, int64_t window, int dh) {
    // DH_FIXED > 0: head size known at compile time (unrolled); 0: any dh <= MAX_DH.
    const int DH = DH_FIXED ? DH_FIXED : dh;
    const int g = hq / hkv;
    const int64_t tok_stride = (int64_t)hkv * DH;
    const int splits = n >= 4 * omp_get_max_threads() ? 1 : hkv;
    const int heads_per_item = hkv / splits;
    const int hq_item = heads_per_item * g;
    #pragma omp parallel
    {
        std::vector<float> scores;
        std::vector<float> qf((size_t)hq_item * DH), acc((size_t)hq_item * DH);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)n * splits; ++item) {
            const int i = (int)(item / splits);
            const int h0 = (int)(item % splits) * heads_per_item;
            const int64_t len = seq_lens[i];
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const int64_t nkeys = len - first;
            if ((int64_t)scores.size() < (int64_t)hq_item * nkeys) scores.resize((size_t)hq_item * nkeys);
            const T* qrow = q + q_rows[i] * q_stride + (int64_t)h0 * g * DH;
            for (int j = 0; j < hq_item * DH; ++j) qf[j] = to_f32(qrow[j]) * scale;
            const int64_t* table = block_tables + (int64_t)i * bt_stride;
            const int64_t b_first = first / bs, b_end = (len + bs - 1) / bs;
            // Pass 1: scores[j][t] = q_j . k_t for every query head j of the item.
            for (int64_t b = b_first; b < b_end; ++b) {
                const T* kb = k_cache + table[b] * bs * tok_stride + (int64_t)h0 * DH;
                if (b + 1 < b_end) prefetch_block(k_cache + table[b + 1] * bs * tok_stride, bs * tok_stride);
                const int64_t t0 = first > b * bs ? first - b * bs : 0;
                const int64_t t1 = len - b * bs < bs ? len - b * bs : bs;
                for (int64_t t = t0; t < t1; ++t) {
                    const int64_t col = b * bs + t - first;
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        const T* kr = kb + t * tok_stride + hh * DH;
                        float kf[DH_FIXED ? DH_FIXED : MAX_DH];
                        #pragma omp simd
                        for (int d = 0; d < DH; ++d) kf[d] = to_f32(kr[d]);
                        for (int j = hh * g; j < (hh + 1) * g; ++j) {
                            const float* qj = &qf[(size_t)j * DH];
                            float s = 0.f;
                            #pragma omp simd reduction(+:s)
                            for (int d = 0; d < DH; ++d) s += qj[d] * kf[d];
                            scores[(size_t)j * nkeys + col] = s;
                        }
                    }
                }
            }
            // Softmax per query head.
            for (int j = 0; j < hq_item; ++j) {
                float* sj = &scores[(size_t)j * nkeys];
                float m = -INFINITY;
                for (int64_t t = 0; t < nkeys; ++t) m = sj[t] > m ? sj[t] : m;
                float sum = 0.f;
                #pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < nkeys; ++t) { sj[t] = exp_nonpos(sj[t] - m); sum += sj[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < nkeys; ++t) sj[t] *= inv;
            }
            // Pass 2: acc_j = sum_t p_jt v_t
            for (int j = 0; j < hq_item * DH; ++j) acc[j] = 0.f;
            for (int64_t b = b_first; b < b_end; ++b) {
                const T* vb = v_cache + table[b] * bs * tok_stride + (int64_t)h0 * DH;
                if (b + 1 < b_end) prefetch_block(v_cache + table[b + 1] * bs * tok_stride, bs * tok_stride);
                const int64_t t0 = first > b * bs ? first - b * bs : 0;
                const int64_t t1 = len - b * bs < bs ? len - b * bs : bs;
                for (int64_t t = t0; t < t1; ++t) {
                    const int64_t col = b * bs + t - first;
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        const T* vr = vb + t * tok_stride + hh * DH;
                        float vf[DH_FIXED ? DH_FIXED : MAX_DH];
                        #pragma omp simd
                        for (int d = 0; d < DH; ++d) vf[d] = to_f32(vr[d]);
                        for (int j = hh * g; j < (hh + 1) * g; ++j) {
                            const float w = scores[(size_t)j * nkeys + col];
                            float* aj = &acc[(size_t)j * DH];
                            #pragma omp simd
                            for (int d = 0; d < DH; ++d) aj[d] += w * vf[d];
                        }
                    }
                }
            }
            T* orow = out + q_rows[i] * out_stride + (int64_t)h0 * g * DH;
            for (int j = 0; j < hq_item * DH; ++j) from_f32(acc[j], &orow[j]);
        }
    }
}

#define ENTRY(NAME, T, DH) \
extern "C" void NAME(const void* q, void* out, const int64_t* q_rows, int64_t q_stride, int64_t out_stride, \
                     const void* k, const void* v, const int64_t* bt, int64_t bt_stride, \
                     const int64_t* seq_lens, int n, int hq, int hkv, int bs, float scale, \
                     int64_t window, int dh) { \
    decode_attention<T, DH>((const T*)q, (T*)out, q_rows, q_stride, out_stride, (const T*)k, (const T*)v, bt, \
                            bt_stride, seq_lens, n, hq, hkv, bs, scale, window, dh); \
}
ENTRY(decode_f32_d64, float, 64)
ENTRY(decode_f32_d128, float, 128)
ENTRY(decode_bf16_d64, uint16_t, 64)
ENTRY(decode_bf16_d128, uint16_t, 128)
ENTRY(decode_f32_dany, float, 0)
ENTRY(decode_bf16_dany, uint16_t, 0)
"""

_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_HEAD_DIMS = (64, 128)  # unrolled instances; others up to _MAX_HEAD_DIM use the generic one
_MAX_HEAD_DIM = 256
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int64,
             ctypes.c_int]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_fingerprint() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags + platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")
    return Path(root) / "kernels"


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256((_SOURCE + version + _cpu_fingerprint()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "paged_decode.cpp"
        src.write_text(_SOURCE)
        so = Path(tmp) / "paged_decode.so"
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
               str(src), "-o", str(so)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(so, target)  # atomic: concurrent builders never see a half-written library
    return target


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first call; None when it cannot be had."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get(DISABLE_ENV, "1") == "0":
            return None
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            log.info("no C++ compiler found; decode attention uses the pure-torch path")
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
            for dt in _DTYPE_NAMES.values():
                for d in (*_HEAD_DIMS, "any"):
                    fn = getattr(lib, f"decode_{dt}_d{d}")
                    fn.argtypes = _ARGTYPES
                    fn.restype = None
            _lib = lib
        except Exception as e:  # any build or load failure: fall back, say why once
            log.warning("paged decode kernel unavailable, using the pure-torch path: %s", e)
        return _lib


def decode_kernel_for(dtype: torch.dtype, head_dim: int, device: torch.device):
    """The kernel entry point for this dtype and head size on this device, or None."""
    if device.type != "cpu" or dtype not in _DTYPE_NAMES or head_dim > _MAX_HEAD_DIM:
        return None
    lib = load_library()
    if lib is None:
        return None
    return getattr(lib, f"decode_{_DTYPE_NAMES[dtype]}_d{head_dim if head_dim in _HEAD_DIMS else 'any'}")
