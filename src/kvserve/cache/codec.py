"""Block serialization: a block's per-layer K/V tensors <-> one contiguous byte buffer.

Layout: a small header (magic, tensor count, per tensor dtype code, offset and shape) and the raw
tensor bytes, each at a 64-byte aligned offset. No pickle: a stored entry can come from another
process (disk, Redis) and must never be able to run code. Unpacking returns zero-copy views over
the buffer, so restoring a block is one copy from the tier's buffer into the KV pool.
"""
from __future__ import annotations

import struct
import warnings
from typing import Sequence

import numpy as np
import torch

from kvserve.kv.tiers.base import Buffer

BLOCK_MAGIC = b"KVBK"
_HEAD = struct.Struct("<4sHH")  # magic, version, num_tensors
_TENSOR = struct.Struct("<BBHQ")  # dtype code, ndim, reserved, byte offset from buffer start
_DIM = struct.Struct("<I")
_ALIGN = 64
_VERSION = 1

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5, torch.int8: 6, torch.uint8: 7, torch.int16: 8, torch.int32: 9,
    torch.int64: 10, torch.float64: 11, torch.bool: 12,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

# Views over a bytes object (Redis replies) are read-only in fact; torch warns that it cannot
# mark them so. Unpacked tensors are documented read-only (the caller copies them into the pool).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class BlockFormatError(ValueError):
    """A payload is not a packed block (or was packed by an incompatible version)."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def packed_size(tensors: Sequence[torch.Tensor]) -> int:
    header = _HEAD.size + sum(_TENSOR.size + _DIM.size * t.dim() for t in tensors)
    return _align(header) + sum(_align(t.numel() * t.element_size()) for t in tensors)


def pack_block(tensors: Sequence[torch.Tensor]) -> bytearray:
    """Pack tensors (e.g. [k_0, v_0, k_1, v_1, ...], or codes and scales for quantized KV) into one
    buffer. Tensors on an accelerator are copied down one by one; for bulk offload the model
    runner should gather a block into a pinned staging tensor first and pack that."""
    if len(tensors) > 0xFFFF:
        raise ValueError(f"a block packs at most 65535 tensors, got {len(tensors)}")
    header = bytearray(_HEAD.pack(BLOCK_MAGIC, _VERSION, len(tensors)))
    offsets: list[int] = []
    offset = _align(_HEAD.size + sum(_TENSOR.size + _DIM.size * t.dim() for t in tensors))
    for t in tensors:
        code = _DTYPE_CODES.get(t.dtype)
        if code is None:
            raise ValueError(f"pack_block: dtype {t.dtype} has no wire code; supported: "
                             f"{', '.join(str(d) for d in _DTYPE_CODES)}")
        header += _TENSOR.pack(code, t.dim(), 0, offset)
        for dim in t.shape:
            header += _DIM.pack(dim)
        offsets.append(offset)
        offset += _align(t.numel() * t.element_size())
    out = bytearray(offset)
    out[:len(header)] = header
    dst = np.frombuffer(out, dtype=np.uint8)  # writable view: out is a bytearray
    for t, start in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            # Byte copies go through numpy (a plain memcpy): torch's uint8 copy_ splits ~1 MB
            # across its thread pool and is 100x slower on a busy CPU. reshape(-1) copies only
            # if t is strided; view(uint8) reinterprets the bits (bf16 and fp8 included).
            dst[start:start + nbytes] = t.detach().reshape(-1).view(torch.uint8).cpu().numpy()
    return out


def unpack_block(buf: Buffer) -> list[torch.Tensor]:
    """Inverse of pack_block: CPU tensors that are views over `buf` (no copy; treat read-only,
    and keep `buf` alive while using them)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < _HEAD.size:
        raise BlockFormatError(f"payload of {view.nbytes} bytes is too short for a block header")
    magic, version, count = _HEAD.unpack_from(view)
    if magic != BLOCK_MAGIC or version != _VERSION:
        raise BlockFormatError(f"not a packed block (magic {bytes(magic)!r}, version {version})")
    pos = _HEAD.size
    out: list[torch.Tensor] = []
    for _ in range(count):
        if pos + _TENSOR.size > view.nbytes:
            raise BlockFormatError("block header truncated")
        code, ndim, _, offset = _TENSOR.unpack_from(view, pos)
        pos += _TENSOR.size
        if pos + ndim * _DIM.size > view.nbytes:
            raise BlockFormatError("block header truncated")
        shape = [_DIM.unpack_from(view, pos + i * _DIM.size)[0] for i in range(ndim)]
        pos += ndim * _DIM.size
        dtype = _CODE_DTYPES.get(code)
        if dtype is None:
            raise BlockFormatError(f"unknown dtype code {code}")
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        if offset + nbytes > view.nbytes:
            raise BlockFormatError(f"tensor data at {offset}+{nbytes} runs past the {view.nbytes}-byte payload")
        if numel == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            with warnings.catch_warnings():
                # bytes from Redis or a file are read-only; the views are documented as such and
                # the cache copies them in, so torch's once-per-process warning is only log noise.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                out.append(torch.frombuffer(view, dtype=dtype, count=numel, offset=offset).view(shape))
    return out
