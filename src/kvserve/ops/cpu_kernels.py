"""Paged attention kernels in C++/OpenMP (csrc/), built with the system compiler on first use.

Why: torch's CPU SDPA (and batched matmul) over a gathered copy of the blocks is slow for the
shapes of paged attention: at 1 sequence x 256 keys decode it spends ~4x the time of reading the
K/V, at 64 sequences x 384 keys ~10x, and a prefill chunk pays for gathering its whole context.
Three kernels read every sequence's K/V straight out of its blocks:
  - csrc/paged_decode.cpp: decodes (one query row per sequence), float32 or bf16, float32 math.
  - csrc/paged_attention_bf16.cpp: decodes *and* prefill chunks of every sequence in one call
    (varlen), bf16 through AVX512-BF16 dot products; built where the CPU has them. It reads the
    KV cache's "pairs" layout (cache/paged.py), whose writes `store_kv_pairs` does. On CPUs with AMX
    its items of up to 16 query rows (head_dim 64) run on tiles instead (csrc/attend_amx.h;
    KVSERVE_AMX_ATTENTION=0 keeps the dot products, for comparisons).
  - csrc/decode_quantized.cpp: decodes over a quantized (int8, int4, fp8) cache's codes in place, the
    dequantization folded into the query and the probabilities.
The same library carries the quantized caches' cache-side passes (stage_quantized.cpp: staging,
the residual write; quantize_blocks.cpp: whole blocks to codes).

The sources are compiled with `g++ -O3 -march=native -fopenmp` into one library in a cache
directory keyed by the sources, the compiler, its target flags and the CPU's flags, and called
through ctypes (no torch headers: the build takes seconds instead of the ~1 min of a torch
extension). OpenMP resolves to the libgomp torch already loaded, so `torch.set_num_threads`
governs it too. Without a compiler (a warning says so) or with KVSERVE_CPU_KERNEL=0 the lookups
return None and the callers keep their pure-torch paths; where the CPU lacks an instruction set a
kernel needs, its lookup returns None the same way. A compiler that fails to build the library is
an error (KernelBuildError, with the compiler's message): silently falling back would make every
step several times slower with nothing but a log line to say why.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from kvserve import envs

log = logging.getLogger(__name__)


CSRC = Path(__file__).resolve().parent / "csrc"
# One library for every compiled CPU op: attention, the quantized caches' passes, the decoder's
# bf16 elementwise steps, projections and layer loop, and the sampler's argmax.
_SOURCES = tuple(CSRC / name for name in (
    "paged_decode.cpp", "paged_attention_bf16.cpp", "store_kv_pairs.cpp", "stage_quantized.cpp",
    "decode_quantized.cpp", "quantize_blocks.cpp", "elementwise_bf16.cpp", "gemm_bf16.cpp", "gemm_amx.cpp",
    "decoder_bf16.cpp", "argmax_bf16.cpp", "score_blocks_bf16.cpp"))
# Part of the cache key, not compiled alone.
_HEADERS = tuple(CSRC / name for name in (
    "avx512_exp.h", "bf16_vec.h", "gemm_epilogue.h", "amx.h", "weight_tiles.h", "attend_amx.h",
    "quant_fields.h", "decode_fp8_amx.h", "attend_decode.h", "gemm_grouped.h"))

_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_HEAD_DIMS = (64, 128)  # unrolled instances; others up to _MAX_HEAD_DIM use the generic one
_MAX_HEAD_DIM = 256
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int64,
             ctypes.c_int]

# q, out, q_start, q_len, q_stride, out_stride, k, v, block_tables, bt_stride, seq_lens, n, hq,
# hkv, block_size, scale, window, ngroups, group_start, group_members, group_prefix
_VARLEN_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_void_p]

# k, v, slots, T, k_stride, v_stride, k_cache, v_cache, hkv, head_dim, block_size
_STORE_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class MetaRefC(ctypes.Structure):  # csrc/stage_quantized.cpp's MetaRef
    _fields_ = [("ptr", _P), ("sb", _I64), ("st", _I64), ("sh", _I64), ("sd", _I64),
                ("gt", ctypes.c_int32), ("gd", ctypes.c_int32), ("kind", ctypes.c_int32)]


class QFieldC(ctypes.Structure):  # csrc/stage_quantized.cpp's QField
    _fields_ = [("codes", _P), ("code_block", _I64), ("code_kind", ctypes.c_int32),
                ("code_offset", ctypes.c_float), ("scale", MetaRefC), ("zero", MetaRefC), ("expo", MetaRefC)]


# kf, vf, res, block_res, block_ids, n, out_k, out_v, hkv, head_dim, block_size
_STAGE_ARGTYPES = [ctypes.POINTER(QFieldC), ctypes.POINTER(QFieldC), _P, _P, _P, _I64, _P, _P,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
# block_res, num_blocks, res_owner, entries, sealed_fill, res_mask, res_clock, res_kv, blocks, fresh,
# nblocks, index, offs, rows, ntok, k, v, nrows, k_stride, v_stride (bytes), row_bytes, block_size, clock
_RESIDUAL_WRITE_ARGTYPES = [_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _I64,
                            _I64, _I64, _I64, _I64, _I64]
_INT = ctypes.c_int
# k, v, is_bf16, n, src, src_stride, dst, dst_rows, block_size, hkv, head_dim, key group, value group, bits,
# compact, v_symmetric, k codes / scale / zero / exponent, v ...
_QUANT_INT_ARGTYPES = [_P, _P, _INT, _I64, _P, _I64, _P, _I64, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT,
                       _P, _P, _P, _P, _P, _P, _P, _P]
# k, v, is_bf16, n, src, src_stride, dst, dst_rows, block_size, hkv, head_dim, per_head, center,
# k codes / scale / mean, v codes / scale
_QUANT_FP8_ARGTYPES = [_P, _P, _INT, _I64, _P, _I64, _P, _I64, _INT, _INT, _INT, _INT, _INT, _P, _P, _P, _P, _P]
# kf, vf, res, block_res, q, out, q_rows, q_stride, out_stride, block_tables, bt_stride, seq_lens, n, hq,
# hkv, block_size, scale
_QDECODE_ARGTYPES = [ctypes.POINTER(QFieldC), ctypes.POINTER(QFieldC), _P, _P, _P, _P, _P, _I64, _I64, _P, _I64,
                     _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
_ELEMENTWISE_ARGTYPES = {  # ops/csrc/elementwise_bf16.cpp
    "add_rms_norm_bf16": [_P, _P, _I64, _P, _P, _I64, _I64, ctypes.c_float],  # h, delta, its stride, w, out, T, H, eps
    "rope_bf16": [_P, _I64, _I64, _I64, _I64, _P, _P],  # x, x_stride, T, nheads, D, cos, sin_signed
    "silu_mul_bf16": [_P, _I64, _P, _I64, _I64],  # gate_up, its row stride, out, T, I
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: KernelBuildError | None = None


def _cpu_fingerprint() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags + platform.machine()


class KernelBuildError(RuntimeError):
    """A C++ compiler exists but the kernel library did not build or load."""


def find_compiler() -> str | None:
    return envs.CXX or shutil.which("g++") or shutil.which("c++")


def _cache_dir() -> Path:
    return Path(envs.KVSERVE_CACHE_DIR) / "kernels"


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    text = "".join(src.read_text() for src in (*_SOURCES, *_HEADERS))
    target_flags = shlex.split(envs.KVSERVE_CPU_TARGET)
    key = hashlib.sha256((text + version + _cpu_fingerprint() + " ".join(target_flags)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        so = Path(tmp) / "paged_attention.so"
        cmd = [compiler, "-O3", *target_flags, "-fopenmp", "-shared", "-fPIC", "-std=c++17",
               *map(str, _SOURCES), "-o", str(so)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(so, target)  # atomic: concurrent builders never see a half-written library
    return target


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first call; None without a compiler or with
    KVSERVE_CPU_KERNEL=0. Raises KernelBuildError (every call) when the compiler fails."""
    global _lib, _tried, _error
    with _lock:
        if _error is not None:
            raise _error
        if _tried:
            return _lib
        _tried = True
        if not envs.KVSERVE_CPU_KERNEL:
            return None
        compiler = find_compiler()
        if compiler is None:
            log.warning("no C++ compiler found: the CPU kernels are not built, so attention and the "
                        "projections run as torch ops (several times slower); install g++, or set "
                        "KVSERVE_CPU_KERNEL=0 to run without them on purpose")
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
            for dt in _DTYPE_NAMES.values():
                for d in (*_HEAD_DIMS, "any"):
                    fn = getattr(lib, f"decode_{dt}_d{d}")
                    fn.argtypes = _ARGTYPES
                    fn.restype = None
            for d in _HEAD_DIMS:
                fn = getattr(lib, f"paged_attention_bf16_d{d}")
                fn.argtypes = _VARLEN_ARGTYPES
                fn.restype = ctypes.c_int
            lib.paged_attention_bf16_available.restype = ctypes.c_int
            lib.store_kv_pairs.argtypes = _STORE_ARGTYPES
            lib.store_kv_pairs.restype = None
            lib.stage_quantized_pairs.argtypes = _STAGE_ARGTYPES
            lib.stage_quantized_pairs.restype = None
            lib.stage_quantized_available.restype = ctypes.c_int
            lib.decode_quantized_tiles_enabled.restype = ctypes.c_int
            lib.residual_write_rows.argtypes = _RESIDUAL_WRITE_ARGTYPES
            lib.residual_write_rows.restype = ctypes.c_int
            lib.quantize_int_blocks.argtypes = _QUANT_INT_ARGTYPES
            lib.quantize_int_blocks.restype = ctypes.c_int
            lib.quantize_fp8_blocks.argtypes = _QUANT_FP8_ARGTYPES
            lib.quantize_fp8_blocks.restype = ctypes.c_int
            for d in _HEAD_DIMS:
                fn = getattr(lib, f"decode_quantized_d{d}")
                fn.argtypes = _QDECODE_ARGTYPES
                fn.restype = ctypes.c_int
            for name, argtypes in _ELEMENTWISE_ARGTYPES.items():
                getattr(lib, name).argtypes = argtypes
                getattr(lib, name).restype = None
            lib.elementwise_bf16_available.restype = ctypes.c_int
            for pack in (lib.gemm_bf16_pack, lib.gemm_bf16_pack_steps):
                pack.argtypes = [_P, _I64, _I64, _P]  # W, N, K, packed
                pack.restype = None
            # x, M, K, packed, N, y, epilogue kind, cos, sin_signed, head_dim, rope_cols
            lib.gemm_bf16.argtypes = [_P, _I64, _I64, _P, _I64, _P, ctypes.c_int, _P, _P, _I64, _I64]
            lib.gemm_bf16.restype = None
            lib.gemm_bf16_available.restype = ctypes.c_int
            lib.gemm_bf16_amx.argtypes = lib.gemm_bf16.argtypes
            lib.gemm_bf16_amx.restype = None
            lib.gemm_amx_available.restype = ctypes.c_int
            lib.gemm_bf16_amx_grouped.argtypes = [_P, ctypes.c_int]  # GemmProblem[n], n (csrc/gemm_grouped.h)
            lib.gemm_bf16_amx_grouped.restype = None
            for name in ("gemm_q4_1_amx", "gemm_q8_0_amx"):  # over GGUF codes (csrc/weight_tiles.h)
                getattr(lib, name).argtypes = lib.gemm_bf16.argtypes
                getattr(lib, name).restype = None
            for name in LORA_GEMM.values():  # the same with a LoRA expand (csrc/gemm_grouped.h's LoRAExt*)
                getattr(lib, name).argtypes = [*lib.gemm_bf16.argtypes, _P]
                getattr(lib, name).restype = None
            lib.run_decoder_bf16.argtypes = [_P, _P]  # DecoderModel*, DecoderStep* (model/cpu_decoder.py)
            lib.run_decoder_bf16.restype = ctypes.c_int
            # q, q_stride, n, last, stride, k_cache, block_table, seq_len, hq, hkv, head_dim, block_size, scale, out
            lib.score_blocks_bf16.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _INT, _INT, _INT, _INT,
                                              ctypes.c_float, _P]
            lib.score_blocks_bf16.restype = None
            lib.argmax_bf16_rows.argtypes = [_P, _I64, _I64, _I64, _P]  # x, rows, cols, row stride, out int64
            lib.argmax_bf16_rows.restype = None
            lib.argmax_bf16_available.restype = ctypes.c_int
            _lib = lib
        except Exception as e:
            _error = KernelBuildError(f"the CPU kernels did not build or load with {compiler}: {e}\nFix the "
                                      f"compiler (or point CXX at another), or set KVSERVE_CPU_KERNEL=0 to run "
                                      f"without them (several times slower)")
            raise _error from e
        return _lib


def decode_kernel_for(dtype: torch.dtype, head_dim: int, device: torch.device):
    """The kernel entry point for this dtype and head size on this device, or None."""
    if device.type != "cpu" or dtype not in _DTYPE_NAMES or head_dim > _MAX_HEAD_DIM:
        return None
    lib = load_library()
    if lib is None:
        return None
    return getattr(lib, f"decode_{_DTYPE_NAMES[dtype]}_d{head_dim if head_dim in _HEAD_DIMS else 'any'}")


def store_pairs_kernel():
    """`store_kv_pairs` (writes into the "pairs" KV layout, any 16-bit dtype), or None."""
    lib = load_library()
    return None if lib is None else lib.store_kv_pairs


def stage_quantized_kernel():
    """`stage_quantized_pairs` (quantized blocks -> bf16 pairs layout) where this CPU has
    AVX512-BF16, else None."""
    lib = load_library()
    return None if lib is None or not lib.stage_quantized_available() else lib.stage_quantized_pairs


def residual_write_kernel():
    """`residual_write_rows` (a quantized cache's decode-time residual write, plain C++), or None."""
    lib = load_library()
    return None if lib is None else lib.residual_write_rows


class BlockQuantizers(NamedTuple):
    """csrc/quantize_blocks.cpp: whole blocks to a quantized cache's codes and metadata, bit-equal to
    the torch path (quant.quantize_groups, quant.quantize_fp8). Each returns 0, or 1 having written
    nothing when a value must go to the torch path."""
    int_blocks: ctypes._CFuncPtr  # KIVI int8 / int4, float16 or compact e4m3 metadata
    fp8_blocks: ctypes._CFuncPtr  # fp8 e4m3, dynamic scales, centered keys


def block_quantizers() -> BlockQuantizers | None:
    lib = load_library()
    return None if lib is None else BlockQuantizers(lib.quantize_int_blocks, lib.quantize_fp8_blocks)


def quantized_decode_kernel_for(head_dim: int, device: torch.device):
    """`decode_quantized_d{head_dim}` (decode attention over a quantized cache's codes, csrc/
    decode_quantized.cpp) where this CPU has AVX512-BF16 (the staging pass's requirement too) and
    the head size has an instance, else None. It returns 0 when done, else writes nothing (1: a
    layout it does not read, 2: not now, -1: not built) and the caller stages."""
    if device.type != "cpu" or head_dim not in _HEAD_DIMS:
        return None
    lib = load_library()
    if lib is None or not lib.stage_quantized_available():
        return None
    return getattr(lib, f"decode_quantized_d{head_dim}")


def quantized_decode_tiles_enabled() -> bool:
    """Whether the codes kernel reads fp8 (e4m3) caches of head_dim 64 on AMX tiles
    (csrc/decode_fp8_amx.h) on this CPU now; KVSERVE_AMX_ATTENTION=0 turns it off."""
    lib = load_library()
    return lib is not None and bool(lib.decode_quantized_tiles_enabled())


def elementwise_kernels():
    """(add_rms_norm_bf16, rope_bf16, silu_mul_bf16) of csrc/elementwise_bf16.cpp where this CPU has AVX512-BF16,
    else None."""
    lib = load_library()
    if lib is None or not lib.elementwise_bf16_available():
        return None
    return lib.add_rms_norm_bf16, lib.rope_bf16, lib.silu_mul_bf16


def argmax_bf16_kernel():
    """`argmax_bf16_rows` (the first maximum of each bf16 row, numpy's answer) where this CPU has
    AVX512-BF16, else None."""
    lib = load_library()
    return None if lib is None or not lib.argmax_bf16_available() else lib.argmax_bf16_rows


# The AMX projection kernels and their twins that add a LoRA expand inside the product.
LORA_GEMM = {"gemm_bf16_amx": "gemm_bf16_amx_lora", "gemm_q4_1_amx": "gemm_q4_1_amx_lora",
             "gemm_q8_0_amx": "gemm_q8_0_amx_lora"}


def lora_gemm_for(kernel):
    """The LoRA twin of a projection kernel (by address), or None where it has none."""
    lib = load_library()
    address = ctypes.cast(kernel, ctypes.c_void_p).value
    for name, twin in LORA_GEMM.items():
        if ctypes.cast(getattr(lib, name), ctypes.c_void_p).value == address:
            return getattr(lib, twin)
    return None


class GemmBf16(NamedTuple):
    """ops/csrc/gemm_bf16.cpp (AVX512-BF16 dot products) or gemm_amx.cpp (AMX tiles): bf16
    projections over the same packed weight, with the same epilogues."""
    pack: ctypes._CFuncPtr  # (W [N, K], N, K, packed) -> the weight in the kernel's layout
    gemm: ctypes._CFuncPtr  # (x [M, K], M, K, packed, N, y [M, N], epilogue, cos, sin, head_dim, rope_cols)
    k_multiple: int  # K must be a multiple of this
    grouped: ctypes._CFuncPtr | None  # AMX: (GemmProblem[n], n), several products in one call


def gemm_bf16_kernels(amx: bool | None = None) -> GemmBf16 | None:
    """The bf16 projection kernel: AMX tiles where the CPU has them (and `amx` is not False),
    else AVX512-BF16 dot products where it has those, else None."""
    lib = load_library()
    if lib is None or not lib.gemm_bf16_available():
        return None
    if amx is not False and lib.gemm_amx_available():
        return GemmBf16(lib.gemm_bf16_pack, lib.gemm_bf16_amx, 32, lib.gemm_bf16_amx_grouped)
    if amx:
        return None
    return GemmBf16(lib.gemm_bf16_pack_steps, lib.gemm_bf16, 2, None)


def gemm_codes_kernel(qtype: str):
    """The AMX projection kernel over GGUF codes of `qtype` (model/weight_codes.py), or None where
    the CPU has no AMX or the type has no kernel."""
    lib = load_library()
    name = {"Q4_1": "gemm_q4_1_amx", "Q8_0": "gemm_q8_0_amx"}.get(qtype)
    if name is None or lib is None or not lib.gemm_bf16_available() or not lib.gemm_amx_available():
        return None
    return getattr(lib, name)


def varlen_kernel_for(dtype: torch.dtype, head_dim: int, device: torch.device):
    """The bf16 varlen kernel (decodes and prefill chunks in one call; it reads the "pairs" KV
    layout) when this CPU has AVX512-BF16 and the head size has an instance, else None."""
    if device.type != "cpu" or dtype != torch.bfloat16 or head_dim not in _HEAD_DIMS:
        return None
    lib = load_library()
    if lib is None or not lib.paged_attention_bf16_available():
        return None
    return getattr(lib, f"paged_attention_bf16_d{head_dim}")
