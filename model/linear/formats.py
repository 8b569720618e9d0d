"""Weight-only quantization for serving: int8 per output channel or in blocks of 32 (Q8_0), int4
in groups of 32 along K.

Two sources:
- a float weight [N, K]: int8 = round(w / s) with s = max|row| / 127 (symmetric, per row) for
  torch's kernel, or Q8_0's recipe per block of 32 for the native one; int4 = Q4_1's recipe per
  group of 32 (asymmetric: min and step, q in 0..15);
- a GGUF tensor already stored as Q4_0/Q4_1 (`Q41Blocks`; Q4_0's w = d * (q - 8) is Q4_1 with
  m = -8 d) or Q8_0 (`Q80Blocks`; Q5_0's w = d * (q - 16) is Q8_0 with codes q - 16): its codes, steps
  and minimums are served as they are. A Q5_1 tensor (w = d * q + m, 5-bit codes) is the one exception:
  its minimum has no place in 8-bit codes, so its weights are rounded to Q8_0 (`Q80Blocks.exact` False).
  Q4_1 reads w = d * q + m; torch's int4 kernels read w = (q - 8) * scale + zero, so scale = d
  and zero = m + 8 d, the same weight, with d and m rounded from float16 to the activation dtype
  (bfloat16 on CPU). The native kernel (quant_matmul.py) keeps d and m in float16;
- a GGUF tensor stored as a K-quant (`KQuantBlocks`: Q4_K, Q5_K, Q6_K), kept as the file's bytes:
  super-blocks of 256 weights; Q4_K and Q5_K hold 4- or 5-bit codes in 8 sub-blocks of 32 with a
  6-bit scale and minimum each under a float16 step and minimum step (w = d sc q - dmin m), Q6_K
  6-bit codes in 16 sub-blocks of 16 with an int8 scale each under a float16 step (w = d sc (q - 32)).
  Only the native kernel serves them (kquant_matmul.cpp, packed by quant_matmul.pack_kquant).

The kernels that consume these layouts live in kernels.py and quant_matmul.py.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # Q4_1's block and the int4 group size used everywhere here


@dataclass
class Q41Blocks:
    """A Q4_1 matrix [N, K] unpacked: q [N, K] uint8 codes 0..15, d and m [N, K/32] float32."""

    q: Tensor
    d: Tensor
    m: Tensor

    @staticmethod
    def from_raw(raw: np.ndarray) -> "Q41Blocks":
        """raw [N, K/32 * 20] bytes of GGUF Q4_1 blocks: float16 d, float16 m, 16 bytes of nibbles
        (low nibble = element j, high nibble = element j + 16 of the block)."""
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, 20)  # [N, K/32, 20]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nib = blocks[..., 4:]  # [N, K/32, 16]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, -1)  # [N, K]
        return Q41Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))

    def rows(self, index: Tensor) -> "Q41Blocks":
        return Q41Blocks(self.q[index], self.d[index], self.m[index])

    @staticmethod
    def cat(parts: list["Q41Blocks"]) -> "Q41Blocks":
        return Q41Blocks(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                         torch.cat([p.m for p in parts]))

    @staticmethod
    def from_raw_q40(raw: np.ndarray) -> "Q41Blocks":
        """raw [N, K/32 * 18] bytes of GGUF Q4_0 blocks: float16 d, 16 bytes of nibbles; w = d * (q - 8)."""
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, 18)  # [N, K/32, 18]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        nib = blocks[..., 2:]  # [N, K/32, 16]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, -1)  # [N, K]
        return Q41Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(-8 * d))

    def dequantize(self) -> Tensor:
        """[N, K] float32, exactly what GGUF readers produce."""
        return self.q.float() * self.d.repeat_interleave(GROUP, 1) + self.m.repeat_interleave(GROUP, 1)

    def half_steps(self) -> "Q41Blocks":
        """d and m rounded to float16, as GGUF stores them (a no-op for blocks read from a file)."""
        return Q41Blocks(self.q, self.d.half().float(), self.m.half().float())


@dataclass
class Q80Blocks:
    """A Q8_0 matrix [N, K] unpacked: q [N, K] int8 codes -127..127, d [N, K/32] float32; w = d * q.
    exact: the file's weights exactly (Q8_0, Q5_0); False for a Q5_1 tensor's, rounded to these codes
    (gguf_reader._quant_blocks)."""

    q: Tensor
    d: Tensor
    exact: bool = True

    @staticmethod
    def from_raw(raw: np.ndarray) -> "Q80Blocks":
        """raw [N, K/32 * 34] bytes of GGUF Q8_0 blocks: float16 d, 32 int8 codes."""
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, 34)  # [N, K/32, 34]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)  # [N, K]
        return Q80Blocks(torch.from_numpy(q), torch.from_numpy(d))

    @staticmethod
    def from_raw_q50(raw: np.ndarray) -> "Q80Blocks":
        """raw [N, K/32 * 22] bytes of GGUF Q5_0 blocks: float16 d, 32 high bits, 16 bytes of low nibbles;
        w = d * (q - 16) with q in 0..31. The same weights exactly as 8-bit codes q - 16 under the same d
        (Q8_0's layout, which the native kernel serves; 34 bytes a block instead of 22)."""
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, 22)  # [N, K/32, 22]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        high = blocks[..., 2:6].copy().view("<u4")  # [N, K/32, 1]: bit j is code j's fifth bit
        high = (high >> np.arange(32, dtype=np.uint32)) & 1  # [N, K/32, 32]
        nib = blocks[..., 6:]  # [N, K/32, 16]: codes j (low nibble) and j + 16 (high nibble)
        low = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)  # [N, K/32, 32]
        q = (low.astype(np.int8) | (high.astype(np.int8) << 4)) - np.int8(16)
        return Q80Blocks(torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(d))

    def rows(self, index: Tensor) -> "Q80Blocks":
        return Q80Blocks(self.q[index], self.d[index], self.exact)

    @staticmethod
    def cat(parts: list["Q80Blocks"]) -> "Q80Blocks":
        return Q80Blocks(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), all(p.exact for p in parts))

    def dequantize(self) -> Tensor:
        """[N, K] float32."""
        return self.q.float() * self.d.repeat_interleave(GROUP, 1)

    def to_raw(self) -> Tensor:
        """The GGUF Q8_0 bytes of these blocks, [N, K/32 * 34] uint8: a Q8_0 tensor's own bytes, and a
        Q5_0 tensor's weights exactly (its step is a float16 already)."""
        n = self.q.shape[0]
        d = self.d.half().view(torch.uint8).reshape(n, -1, 2)  # [N, K/32, 2]
        return torch.cat([d, self.q.view(torch.uint8).reshape(n, -1, GROUP)], dim=-1).reshape(n, -1)


class _NativeBlocks:
    """The native library's Q8_0 / Q4_1 quantizers and the kernel's packers (native/csrc/quantize_blocks.cpp:
    the bits of quantize_q80, quantize_q41, quant_matmul.pack_q8 and pack_q4), used when the model loader
    has loaded the library."""

    def __init__(self, lib):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.quantize_q80, self.pack_q8 = lib.lm_quantize_q80, lib.lm_pack_q8
        self.quantize_q41, self.pack_q4 = lib.lm_quantize_q41, lib.lm_pack_q4
        self.quantize_q80.argtypes = [p, i32, i64, i64, p, p, i32]
        self.quantize_q41.argtypes = [p, i32, i64, i64, p, p, p, i32]
        self.pack_q8.argtypes = [p, p, i64, i64, p, i32]
        self.pack_q4.argtypes = [p, p, p, i64, i64, p, i32]
        for fn in (self.quantize_q80, self.pack_q8, self.quantize_q41, self.pack_q4):
            fn.restype = i32


def native_blocks(w: Tensor | None = None) -> _NativeBlocks | None:
    """The native quantizers where the library is loaded (and `w`, when given, is a float32 or bfloat16
    matrix whose rows are whole blocks), else None."""
    from ..native.build import bound

    if w is not None and (w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2 or w.shape[1] % GROUP):
        return None
    return bound(_NativeBlocks)


def quantize_q80(w: Tensor) -> Q80Blocks:
    """Q8_0's recipe on a float weight [N, K] (K a multiple of 32): per block, d = max|w| / 127
    rounded to float16, q = round(w / d)."""
    N, K = w.shape
    native = native_blocks(w)
    if native is not None:  # the same bits in one pass over the rows
        w = w.contiguous()
        q, d = torch.empty(N, K, dtype=torch.int8), torch.empty(N, K // GROUP)
        if not native.quantize_q80(w.data_ptr(), int(w.dtype == torch.bfloat16), N, K, q.data_ptr(), d.data_ptr(),
                               torch.get_num_threads()):
            return Q80Blocks(q, d)
    return quantize_q80_torch(w)


def quantize_q80_torch(w: Tensor) -> Q80Blocks:
    """quantize_q80 in torch ops (where the native library is not loaded; the native one's oracle)."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    d = (g.abs().amax(-1) / 127).half().float()  # [N, K/32]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = (g * inv[..., None]).round().clamp_(-127, 127).to(torch.int8).reshape(N, K)
    return Q80Blocks(q, d)


def quantize_q41(w: Tensor) -> Q41Blocks:
    """Q4_1's recipe on a float weight [N, K] (K a multiple of 32): per group, m = min, d = (max - min) / 15."""
    N, K = w.shape
    native = native_blocks(w)
    if native is not None:  # the same bits in one pass over the rows
        w = w.contiguous()
        q, d, m = torch.empty(N, K, dtype=torch.uint8), torch.empty(N, K // GROUP), torch.empty(N, K // GROUP)
        if not native.quantize_q41(w.data_ptr(), int(w.dtype == torch.bfloat16), N, K, q.data_ptr(), d.data_ptr(),
                                   m.data_ptr(), torch.get_num_threads()):
            return Q41Blocks(q, d, m)
    return quantize_q41_torch(w)


def quantize_q41_torch(w: Tensor) -> Q41Blocks:
    """quantize_q41 in torch ops (where the native library is not loaded; the native one's oracle)."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [N, K/32]
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = ((g - lo[..., None]) * inv[..., None]).round().clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return Q41Blocks(q, d, lo)


def int4_pack(blocks: Q41Blocks, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(packed weight for _weight_int4pack_mm_for_cpu, scale_and_zero [K/32, N, 2] in `dtype`)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32).contiguous(), 1)
    scale_zero = torch.stack([blocks.d.t(), (blocks.m + 8 * blocks.d).t()], dim=-1)  # [K/32, N, 2]
    return packed, scale_zero.to(dtype).contiguous()


def int8_per_channel(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(int8 weight [N, K], scales [N] in `dtype`): symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp_(min=1e-12).to(dtype).float()  # [N], as the kernel will read it
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(dtype)


QK_K = 256  # weights per super-block along K
Q4_K, Q5_K, Q6_K = 12, 13, 14  # GGML type ids
KQUANT_TYPES = {Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
KQUANT_BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # a super-block in the file


@dataclass
class KQuantBlocks:
    """A Q4_K / Q5_K / Q6_K matrix [N, K] as the file stores it: raw [N, K/256 * block bytes] uint8."""

    raw: Tensor
    qtype: int  # GGML type id (KQUANT_TYPES)

    @staticmethod
    def from_raw(raw: np.ndarray, qtype: int) -> "KQuantBlocks":
        if qtype not in KQUANT_TYPES:
            raise ValueError(f"GGML type {qtype} is not a K-quant served natively ({', '.join(KQUANT_TYPES.values())} are)")
        return KQuantBlocks(torch.from_numpy(np.array(raw, dtype=np.uint8)), int(qtype))  # a copy: the file may close

    @property
    def type_name(self) -> str:
        return KQUANT_TYPES[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] // KQUANT_BLOCK_BYTES[self.qtype] * QK_K

    def rows(self, index: Tensor) -> "KQuantBlocks":
        return KQuantBlocks(self.raw[index], self.qtype)

    def dequantize(self) -> Tensor:
        """[N, K] float32, as gguf's reader computes it."""
        from gguf import GGMLQuantizationType, quants

        return torch.from_numpy(np.array(quants.dequantize(self.raw.numpy(), GGMLQuantizationType(self.qtype))))


def kquant_codes(blocks: KQuantBlocks) -> Tensor:
    """The codes [N, K] uint8 in weight order (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), from the bytes."""
    N, K = blocks.shape
    b = blocks.raw.reshape(N, K // QK_K, -1)  # [N, S, block bytes]
    if blocks.qtype == Q6_K:  # ql [0:128], qh [128:192]: 128-halves n of 4 runs of 32
        ql = b[..., :128].reshape(N, -1, 2, 1, 64)  # [N, S, n, 1, 64]
        ql = torch.cat([ql & 15, ql >> 4], dim=3).reshape(N, -1, 2, 4, 32)  # runs: low(0:32), low(32:64), high, high
        qh = b[..., 128:192].reshape(N, -1, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)  # [N, S, n, 4, 32]
        return (ql | (qh << 4)).reshape(N, K)
    qs = b[..., 16:144] if blocks.qtype == Q4_K else b[..., 48:176]  # [N, S, 128]: 64-runs a of 2 sub-blocks
    qs = qs.reshape(N, -1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(N, -1, 8, 32)  # sub-block 2a: low nibbles, 2a + 1: high
    if blocks.qtype == Q5_K:  # qh [16:48]: bit j of byte l = bit 4 of sub-block j's element l
        qh = b[..., 16:48].reshape(N, -1, 1, 32)
        q = q | torch.cat([((qh >> j) & 1) << 4 for j in range(8)], dim=2)
    return q.reshape(N, K)


__all__ = ["GROUP", "Q4_K", "Q5_K", "Q6_K", "KQUANT_BLOCK_BYTES", "KQUANT_TYPES", "KQuantBlocks", "QK_K", "Q41Blocks", "Q80Blocks", "kquant_codes", "quantize_q41", "quantize_q80", "quantize_q80_torch", "quantize_q41_torch", "native_blocks", "int4_pack", "int8_per_channel"]
