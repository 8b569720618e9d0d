"""The native weight-only matmul (quant_matmul.cpp, built by native/build.py): GGUF-style int4 / int8
blocks times activations quantized per row and block of 32 to int8 codes (plus an int8 code of
the remainder, "precise": ~16 bits), exact integer dot products.

torch's weight-only kernels are fast for one row and slow down with the batch (a decode step at 32
rows took ~2x bfloat16's on a 2-core EPYC), so a mode had to choose between one stream and many.
This kernel unpacks a group of 16 columns' codes once and reuses them for up to 12 rows, so rows
cost integer dot products (VNNI) rather than weight reads. Every output element is summed over
its blocks in one fixed order from its own row and column: batch-invariant by construction.

Weights are repacked at load (pack_q4 / pack_q8) into the layout the kernel streams; GGUF Q4_0,
Q4_1 and Q8_0 codes and float16 steps are served as the file holds them. GGUF's K-quants (Q4_K,
Q5_K, Q6_K) go to kquant_matmul.cpp, through the same entry point with bits = KQUANT_BITS: pack_kquant
lays their bytes out for it (the same bytes, moved; lm_kquant_pack in C++), with a table of segments so that a fused weight
mixing them (q|k|v of a Q4_K_M file: Q4_K, Q4_K, Q6_K) is one call in its own types.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

import numpy as np

from .formats import GROUP, KQUANT_TYPES, QK_K, KQuantBlocks, Q41Blocks, Q80Blocks, native_blocks
from .weight_memory import weight_buffer

GROUP_COLS = 16  # output columns per packed group (quant_matmul.cpp)
PATHS = {3: "avx512-vnni", 2: "avx-vnni", 1: "avx2"}  # lm_qmm_path() -> name
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}
AMX_NEVER, AMX_BY_RULE, AMX_ALWAYS = 0, 1, 2  # QuantMatmul.set_amx
KQUANT_BITS = 256  # `bits` of a weight packed by pack_kquant (lm_qmm hands it to kquant_matmul.cpp)


class QuantMatmul:
    """The loaded kernel: `__call__(x, packed, bits, n)` -> x @ W^T."""

    def __init__(self, lib: ctypes.CDLL):
        lib.lm_qmm_path.restype = ctypes.c_int
        self.path = PATHS.get(lib.lm_qmm_path())  # None: built without a path (no AVX2 here)
        lib.lm_qmm_amx.restype = ctypes.c_int
        lib.lm_qmm_set_amx.restype = ctypes.c_int
        lib.lm_qmm_set_amx.argtypes = [ctypes.c_int]
        tiles = lib.lm_qmm_amx()
        self.amx = bool(tiles)  # AMX tiles built and granted by the OS (or, in a test build, emulated)
        self.soft_tiles = tiles == 2  # native_common.h's software tile unit (-DLM_SOFT_TILES): tests only
        self._set_amx = lib.lm_qmm_set_amx
        fn = lib.lm_qmm
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [i32, i32, p, i32, i64, i64, p, i64, p, i32, i32]
        fn.restype = i32
        self._fn = fn
        self._pack = lib.lm_kquant_pack
        self._pack.argtypes = [p, i64, i64, i32, p, i32]
        self._pack.restype = i32

    def set_amx(self, mode: int) -> int:
        """Which calls take the AMX tiles: AMX_NEVER, AMX_BY_RULE (the default: 12 rows or more) or
        AMX_ALWAYS; returns the previous mode. The rows come out bitwise the same either way: a speed
        setting, for benchmarks and tests."""
        return self._set_amx(mode)

    @property
    def name(self) -> str:
        """The path that runs, as the startup line and reports say it."""
        return f"{self.path}+{'soft-tiles' if self.soft_tiles else 'amx'}" if self.amx else str(self.path)

    def pack_kquant(self, raw: Tensor, k: int, qtype: int, out: Tensor | None = None) -> Tensor:
        """One K-quant tensor's file bytes (raw [N, K/256 * block bytes] uint8) -> its groups in
        kquant_matmul.cpp's layout, the same number of bytes (into `out`, a contiguous uint8 slice, when given)."""
        raw = raw.contiguous()
        out = torch.empty(raw.numel(), dtype=torch.uint8) if out is None else out
        if out.numel() != raw.numel() or not out.is_contiguous():
            raise ValueError(f"K-quant packing needs {raw.numel()} contiguous bytes, got {out.numel()}")
        if self._pack(raw.data_ptr(), raw.shape[0], k, qtype, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"K-quant packing does not take GGML type {qtype} at N={raw.shape[0]}, K={k}")
        return out

    @staticmethod
    def supports(n: int, k: int) -> bool:
        return n % GROUP_COLS == 0 and k % GROUP == 0

    def __call__(self, x: Tensor, packed: Tensor, bits: int, n: int, precise: bool = True) -> Tensor:
        """x [M, K] bfloat16 or float32 -> [M, n] in x's dtype. precise: activations as two int8
        codes per value (~16 bits), else one (int8 per block of 32: ~2x fewer dot products)."""
        x = x.contiguous()
        M, K = x.shape
        out = torch.empty(M, n, dtype=x.dtype)
        rc = self._fn(bits, int(precise), x.data_ptr(), _DTYPES[x.dtype], M, K, packed.data_ptr(), n, out.data_ptr(),
                      _DTYPES[x.dtype], torch.get_num_threads())
        if rc:
            raise ValueError(f"quantized matmul does not take bits={bits}, K={K}, N={n}" if rc == 1 else
                             "quantized matmul is not built for this CPU (no AVX2)")
        return out


_KERNEL: dict[str, QuantMatmul | None] = {}


def kernel(cache_dir: Path | None = None) -> QuantMatmul | None:
    """The kernel for this machine (native.load), or None without a compiler or an AVX2 path."""
    key = str(cache_dir)
    if key not in _KERNEL:  # looked up first: native.load resolves the path (~70 us of syscalls a call)
        from ..native import build as native

        lib, _ = native.load(cache_dir)
        k = QuantMatmul(lib) if lib is not None else None
        _KERNEL[key] = k if k is not None and k.path is not None else None
    return _KERNEL[key]


_default_cache: list[Path | None] = [None]


def use_cache_dir(cache_dir: Path | None) -> None:
    """Where default_kernel() builds and caches the library (the loader's cache_dir)."""
    _default_cache[0] = cache_dir


def default_kernel() -> QuantMatmul | None:
    return kernel(_default_cache[0])


def kernel_or_raise() -> QuantMatmul:
    k = default_kernel()
    if k is None:
        raise RuntimeError("the native quantized kernel is not built here")
    return k


def pack_q4(blocks: Q41Blocks) -> Tensor:
    """Q4_0/Q4_1 blocks [N, K] -> the kernel's int4 layout (uint8, N/16 * K/32 * 320 bytes); d and m
    in float16 (as GGUF stores them)."""
    N, K = blocks.q.shape
    native = native_blocks() if N % GROUP_COLS == 0 and K % GROUP == 0 else None
    if native is not None:  # the same bytes in one pass
        q, d, m = (blocks.q.to(torch.uint8).contiguous(), blocks.d.float().contiguous(),
                   blocks.m.float().contiguous())
        out = weight_buffer(N // GROUP_COLS * (K // GROUP) * 320)
        if not native.pack_q4(q.data_ptr(), d.data_ptr(), m.data_ptr(), N, K, out.data_ptr(), torch.get_num_threads()):
            return out
    return pack_q4_torch(blocks)


def pack_q4_torch(blocks: Q41Blocks) -> Tensor:
    """pack_q4 in torch ops (where the native library is not loaded; the native one's oracle)."""
    N, K = blocks.q.shape
    G, B = N // GROUP_COLS, K // GROUP
    q = blocks.q.to(torch.uint8).reshape(G, GROUP_COLS, B, 4, 2, 4)  # [G, c, B, j, h, t]: k = 32B + 8j + 4h + t
    q = q.permute(0, 2, 3, 1, 4, 5)  # [G, B, j, c, h, t]
    nib = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(G, B, 256)  # low nibble k = 8j+t, high k = 8j+4+t
    d = blocks.d.half().reshape(G, GROUP_COLS, B).permute(0, 2, 1).contiguous().view(torch.uint8)  # [G, B, 32]
    m = blocks.m.half().reshape(G, GROUP_COLS, B).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([nib, d, m], dim=-1).reshape(-1).contiguous()  # [G * B * 320]


def pack_q8(blocks: Q80Blocks) -> Tensor:
    """Q8_0 blocks [N, K] -> the kernel's int8 layout (uint8, N/16 * K/32 * 544 bytes): codes + 128."""
    N, K = blocks.q.shape
    native = native_blocks() if N % GROUP_COLS == 0 and K % GROUP == 0 else None
    if native is not None:  # the same bytes in one pass
        q, d = blocks.q.contiguous(), blocks.d.float().contiguous()
        out = weight_buffer(N // GROUP_COLS * (K // GROUP) * 544)
        if not native.pack_q8(q.data_ptr(), d.data_ptr(), N, K, out.data_ptr(), torch.get_num_threads()):
            return out
    return pack_q8_torch(blocks)


def pack_q8_torch(blocks: Q80Blocks) -> Tensor:
    """pack_q8 in torch ops (where the native library is not loaded; the native one's oracle)."""
    N, K = blocks.q.shape
    G, B = N // GROUP_COLS, K // GROUP
    q = (blocks.q.to(torch.int16) + 128).to(torch.uint8).reshape(G, GROUP_COLS, B, 8, 4)  # [G, c, B, j, t]
    codes = q.permute(0, 2, 3, 1, 4).reshape(G, B, 512)  # [G, B, j, c, t]: k = 32B + 4j + t
    d = blocks.d.half().reshape(G, GROUP_COLS, B).permute(0, 2, 1).contiguous().view(torch.uint8)  # [G, B, 32]
    return torch.cat([codes, d], dim=-1).reshape(-1).contiguous()  # [G * B * 544]


def pack_kquant(parts: list[KQuantBlocks]) -> Tensor:
    """Tensors sharing an input, fused along N ([sum N, K]), for the kernel: a table of segments (int64
    count, K, then GGML type, columns and byte offset per segment; consecutive parts of one type are
    one segment), padded to 64 bytes, then each segment's groups. uint8."""
    K = parts[0].shape[1]
    if any(p.shape[1] != K for p in parts) or any(n % GROUP_COLS or k % QK_K for n, k in (p.shape for p in parts)):
        raise ValueError(f"K-quant weights need N % {GROUP_COLS} = 0 and one K % {QK_K} = 0, got "
                         f"{[p.shape for p in parts]}")
    runs: list[list[KQuantBlocks]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    table_bytes = -(-8 * (2 + 3 * len(runs)) // 64) * 64
    table = np.zeros(table_bytes // 8, dtype=np.int64)
    table[:2] = len(runs), K
    out = weight_buffer(table_bytes + sum(p.raw.numel() for p in parts))
    offset = table_bytes
    for i, run in enumerate(runs):
        table[2 + 3 * i: 5 + 3 * i] = run[0].qtype, sum(p.shape[0] for p in run), offset
        for p in run:  # groups of GROUP_COLS rows never straddle two parts: each part packs on its own
            kernel_or_raise().pack_kquant(p.raw, K, p.qtype, out[offset:offset + p.raw.numel()])
            offset += p.raw.numel()
    out[:table_bytes] = torch.from_numpy(table.view(np.uint8))
    return out


def kquant_segments(packed: Tensor) -> list[tuple[str, int]]:
    """A packed K-quant weight's segments, as (GGML type name, output columns), in column order."""
    count = int(packed[:8].numpy().view(np.int64)[0])
    rows = packed[: -(-8 * (2 + 3 * count) // 64) * 64].numpy().view(np.int64)[2:2 + 3 * count].reshape(count, 3)
    return [(KQUANT_TYPES[int(t)], int(n)) for t, n, _ in rows]


__all__ = ["KQUANT_BITS", "kquant_segments", "pack_kquant", "AMX_ALWAYS", "AMX_BY_RULE", "AMX_NEVER", "QuantMatmul", "kernel", "default_kernel", "use_cache_dir", "pack_q4", "pack_q8", "PATHS", "GROUP_COLS"]
